"""The FP8 expert block's SwiGLU written straight in FP8: act = SwiGLU(h) quantised per 1x128 tile, in one pass over h.

`swiglu_quantize(h, valid_rows, dtype)` takes h (..., M, 2F) = [gate | up] and returns q (..., M, F) FP8 and scale
(..., M, F/128) float32, where act = gate / (1 + exp(-gate)) * up is computed in float32 and rounded to h's dtype (as
`grouped_gemm_swiglu` and `swiglu_combine_grad` compute it), and (q, scale) is bit for bit `quantize_rows(act)` of that
rounded act (and the jnp `fp8_scaling.quantize_rows`): both kernels run the same row step (kernels/cpu/row_quantize.h,
kernels/cuda/row_quantize.cuh). In place of XLA's SwiGLU writing act and `quantize_rows` reading it again.

exp is the kernel library's own (the C++ std::exp on the CPU, CUDA's expf): it may differ from XLA's exp, and the
CPU's from the GPU's, by an ulp, so a rare act value can differ from a jnp SwiGLU's, and then its FP8 code by one step
or its tile's scale by a few ulps of h's dtype. NaN and infinity in act are treated as `quantize_rows` treats them.

A forward building block: it has no VJP (FP8 values have no useful gradient; the expert block's backward reads h).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call
from turbo_moe.ops.fp8_scaling import BLOCK as TILE  # the scale tile along F
from turbo_moe.ops.fp8_scaling import E4M3, fp8_dtype
from turbo_moe.ops.grouped_gemm import _check_array as check_array


def swiglu_quantize(h, valid_rows=None, dtype=E4M3):
    """SwiGLU of h in FP8 per 1x128 tile: the down GEMM's lhs (the FP8 expert block's act) from one kernel.

    Args:
      h: (..., M, 2F) = [gate | up] bfloat16/float16/float32; F a positive multiple of 128, M >= 0.
      valid_rows: None (every row), or integer of shape h.shape[:-2]: the rows of each (M, 2F) problem to compute.
        Rows from it on are left unspecified: unwritten on CUDA, NaN (codes and scales, every byte 0xFF) on the CPU,
        as `swiglu_combine_grad` and `permute_fp8(zero_tail=False)` leave such rows (the expert block's worst-case
        buffers have a tail past the groups that nothing reads).
      dtype: float8_e4m3fn (default) or float8_e5m2.
    Returns:
      q (..., M, F) dtype and scale (..., M, F/128) float32: `quantize_rows(act)` for act = silu(gate) * up computed
      in float32 and rounded to h's dtype; act[..., r, c] ~= q[..., r, c] * scale[..., r, c // 128].
    """
    check_array("h", h)
    if h.ndim < 2:
        raise ValueError(f"h must have rank >= 2 (..., M, 2F) = [gate | up], got shape {h.shape}")
    _checks.float_dtype("h", h.dtype)
    two_f = h.shape[-1]
    if two_f % 2 or two_f == 0 or (two_f // 2) % TILE:
        raise ValueError(f"h (..., M, 2F) = [gate | up] must have F a positive multiple of {TILE} (the FP8 scale "
                         f"tiles), got a last dim of {two_f}")
    fp8 = fp8_dtype("dtype", dtype)
    return swiglu_quantize_call(h, _checks.rows_per_problem(valid_rows, h), fp8)


def swiglu_quantize_call(h, valid_rows, dtype):
    """The checked call: h (..., M, 2F), valid_rows (...) int32, an FP8 dtype -> q (..., M, F), scale (..., M, F/128).
    """
    f = h.shape[-1] // 2
    out = (jax.ShapeDtypeStruct(h.shape[:-1] + (f,), dtype),
           jax.ShapeDtypeStruct(h.shape[:-1] + (f // TILE,), jnp.float32))
    return ffi_call("turbo_moe_swiglu_quantize", out, h, valid_rows)
