"""Small building blocks of the decoder: RMSNorm, RoPE, MLA attention, SwiGLU MLP.

Parameters are stored in `cfg.param_dtype` (float32); matmuls run in `cfg.dtype` (bfloat16).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from turbo_moe.model.config import ModelConfig
from turbo_moe.model.normal_init import normal


def compute_dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.dtype)


def param_dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.param_dtype)


def linear(cfg: ModelConfig, d_in: int, d_out: int, rngs: nnx.Rngs, **kwargs) -> nnx.Linear:
    """Bias-free projection with the model's init, param dtype and compute dtype."""
    return nnx.Linear(
        d_in, d_out, use_bias=False, dtype=compute_dtype(cfg), param_dtype=param_dtype(cfg),
        kernel_init=normal(cfg.init_std), rngs=rngs, **kwargs)


def out_projection(cfg: ModelConfig, d_in: int, rngs: nnx.Rngs) -> nnx.Linear:
    """A block's projection back into the residual stream (attention and SwiGLU `wo`): zero at init with
    the router recipe's `zero_init_out_proj` (it draws its random key either way, so no other parameter changes)."""
    zero = cfg.router.zero_init_out_proj
    kernel_init = nnx.initializers.zeros_init() if zero else normal(cfg.init_std)
    return nnx.Linear(d_in, cfg.d_model, use_bias=False, dtype=compute_dtype(cfg), param_dtype=param_dtype(cfg),
                      kernel_init=kernel_init, rngs=rngs)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, returned in the compute dtype."""

    def __init__(self, dim: int, cfg: ModelConfig):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype(cfg)))
        self.eps = cfg.rms_norm_eps
        self.out_dtype = compute_dtype(cfg)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(self.out_dtype)


def rope_tables(seq_len: int, rope_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin tables, each (S, rope_dim // 2) float32, for positions 0..seq_len-1."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim))  # (R/2,)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # (S, R/2)
    return jnp.cos(angles), jnp.sin(angles)


# RoPE and the head splits below have written-out backwards that build each gradient with one concatenate. Autodiff
# of a split (or of rotate_half's halves) gives pad(a) + pad(b), which XLA fuses into loops that evaluate every operand
# at every element, next to a layout change out of cuDNN (docs/performance.md).
@jax.custom_vjp
def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the last dim of x (B, S, N, R) in half-split ("rotate_half") pairing, float32 math."""
    return _rope(x, cos, sin, inverse=False)


def _rope(x, cos, sin, inverse: bool):
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]  # (B, S, N, R/2) each
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]  # (1, S, 1, R/2)
    sin = -sin if inverse else sin  # the rotation's transpose is the rotation by -angle
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def _rope_fwd(x, cos, sin):
    return _rope(x, cos, sin, inverse=False), (cos, sin)


def _rope_bwd(tables, g):
    cos, sin = tables
    return _rope(g, cos, sin, inverse=True), jnp.zeros_like(cos), jnp.zeros_like(sin)  # the tables are constants


apply_rope.defvjp(_rope_fwd, _rope_bwd)


