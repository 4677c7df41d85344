"""The FP8 weight gradient's operands: rows quantised per 128x1 tile within each group, written transposed.

`quantize_group_columns(x, group_sizes, dtype)` takes x (M, C) rows sorted by group and returns q_t (C, P) FP8 and
scale (P/128, C) float32, P = `padded_rows(M, G)`: group g's rows start at column sum_{h<g} ceil(size_h / 128) * 128
of q_t, so that no 128-column tile spans two groups, and every tile of every column is scaled on its own (DeepSeek-V3's
128x1 tiles, the rows being the weight gradient's contraction). One pass over x (kernels/cpu/quantize_group_columns.cc,
kernels/cuda/quantize_group_columns.cu) in place of XLA's gather into a float32 padded copy, reduction and transpose
(`grouped_gemm_fp8.quantize_group_columns_xla`, the reference the kernels match bit for bit).

Forward only: the weight gradient's rule calls it inside `grouped_gemm_fp8`'s VJP.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call
from turbo_moe.ops.grouped_gemm import _check_array as check_array

TILE = 128  # rows per scale tile, and each group's padding unit
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)


def padded_rows(m: int, groups: int) -> int:
    """P of the weight gradient's group-padded layout: room for every group rounded up to 128 rows."""
    return -(-(m + (TILE - 1) * groups) // TILE) * TILE


def quantize_group_columns(x, group_sizes, dtype=E4M3):
    """x's rows per 128x1 tile within each group, transposed into the group-padded layout.

    Args:
      x: (M, C) bfloat16/float16/float32 rows sorted by group; M >= 0, C >= 1.
      group_sizes: integer (G,) rows per group (negative counts as 0, clamped to M as in grouped_gemm); rows past
        sum(group_sizes) are not read.
      dtype: float8_e4m3fn (default) or float8_e5m2.
    Returns:
      q_t (C, P) dtype and scale (P/128, C) float32, P = padded_rows(M, G): x[r, c] ~= q_t[c, p] * scale[p // 128, c]
      for row r's column p; padding and tiles past the groups are zero with scale 1.
    """
    check_array("x", x)
    check_array("group_sizes", group_sizes)
    _checks.check_rank("x", x, 2, "(M, C)")
    _checks.float_dtype("x", x.dtype)
    _checks.check_rank("group_sizes", group_sizes, 1, "(G,)")
    _checks.check_integer("group_sizes", group_sizes)
    if x.shape[1] == 0:
        raise ValueError(f"x (M, C) must have C >= 1 columns, got shape {x.shape}")
    dtype = jnp.dtype(dtype)
    if dtype not in (E4M3, E5M2):
        raise TypeError(f"dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")
    return quantize_group_columns_call(x, _checks.as_int32(group_sizes), dtype)


def quantize_group_columns_call(x, group_sizes, dtype):
    """The checked call: (M, C), int32 (G,), an FP8 dtype -> q_t (C, P), scale (P/128, C)."""
    m, c = x.shape
    p = padded_rows(m, group_sizes.shape[0])
    out = (jax.ShapeDtypeStruct((c, p), dtype), jax.ShapeDtypeStruct((p // TILE, c), jnp.float32))
    return ffi_call("turbo_moe_quantize_group_columns", out, x, group_sizes)
