"""DeepSeek-V3's FP8 scaling (technical report, section 3.3) in jnp, and expert weights quantised once.

- activations per 1x128 tile along K (`quantize_rows`): one float32 scale per row and 128 columns;
- weights per 128x128 block (`quantize_blocks`): one float32 scale per block;
- `fp8_weights(w)`: a weight's 128x128-block FP8 values in both layouts the FP8 GEMMs read, made once and then
  passed to `grouped_gemm_fp8` / `expert_block` in place of the bf16 weight, for every call that uses it (all the
  micro-batches and layers of one optimizer step). Its gradient goes to the weight itself (`Fp8Weights.master`),
  as the op's gradient goes to a bf16 rhs: straight through the quantisation.

The quantisers multiply by 1/scale (not divide): XLA rewrites a division by a broadcast into that product, and the
division rounded some FP8 ties differently between eager and jitted code. These jnp functions are the references the
FFI quantisers (`permute_fp8`, `quantize_group_columns`, `quantize_rows`) match bit for bit.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

BLOCK = 128  # the scale tile along the contraction, and the weights' block edge
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
FP8_DTYPES = (E4M3, E5M2)
F32 = jnp.dtype(jnp.float32)


def fp8_dtype(name: str, dtype) -> jnp.dtype:
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:  # not a dtype at all: named in the error as given
        dtype = repr(dtype)
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {dtype}")
    return dtype


def scale_of(amax, fmax: float):
    """amax * (1/fmax) in float32; 1 for an all-zero tile. The quantisers then multiply by 1/scale: both spelled as
    the products XLA rewrites a division by a broadcast into, so the jitted and eager results and numpy agree bit for
    bit (a division rounds some ties of the FP8 cast differently)."""
    return jnp.where(amax > 0, amax * jnp.float32(1.0 / fmax), jnp.float32(1.0)).astype(F32)


def quantize_tiles(t, axis: int, dtype):
    """t float32 with 128-wide tiles along `axis` -> (q, scale with `axis` reduced)."""
    fmax = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(t), axis=axis)
    scale = scale_of(amax, fmax)
    q = jnp.clip(t * jnp.expand_dims(1.0 / scale, axis), -fmax, fmax).astype(dtype)
    return q, scale


def quantize_rows(x, dtype=E4M3):
    """Activations per 1x128 tile: x (M, K), K % 128 == 0 -> q (M, K) fp8, scale (M, K/128) float32."""
    dtype = fp8_dtype("dtype", dtype)
    m, k = x.shape
    q, scale = quantize_tiles(x.astype(F32).reshape(m, k // BLOCK, BLOCK), 2, dtype)
    return q.reshape(m, k), scale


def quantize_blocks(w, dtype=E4M3, *, transpose: bool = False):
    """Weights per 128x128 block: w (..., K, N), K, N % 128 == 0 -> q (..., K, N) fp8 ((..., N, K) with `transpose`,
    the forward kernel's K-contiguous layout; the values are the same), scale (..., K/128, N/128) float32."""
    dtype = fp8_dtype("dtype", dtype)
    *lead, k, n = w.shape
    t = w.astype(F32).reshape(*lead, k // BLOCK, BLOCK, n // BLOCK, BLOCK)
    fmax = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(t), axis=(-3, -1))  # (..., K/128, N/128)
    scale = scale_of(amax, fmax)
    q = jnp.clip(t * (1.0 / scale)[..., :, None, :, None], -fmax, fmax).astype(dtype).reshape(*lead, k, n)
    return (jnp.swapaxes(q, -1, -2) if transpose else q), scale


def dequantize_rows(q, scale):
    return q.astype(F32) * jnp.repeat(scale, BLOCK, axis=-1)


def dequantize_blocks(q, scale):
    """q (..., K, N), scale (..., K/128, N/128) -> (..., K, N) float32."""
    return q.astype(F32) * jnp.repeat(jnp.repeat(scale, BLOCK, axis=-2), BLOCK, axis=-1)


class Fp8Weights(NamedTuple):
    """Expert weights (..., G, K, N) with their 128x128-block FP8 E4M3 copies, made by `fp8_weights`.

    A pytree: it goes through jit, scan (leading axes are sliced like the weight's), shard_map (a spec for the weight
    is a prefix for all four leaves: the expert axis is in the same place in each) and grad (the cotangent is the
    weight's, in `master`; the FP8 leaves get none)."""

    master: jax.Array  # (..., G, K, N) the weight: where its gradient goes
    q_nk: jax.Array  # (..., G, N, K) e4m3: the forward GEMM's layout (K-contiguous)
    q_kn: jax.Array  # (..., G, K, N) e4m3: the data gradient's layout (N-contiguous); the same values
    scale: jax.Array  # (..., G, K/128, N/128) float32, one per block (a block's scale serves both layouts)

    @property
    def shape(self) -> tuple:
        return self.master.shape

    @property
    def dtype(self):
        return self.master.dtype

    @property
    def ndim(self) -> int:
        return self.master.ndim

    def astype(self, dtype) -> "Fp8Weights":
        """The master weight in `dtype` (its gradient cast back through it); the FP8 blocks are unchanged."""
        return self if jnp.dtype(dtype) == self.master.dtype else self._replace(master=self.master.astype(dtype))


def fp8_weights(w: jax.Array) -> Fp8Weights:
    """w (..., G, K, N) bfloat16/float16/float32 with K and N multiples of 128 -> `Fp8Weights`: the block
    quantisation `grouped_gemm_fp8` runs on a weight at every call, run once. Pass the result where the weight went;
    the values and gradients are bit-identical to passing w (the same blocks, the same scales).

    Memory: 2 bytes a weight element beside w (two FP8 layouts) for as long as the result is alive. Differentiable:
    the gradient of a loss through the result reaches w (straight through the rounding, as with a bf16 weight)."""
    if not isinstance(w, jax.Array) or not jnp.issubdtype(w.dtype, jnp.floating) or w.dtype in FP8_DTYPES:
        raise TypeError(f"w must be a bfloat16, float16 or float32 jax.Array (..., G, K, N), got "
                        f"{getattr(w, 'dtype', type(w).__name__)}")
    if w.ndim < 3 or w.shape[-1] % BLOCK or w.shape[-2] % BLOCK or 0 in w.shape[-2:]:
        raise ValueError(f"w must be (..., G, K, N) with K and N positive multiples of {BLOCK} (the 128x128 scale "
                         f"blocks), got {w.shape}")
    q, scale = quantize_blocks(jax.lax.stop_gradient(w))
    return Fp8Weights(w, jnp.swapaxes(q, -1, -2), q, scale)
