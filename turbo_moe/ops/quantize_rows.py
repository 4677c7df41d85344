"""Activations quantised to FP8 per 1x128 tile (DeepSeek-V3's activation scaling), in one kernel pass.

`quantize_rows(x, dtype)` takes x (..., M, K) and returns q (..., M, K) FP8 and scale (..., M, K/128) float32: every
128-wide tile of a row is scaled on its own, scale = amax / fmax (1 for an all-zero tile; fmax 448 for E4M3, 57344 for
E5M2), q = fp8(clip(x * (1/scale), -fmax, fmax)) rounded to nearest even. One pass over x (kernels/cpu/quantize_rows.cc,
kernels/cuda/quantize_rows.cu, a warp per row on the GPU) in place of XLA's reduction and elementwise passes; the
values are bit for bit those of the jnp reference `fp8_scaling.quantize_rows` and of `permute_fp8`, which runs
the same row step on its routed copies (kernels/cpu/row_quantize.h, kernels/cuda/row_quantize.cuh).

NaN and infinity, as in permute_fp8 (the same row step): the kernels take a tile's amax over its non-NaN values and
clip a NaN to -fmax, so a tile holding a NaN keeps the scale of its other values and the NaN's code is -fmax; an
infinite value makes its tile's scale infinite, the tile's finite values +-0 and its own code -fmax (infinity times
1/infinity is NaN). The jnp reference propagates NaN instead: a tile with a NaN gets scale 1 (its values quantised
unscaled, the NaN's code NaN), and an infinite value's code is NaN. Finite inputs agree bit for bit.

Forward only (FP8 values have no useful gradient). Leading dims, and jax.vmap over them, are independent problems.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call
from turbo_moe.ops.fp8_scaling import BLOCK as TILE  # the scale tile along K
from turbo_moe.ops.fp8_scaling import E4M3, fp8_dtype
from turbo_moe.ops.grouped_gemm import _check_array as check_array


def quantize_rows(x, dtype=E4M3):
    """x per 1x128 tile in FP8: DeepSeek-V3's activation scaling as one kernel.

    Args:
      x: (..., M, K) bfloat16/float16/float32; K a positive multiple of 128, M >= 0.
      dtype: float8_e4m3fn (default) or float8_e5m2.
    Returns:
      q (..., M, K) dtype and scale (..., M, K/128) float32: x[..., r, c] ~= q[..., r, c] * scale[..., r, c // 128],
      bit for bit `fp8_scaling.quantize_rows` for finite x.
    """
    check_array("x", x)
    if x.ndim < 2:
        raise ValueError(f"x must have rank >= 2 (..., M, K), got shape {x.shape}")
    _checks.float_dtype("x", x.dtype)
    k = x.shape[-1]
    if k == 0 or k % TILE:
        raise ValueError(f"x (..., M, K) must have K a positive multiple of {TILE} (the FP8 scale tiles), got K={k}")
    return quantize_rows_call(x, fp8_dtype("dtype", dtype))


def quantize_rows_call(x, dtype):
    """The checked call: (..., M, K), an FP8 dtype -> q (..., M, K), scale (..., M, K/128)."""
    out = (jax.ShapeDtypeStruct(x.shape, dtype),
           jax.ShapeDtypeStruct(x.shape[:-1] + (x.shape[-1] // TILE,), jnp.float32))
    return ffi_call("turbo_moe_quantize_rows", out, x)
