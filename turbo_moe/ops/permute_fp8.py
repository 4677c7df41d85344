"""The permute writing FP8: token copies sorted by expert as E4M3 rows with DeepSeek-V3's 1x128 scales.

`permute_fp8(x, expert_ids, E)` is `permute` followed by `grouped_gemm_fp8.quantize_rows` of its rows, in one pass over
the tokens: the row copy quantises each 128-wide tile as it writes it (kernels/cpu/permute_fp8.cc,
kernels/cuda/permute_fp8.cu), so no separate pass reads the permuted activations again. The rows and scales are
bit-identical to `quantize_rows(permute(x, ...)[0])` and in the layout `grouped_gemm_fp8_quantized` (the FP8 kernel's
lhs) takes. The sort is permute's own kernel, called on a one-column stand-in for x (it copies 2 bytes a row).

`permute_rows_fp8_call(x, row_index, group_sizes)` is the backward's copy step: `permute_rows_call`'s rows and their
`quantize_rows` from one read of x (the FP8 expert block's backward needs d_y's permuted rows in both: the bf16 weight
gradient reads the rows, the FP8 data gradient the codes).

Not differentiable (FP8 rows have no useful gradient): a backward pass that needs the rows rebuilds them with
`permute_rows`, or with `permute_rows_fp8_call` where it needs their FP8 codes too.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call
from turbo_moe.ops.fp8_scaling import E4M3, fp8_dtype
from turbo_moe.ops.permute import PermuteHandle, _permute_call, checked_row_operands

TILE = 128  # the activations' scale tile along H


def _check_width(x) -> None:
    h = x.shape[-1]
    if h == 0 or h % TILE:
        raise ValueError(f"x (T, H) must have H a positive multiple of {TILE} (the FP8 scale tiles), got H={h}")


def permute_fp8(x, expert_ids, num_experts: int):
    """`permute` with its sorted rows written as FP8 E4M3 and their per-1x128 float32 scales.

    Args:
      x: (T, H) tokens, bfloat16/float16/float32; H a positive multiple of 128.
      expert_ids: integer (T, k) expert of each copy; an id outside [0, num_experts) drops that copy.
      num_experts: E, static.
    Returns:
      q float8_e4m3fn (T*k, H), scale float32 (T*k, H/128): x_sorted[r] ~= q[r] * scale[r] per 128-wide tile, the
        values of `quantize_rows(x_sorted)`; rows past sum(group_sizes) are those of a zero row (q 0, scale 1).
      group_sizes int32 (E,), handle: `PermuteHandle`, as `permute` returns them.
    """
    _checks.check_rank("x", x, 2, "(T, H)")
    _checks.check_rank("expert_ids", expert_ids, 2, "(T, k)")
    _checks.check_integer("expert_ids", expert_ids)
    _checks.float_dtype("x", x.dtype)
    _check_width(x)
    if expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids (T, k) must have T={x.shape[0]} rows like x (T, H), got {expert_ids.shape}")
    num_experts = _checks.static_int("num_experts", num_experts)
    q, scale, group_sizes, row_index = permute_fp8_call(x, _checks.index_as_int32(expert_ids, num_experts),
                                                        num_experts)
    return q, scale, group_sizes, PermuteHandle(row_index)


def permute_fp8_call(x, expert_ids, num_experts: int, zero_tail: bool = True):
    """(T, H), int32 (T, k) ids in range or dropped -> q (T*k, H), scale (T*k, H/128), group_sizes (E,), row_index
    (T, k). zero_tail=False: rows past sum(group_sizes) may stay unwritten (NaN on the CPU), see `grouped_gemm`."""
    # permute's sort with a one-column row copy instead of x's: a zero-width array here (the first form) crashed
    # XLA:GPU's compiler under shard_map (expert parallelism); one column costs 2 bytes a routed row.
    sort_only = jnp.zeros(x.shape[:-1] + (1,), x.dtype)
    _, group_sizes, row_index = _permute_call(sort_only, expert_ids, num_experts)
    q, scale = _quantized_rows_call(x, row_index, group_sizes, zero_tail)
    return q, scale, group_sizes, row_index


def permute_rows_fp8(x, handle: PermuteHandle, group_sizes):
    """`permute_rows` writing FP8: the quantised copy step alone, from a permute's row index and group sizes.
    (T, H), PermuteHandle, int32 (E,) -> q (T*k, H) float8_e4m3fn, scale (T*k, H/128) float32."""
    row_index, group_sizes = checked_row_operands(x, handle, group_sizes)
    _check_width(x)
    return _quantized_rows_call(x, row_index, group_sizes)


def permute_rows_fp8_call(x, row_index, group_sizes, zero_tail: bool = True, dtype=E4M3):
    """`permute_rows_call` writing its rows and their FP8 quantisation in one pass over x.

    Args:
      x: (T, H) bfloat16/float16/float32, H a positive multiple of 128 (leading dims, and vmap's, are independent
        problems shared by all three operands).
      row_index: int32 (T, k): x[t] goes to row row_index[t, j]; entries outside [0, T*k) copy nothing (dropped).
      group_sizes: int32 (E,): rows [0, sum(group_sizes)) are the groups' (negative sizes count as 0).
      zero_tail: static; False leaves the rows past the groups unwritten (NaN on the CPU), see `grouped_gemm`.
      dtype: float8_e4m3fn (default) or float8_e5m2.
    Returns:
      rows (T*k, H) x.dtype, bit for bit `permute_rows_call(x, row_index, group_sizes, zero_tail)`;
      q (T*k, H) dtype and scale (T*k, H/128) float32, bit for bit `fp8_scaling.quantize_rows(rows, dtype)` on the
        group rows; past them a zero row's (q 0, scale 1) or, with zero_tail=False, unwritten.
    """
    _checks.float_dtype("x", x.dtype)
    if x.ndim < 2:
        raise ValueError(f"x must be (T, H), got shape {x.shape}")
    _check_width(x)
    lead, (t, h) = x.shape[:-2], x.shape[-2:]
    if row_index.ndim != x.ndim or row_index.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"row_index must be (T, k) with T={t} like x {x.shape}, got shape {row_index.shape}")
    if group_sizes.ndim != x.ndim - 1 or group_sizes.shape[:-1] != lead:
        raise ValueError(f"group_sizes must be (E,) with x's leading dims {lead}, got shape {group_sizes.shape}")
    for name, a in (("row_index", row_index), ("group_sizes", group_sizes)):
        if a.dtype != jnp.int32:
            raise TypeError(f"{name} must be int32, got {a.dtype}")
    zero_tail = _checks.static_bool("zero_tail", zero_tail)
    dtype = fp8_dtype("dtype", dtype)
    n = row_index.shape[-2] * row_index.shape[-1]
    out = (jax.ShapeDtypeStruct(lead + (n, h), x.dtype),
           jax.ShapeDtypeStruct(lead + (n, h), dtype),
           jax.ShapeDtypeStruct(lead + (n, h // TILE), jnp.float32))
    return ffi_call("turbo_moe_permute_rows_fp8", out, x, row_index, group_sizes, zero_tail=zero_tail)


def _quantized_rows_call(x, row_index, group_sizes, zero_tail: bool = True):
    """The forward's copy step: q (T*k, H) E4M3 and scale (T*k, H/128) alone (no rows)."""
    rows = row_index.shape[-2] * row_index.shape[-1]
    lead = x.shape[:-2]
    out = (jax.ShapeDtypeStruct(lead + (rows, x.shape[-1]), E4M3),
           jax.ShapeDtypeStruct(lead + (rows, x.shape[-1] // TILE), jnp.float32))
    return ffi_call("turbo_moe_permute_fp8", out, x, row_index, group_sizes, zero_tail=zero_tail)
