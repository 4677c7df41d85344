"""Cross-entropy through the output head over chunks of positions (`ModelConfig.loss_chunk_tokens`).

The unchunked loss keeps the float32 (B, S, V) logits of every head for the backward and materialises
their float32 gradient (2 GiB each at 8 x 2048 tokens and V = 32768). Here a `lax.scan` over chunks of
positions computes one chunk's logits at a time, and, when differentiated, its gradient in the same pass
(a `custom_vjp` whose forward also returns dL/dhidden and dL/dhead): no logits are stored, nothing is
recomputed, and the backward only scales the two by the incoming cotangent.

Numerics: the loss is the unchunked one up to float32 summation order. The head's backward matmuls take
dL/dlogits in the compute dtype (bf16 by default) with float32 accumulation, like every other layer's
backward; the unchunked path multiplies the float32 dL/dlogits by the bf16 operands upcast to float32.
dL/dhead (and dL/dbias of an optional float32 head bias, an extra row of the same GEMM) is accumulated over the
chunks in float32. The log-sum-exp is one pass over each chunk's logits (a running max and rescaled sum).
With `logits_dtype="bfloat16"` the head GEMM rounds the logits to bf16 (MaxText's default) and the loss upcasts
them: its arithmetic stays float32, its passes read half the bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from turbo_moe.model.config import LOGITS_DTYPES


def chunked_cross_entropy(hidden: jax.Array, weight: jax.Array, targets: jax.Array, mask: jax.Array,
                          chunk_tokens: int, vocab_major: bool = False, bias: jax.Array | None = None,
                          logits_dtype: str = "float32") -> jax.Array:
    """Mean token cross-entropy over `mask` of the logits `hidden @ head`: `model.cross_entropy` of
    `model.logits(hidden)`, without the (B, S, V) logits.

    hidden (B, S, D) in the compute dtype (final-normalised); weight (D, V), or (V, D) with `vocab_major`
    (a tied embedding table), in the parameter dtype (cast to hidden's dtype once, before the chunks); bias None or
    (V,) float32, added to the float32 logits (the router recipe's `head_bias`); targets, mask (B, S); `logits_dtype`
    ("float32" or "bfloat16", `ModelConfig.logits_dtype`) what the head GEMM writes, upcast by the loss. A chunk
    spans every sequence of the batch and `max(1, chunk_tokens // B)` positions (chunks
    over positions keep a batch sharded over devices evenly split); the last chunk is zero-padded and
    masked when the positions do not divide.
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2] or mask.shape != targets.shape:
        raise ValueError(f"hidden (B, S, D), targets and mask (B, S) expected, got {hidden.shape}, "
                         f"{targets.shape}, {mask.shape}")
    vocab_axis = 0 if vocab_major else 1
    if weight.ndim != 2 or weight.shape[1 - vocab_axis] != hidden.shape[-1]:
        raise ValueError(f"weight {weight.shape} does not match hidden size {hidden.shape[-1]} "
                         f"({'(V, D)' if vocab_major else '(D, V)'} expected)")
    vocab = weight.shape[vocab_axis]
    if bias is not None and (bias.shape != (vocab,) or bias.dtype != jnp.float32):
        raise ValueError(f"bias must be float32 ({vocab},) (the head's vocabulary), got {bias.dtype}{tuple(bias.shape)}")
    if logits_dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits_dtype must be 'float32' or 'bfloat16', got {logits_dtype!r}")
    static = (chunk_tokens, bool(vocab_major), jnp.dtype(hidden.dtype).name, jnp.dtype(weight.dtype).name,
              logits_dtype)
    return _cross_entropy(hidden, weight, bias, targets.astype(jnp.int32), mask.astype(jnp.float32), static)


def chunk_positions(batch: int, seq_len: int, chunk_tokens: int) -> tuple[int, int]:
    """(positions per chunk, number of chunks) for a (batch, seq_len) token grid."""
    positions = max(1, min(seq_len, chunk_tokens // batch))
    return positions, -(-seq_len // positions)


def _to_chunks(x: jax.Array, positions: int, n: int) -> jax.Array:
    """(B, S, ...) -> (n, B, positions, ...), zero-padded along S."""
    b, s = x.shape[:2]
    x = jnp.pad(x, [(0, 0), (0, n * positions - s)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(b, n, positions, *x.shape[2:]), 1, 0)


def _from_chunks(x: jax.Array, seq_len: int) -> jax.Array:
    """(n, B, positions, ...) -> (B, S, ...), padding dropped."""
    n, b, p = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(b, n * p, *x.shape[3:])[:, :seq_len]


def _equations(vocab_major: bool) -> tuple[str, str, str]:
    """einsums of (logits, dL/dhidden, dL/dweight) for a (D, V) or a vocab-major (V, D) weight."""
    w = "vd" if vocab_major else "dv"
    return f"bpd,{w}->bpv", f"bpv,{w}->bpd", f"bpd,bpv->{w}"


def _chunk_logits(h, weight, bias, vocab_major, logits_dtype):
    """One chunk's float32 logits (B, P, V), as `DeepSeekModel.logits` computes them: the GEMM writes
    `logits_dtype` (bf16: half the bytes for the passes that read them; XLA fuses the upcast into those)."""
    logits = jnp.einsum(_equations(vocab_major)[0], h, weight.astype(h.dtype),
                        preferred_element_type=jnp.dtype(logits_dtype)).astype(jnp.float32)
    return logits if bias is None else logits + bias


def _logsumexp(logits):
    """(B, P, V) float32 -> (B, P): log-sum-exp in one pass over the logits (a running max and a sum rescaled
    to it, combined pairwise), where `jax.nn.logsumexp` reads them twice (max, then sum): the logits of a
    chunk are 512 MiB at 4096 tokens x V 32768, and these passes are a large share of the head's time."""
    def combine(a, b):
        (m_a, s_a), (m_b, s_b) = a, b
        # one exp per combine (the side with the larger max keeps its sum as is): the pass is exp-bound otherwise
        scale = jnp.exp(jnp.where(m_a == m_b, 0.0, -jnp.abs(m_a - m_b)))  # equal (also both -inf): 1, no nan
        return jnp.maximum(m_a, m_b), jnp.where(m_a >= m_b, s_a + s_b * scale, s_a * scale + s_b)

    init = (jnp.array(-jnp.inf, logits.dtype), jnp.array(0.0, logits.dtype))
    m, total = jax.lax.reduce((logits, jnp.ones_like(logits)), init, combine, (logits.ndim - 1,))
    return m + jnp.log(total)


def _nll(logits, targets):
    """(B, P, V) float32, (B, P) -> (B, P) negative log-likelihoods, and the log-sum-exp."""
    lse = _logsumexp(logits)
    return lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0], lse


def _split(hidden, targets, mask, chunk_tokens):
    b, s, _ = hidden.shape
    positions, n = chunk_positions(b, s, chunk_tokens)
    return tuple(_to_chunks(x, positions, n) for x in (hidden, targets, mask))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _cross_entropy(hidden, weight, bias, targets, mask, static):
    """Loss only (evaluation, or the primal of the VJP): one chunk's logits live at a time."""
    chunk_tokens, vocab_major, _, _, logits_dtype = static
    weight = weight.astype(hidden.dtype)  # once: XLA kept the cast inside the loop (60 us a chunk at D 1280, V 32768)

    def body(total, xs):
        h, t, m = xs
        nll, _ = _nll(_chunk_logits(h, weight, bias, vocab_major, logits_dtype), t)
        return total + jnp.sum(nll * m), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), _split(hidden, targets, mask, chunk_tokens))
    return total / jnp.maximum(jnp.sum(mask), 1.0)


# With a head bias, dL/dbias is the column sum of dL/dlogits: one more row of the dL/dhead GEMM, whose lhs gets a
# ones column (and zeros to keep rows 16-byte aligned). Summed in the elementwise pass instead, that column
# reduction made the pass well slower than its bytes' time.
_BIAS_COLUMNS = 8


def _with_ones_column(h):
    """(B, P, D) -> (B, P, D + 8): h, a ones column, zeros."""
    ones = jnp.ones(h.shape[:-1] + (1,), h.dtype)
    return jnp.concatenate([h, ones, jnp.zeros(h.shape[:-1] + (_BIAS_COLUMNS - 1,), h.dtype)], axis=-1)


def _cross_entropy_fwd(hidden, weight, bias, targets, mask, static):
    """Loss and its gradients in one pass over the chunks; the gradients are the residuals."""
    chunk_tokens, vocab_major, _, _, logits_dtype = static
    _, grad_hidden_eq, grad_weight_eq = _equations(vocab_major)
    inv_count = 1.0 / jnp.maximum(jnp.sum(mask), 1.0)
    d = hidden.shape[-1]
    weight_c = weight.astype(hidden.dtype)  # once: XLA kept the cast inside the loop (60 us a chunk at D 1280, V 32768)

    def body(carry, xs):
        total, grad_weight = carry
        h, t, m = xs
        logits = _chunk_logits(h, weight_c, bias, vocab_major, logits_dtype)  # (B, P, V) float32
        nll, lse = _nll(logits, t)
        # d(sum m * nll / count) / dlogits = (softmax - onehot(target)) * m / count
        grad_logits = (jnp.exp(logits - lse[..., None]) - jax.nn.one_hot(t, logits.shape[-1], dtype=jnp.float32)
                       ) * (m * inv_count)[..., None]
        grad_logits = grad_logits.astype(h.dtype)  # backward matmuls in the compute dtype, float32 accumulation
        grad_h = jnp.einsum(grad_hidden_eq, grad_logits, weight_c, preferred_element_type=jnp.float32)
        lhs = h if bias is None else _with_ones_column(h)  # + dL/dbias as the GEMM's row d
        grad_weight = grad_weight + jnp.einsum(grad_weight_eq, lhs, grad_logits, preferred_element_type=jnp.float32)
        return (total + jnp.sum(nll * m), grad_weight), grad_h

    rows = d if bias is None else d + _BIAS_COLUMNS
    init = (jnp.zeros((), jnp.float32), jnp.zeros((weight.shape[0], rows) if vocab_major else (rows, weight.shape[1]),
                                                  jnp.float32))
    (total, grad_weight), grad_h = jax.lax.scan(body, init, _split(hidden, targets, mask, chunk_tokens))
    grad_bias = None
    if bias is not None:
        grad_bias = grad_weight[:, d] if vocab_major else grad_weight[d]
        grad_weight = grad_weight[:, :d] if vocab_major else grad_weight[:d]
    return total * inv_count, (_from_chunks(grad_h, hidden.shape[1]), grad_weight, grad_bias)


def _cross_entropy_bwd(static, residuals, g):
    _, _, hidden_dtype, weight_dtype, _ = static
    grad_h, grad_weight, grad_bias = residuals  # float32: one rounding, after the cotangent's scale
    return ((grad_h * g).astype(hidden_dtype), (grad_weight * g).astype(weight_dtype),
            None if grad_bias is None else grad_bias * g, None, None)


_cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)
