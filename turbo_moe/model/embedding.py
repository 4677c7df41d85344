"""Token embedding lookup with a choice of backward (`ModelConfig.embedding_grad`).

The gradient of `table[ids]` is a scatter-add of the B*S rows of d_hidden into the (V, D) table. XLA's GPU scatter adds
with atomics, so rows of frequent tokens serialise: on real text (Zipf-like ids) it took 15.5 ms (embedding) and 21 ms
(the MTP block's lookup of the same table) of a 172 ms `reduced` step on an H200 where uniform synthetic ids took
0.2 ms (experiments/NOTES.md, issue 14, call 56). The other backwards are deterministic and float32-accumulated:
"segment" (the default) sorts the ids and sums each id's rows (`turbo_moe.ops.segment_sum`): cost tokens x D, 0.4-0.7 ms
for 16,384 tokens x d 1280 and 1.5 ms at d 7168 x V 129,280 on Zipf ids; "matmul" is one_hot(ids)^T @ d_hidden in chunks
of tokens, cost V x tokens x D (1.1 / 3.4 / 12.7 ms at V = 8192 / 32768 / 129,280 and d 1280, 42 ms at d 7168), kept as a
pure-XLA reference (H200, experiments/results/embedding_grad_segment_*h200.csv).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.model.config import EMBEDDING_GRADS
from turbo_moe.ops.segment_sum import segment_sum

# Tokens per one-hot chunk of the "matmul" backward: bounds the (chunk, V) one-hot (256 MiB bf16 at V = 32768).
MATMUL_CHUNK_TOKENS = 4096


def lookup(table: jax.Array, ids: jax.Array, grad: str = "segment") -> jax.Array:
    """table (V, D), integer ids (...) -> (..., D); `grad` picks the backward ("segment", the model's default:
    `turbo_moe.ops.segment_sum`; "matmul": a chunked one-hot matmul; "scatter": JAX's own)."""
    if grad == "scatter":
        return jnp.take(table, ids, axis=0)
    if grad == "matmul":
        return _lookup_matmul_grad(table, ids)
    if grad == "segment":
        return _lookup_segment_grad(table, ids)
    raise ValueError(f"embedding grad: expected one of {EMBEDDING_GRADS}, got {grad!r}")


@jax.custom_vjp
def _lookup_matmul_grad(table, ids):
    return jnp.take(table, ids, axis=0)


def _fwd(table, ids):
    return jnp.take(table, ids, axis=0), (ids, jnp.zeros((0,), table.dtype), table.shape[0])


def _bwd(res, g):
    ids, table_type, vocab = res
    d = g.shape[-1]
    flat_ids, flat_g = ids.reshape(-1), g.reshape(-1, d)
    n = flat_ids.shape[0]
    chunk = min(MATMUL_CHUNK_TOKENS, n)
    pad = -n % chunk
    flat_ids = jnp.pad(flat_ids, (0, pad), constant_values=-1)  # -1: a one-hot row of zeros
    flat_g = jnp.pad(flat_g, ((0, pad), (0, 0)))

    def add_chunk(acc, part):
        part_ids, part_g = part
        one_hot = jax.nn.one_hot(part_ids, vocab, dtype=part_g.dtype)  # (chunk, V), exact in any float dtype
        return acc + jnp.einsum("tv,td->vd", one_hot, part_g, preferred_element_type=jnp.float32), None

    parts = (flat_ids.reshape(-1, chunk), flat_g.reshape(-1, chunk, d))
    total, _ = jax.lax.scan(add_chunk, jnp.zeros((vocab, d), jnp.float32), parts)
    return total.astype(table_type.dtype), None


_lookup_matmul_grad.defvjp(_fwd, _bwd)


@jax.custom_vjp
def _lookup_segment_grad(table, ids):
    return jnp.take(table, ids, axis=0)


def _segment_bwd(res, g):
    from turbo_moe.model.expert_parallel import batch_summed  # here: that module imports the model's

    ids, table_type, vocab = res
    d = g.shape[-1]

    def local(part_g, part_ids):  # the per-device sum on a mesh (XLA would gather the batch for the FFI call)
        return segment_sum(part_g.reshape(-1, d), part_ids.reshape(-1), vocab)

    if ids.ndim == 0:  # one id: give it the batch axis that batch_summed splits
        g, ids = g[None], ids[None]
    return batch_summed(local)(g, ids).astype(table_type.dtype), None


_lookup_segment_grad.defvjp(_fwd, _segment_bwd)