def split_last(x: jax.Array, sizes: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """x split along its last dim into parts of `sizes`; the gradient is the parts' cotangents concatenated."""
    if sum(sizes) != x.shape[-1]:
        raise ValueError(f"split_last: sizes {sizes} must add up to the last dim {x.shape[-1]} of x {x.shape}")
    return _split_last(x, tuple(sizes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _split_last(x, sizes):
    return tuple(jnp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=-1))


def _split_fwd(x, sizes):
    return _split_last(x, sizes), None


def _split_bwd(sizes, _, cotangents):
    return (jnp.concatenate(cotangents, axis=-1),)


_split_last.defvjp(_split_fwd, _split_bwd)


class MLAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), causal, training form (no KV cache).

    q = W_qb RMSNorm(W_qa x)            (or W_q x when q_lora_rank == 0)
    [c_kv, k_rope] = W_kva x;  [k_nope, v] = W_kvb RMSNorm(c_kv)
    k_rope is shared by all heads; RoPE is applied to the decoupled q_rope / k_rope dims only.
    """

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        h, d = cfg.n_heads, cfg.d_model
        if cfg.q_lora_rank > 0:
            self.wq_a = linear(cfg, d, cfg.q_lora_rank, rngs)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg)
            self.wq_b = linear(cfg, cfg.q_lora_rank, h * cfg.qk_head_dim, rngs)
        else:
            self.wq = linear(cfg, d, h * cfg.qk_head_dim, rngs)
        self.wkv_a = linear(cfg, d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, rngs)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg)
        self.wkv_b = linear(cfg, cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), rngs)
        self.wo = out_projection(cfg, h * cfg.v_head_dim, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        cfg = self.cfg
        b, s, _ = x.shape
        h, nope, rope, vdim = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank > 0:
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        else:
            q = self.wq(x)
        q_nope, q_rope = split_last(q.reshape(b, s, h, nope + rope), (nope, rope))  # (B, S, H, nope), (.., rope)
        q = jnp.concatenate([q_nope, apply_rope(q_rope, cos, sin)], axis=-1)

        kv_a = self.wkv_a(x)  # (B, S, kv_lora + rope)
        c_kv, k_rope = split_last(kv_a, (cfg.kv_lora_rank, rope))
        k_rope = apply_rope(k_rope[:, :, None, :], cos, sin)  # (B, S, 1, rope)
        kv = self.wkv_b(self.kv_norm(c_kv)).reshape(b, s, h, nope + vdim)  # (B, S, H, nope+v)
        k_nope, v = split_last(kv, (nope, vdim))
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (b, s, h, rope))], axis=-1)  # (B, S, H, qk)

        out = causal_attention(q, k, v)  # (B, S, H, v)
        return self.wo(out.reshape(b, s, h * vdim))


# The name of the attention kernel's inputs (q, k, v as the kernel takes them) for the remat policies (model/stack.py).
ATTENTION_SAVE_NAME = "attention_qkv"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, impl: str = "auto") -> jax.Array:
    """softmax(q k^T / sqrt(d_qk)) v, causal, via jax.nn.dot_product_attention.

    q, k (B, S, H, Dqk); v (B, S, H, Dv) -> (B, S, H, Dv). jax.nn.dot_product_attention needs one head
    dim for q, k and v, so the smaller side is zero-padded (zeros change neither scores nor outputs) and
    the result sliced; the scale stays 1/sqrt(Dqk). impl "auto" (= "cudnn_unpadded"): on the GPU for bf16/f16,
    cuDNN with v at its own width through JAX's private cuDNN entry point (`_cudnn_unpadded`), else (without that
    entry point, said once) cuDNN flash attention with v padded when cuDNN accepts the shapes; XLA otherwise.
    "cudnn": cuDNN with v padded; "xla": XLA's.
    """
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if impl in ("auto", "cudnn_unpadded") and d_qk != d_v and _cudnn_applies(jax.default_backend(), q.dtype):
        unpadded = _cudnn_unpadded()
        if unpadded is not None:
            q, k, v = (checkpoint_name(t, ATTENTION_SAVE_NAME) for t in (q, k, v))
            return unpadded(q, k, v, d_qk ** -0.5)
    if impl == "cudnn_unpadded":
        impl = "auto"
    width = max(d_qk, d_v)
    pad = lambda t: t if t.shape[-1] == width else jnp.pad(t, [(0, 0)] * 3 + [(0, width - t.shape[-1])])
    # Named: the remat policy "dots_experts_attention" keeps the kernel's inputs, which the backward reads, instead
    # of rebuilding them from the projections (RoPE, concatenates, the pad).
    q, k, v = (checkpoint_name(pad(t), ATTENTION_SAVE_NAME) for t in (q, k, v))
    attend = lambda implementation: jax.nn.dot_product_attention(
        q, k, v, scale=d_qk ** -0.5, is_causal=True, implementation=implementation)
    if impl != "auto":
        return attend(impl)[..., :d_v]
    if _cudnn_applies(jax.default_backend(), q.dtype):
        try:
            return attend("cudnn")[..., :d_v]
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # shapes or cuDNN version not supported: fall back to XLA
    return attend("xla")[..., :d_v]


def _cudnn_applies(platform: str, dtype) -> bool:
    return platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


def attention_kernel(dtype: str, platform: str) -> str:
    """What `causal_attention`'s "auto" runs for MLA's head dims (d_v < d_qk) in `dtype` on `platform`: "cudnn_unpadded",
    "cudnn" (this JAX lacks the unpadded entry point) or "xla"."""
    if not _cudnn_applies(platform, dtype):
        return "xla"
    return "cudnn_unpadded" if _cudnn_unpadded() is not None else "cudnn"


@functools.lru_cache(maxsize=None)
def _cudnn_unpadded():
    """JAX's own cuDNN attention entry point, which takes v narrower than q and k (jax.nn.dot_product_attention
    checks one head dim for all three); it saves the v pad, its slice and a sixth of the kernel's work at MLA's
    head dims (docs/performance.md). Private: None, with a warning, on a JAX without it."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    except ImportError as error:
        warnings.warn(f"cuDNN attention with v at its own width: this JAX ({jax.__version__}) has no "
                      f"jax._src.cudnn.fused_attention_stablehlo ({error}); v is padded instead", RuntimeWarning)
        return None
    return lambda q, k, v, scale: dot_product_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)); used for dense layers and the shared experts."""

    def __init__(self, cfg: ModelConfig, hidden: int, rngs: nnx.Rngs):
        self.wi_gate = linear(cfg, cfg.d_model, hidden, rngs)
        self.wi_up = linear(cfg, cfg.d_model, hidden, rngs)
        self.wo = out_projection(cfg, hidden, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.wo(jax.nn.silu(self.wi_gate(x)) * self.wi_up(x))
