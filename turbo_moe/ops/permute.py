"""Single-device MoE dispatch: sort token copies by expert, on the device, with static shapes."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax.ad_checkpoint import checkpoint_name

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call, match_varying, workspace
from turbo_moe.ops.unpermute import PermuteHandle, unpermute_call  # unpermute imports nothing of permute's


# The `jax.ad_checkpoint.checkpoint_name` of the row index that the backward pass needs (a residual).
ROW_INDEX_NAME = "turbo_moe_permute_row_index"


def permute(x, expert_ids, num_experts: int):
    """Copies each token once per selected expert and groups the copies by expert.

    Args:
      x: (T, H) tokens, bfloat16/float16/float32.
      expert_ids: int32 (T, k) expert of each copy. An id outside [0, num_experts) drops that copy
        (useful for capacity limits or masking): it gets no row and contributes zero on unpermute.
        Wider integer dtypes are accepted; their out-of-range ids are dropped too, never wrapped.
      num_experts: E, static.
    Returns:
      x_sorted (T*k, H): copies stably sorted by expert (token order within an expert); rows past
        sum(group_sizes) (the dropped copies) are zero.
      group_sizes int32 (E,): copies per expert, for `grouped_gemm`.
      handle: PermuteHandle for `unpermute`.
    The gradient wrt x is `unpermute` of the incoming gradient with unit weights (its transpose).
    """
    _checks.check_rank("x", x, 2, "(T, H)")
    _checks.check_rank("expert_ids", expert_ids, 2, "(T, k)")
    _checks.check_integer("expert_ids", expert_ids)
    _checks.float_dtype("x", x.dtype)
    if expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"expert_ids (T, k) must have T={x.shape[0]} rows like x (T, H), got {expert_ids.shape}")
    num_experts = _checks.static_int("num_experts", num_experts)
    x_sorted, group_sizes, row_index = _permute(x, _checks.index_as_int32(expert_ids, num_experts), num_experts)
    return x_sorted, group_sizes, PermuteHandle(checkpoint_name(row_index, ROW_INDEX_NAME))


def permute_rows(x, handle: PermuteHandle, group_sizes):
    """`permute`'s x_sorted for new rows x, from the row index and group sizes a permute returned: no sort.

    x_sorted[handle.row_index[t, j]] = x[t]; rows from sum(group_sizes) on are zero (rows below it that no entry
    fills are unspecified: a permute's row index fills them all). (T, H), PermuteHandle,
    int32 (E,) -> (T*k, H). For a backward pass that needs the permuted rows (or a gradient's) again without
    keeping them (turbo_moe.ops.expert_block). Not differentiable (its transpose is `unpermute` with unit
    weights). Row index entries outside [0, T*k) copy nothing.
    """
    return permute_rows_call(x, *checked_row_operands(x, handle, group_sizes))


def checked_row_operands(x, handle, group_sizes):
    """The checks of `permute_rows` (and `permute_rows_fp8`): x (T, H) float, a PermuteHandle of T rows, int (E,)
    group sizes. Returns the row index and the group sizes as int32."""
    if not isinstance(handle, PermuteHandle):
        raise TypeError(f"handle must be the PermuteHandle returned by permute, got {type(handle).__name__}")
    _checks.check_rank("x", x, 2, "(T, H)")
    _checks.float_dtype("x", x.dtype)
    row_index = handle.row_index
    _checks.check_rank("handle.row_index", row_index, 2, "(T, k)")
    _checks.check_integer("handle.row_index", row_index)
    _checks.check_rank("group_sizes", group_sizes, 1, "(E,)")
    _checks.check_integer("group_sizes", group_sizes)
    if row_index.shape[0] != x.shape[0]:
        raise ValueError(f"handle.row_index (T, k) must have T={x.shape[0]} rows like x (T, H), got {row_index.shape}")
    return _checks.index_as_int32(row_index, row_index.size), group_sizes.astype(jnp.int32)


def permute_rows_call(x, row_index, group_sizes, zero_tail=True):
    """zero_tail=False: rows from sum(group_sizes) on may stay unwritten (NaN on the CPU), see `grouped_gemm`."""
    out = jax.ShapeDtypeStruct(x.shape[:-2] + (row_index.shape[-2] * row_index.shape[-1], x.shape[-1]), x.dtype)
    return ffi_call("turbo_moe_permute_rows", out, x, row_index, group_sizes, zero_tail=zero_tail)


def _permute_call(x, expert_ids, num_experts, zero_tail=True):
    T, k = expert_ids.shape[-2:]
    batch = x.shape[:-2]
    out = (
        jax.ShapeDtypeStruct(batch + (T * k, x.shape[-1]), x.dtype),
        jax.ShapeDtypeStruct(batch + (num_experts,), jnp.int32),
        jax.ShapeDtypeStruct(batch + (T, k), jnp.int32),
        workspace("turbo_moe_permute_workspace_bytes", 1, T * k, num_experts, batch=batch),
    )
    return ffi_call("turbo_moe_permute", out, x, expert_ids, num_experts=num_experts, zero_tail=zero_tail)[:3]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _permute(x, expert_ids, num_experts):
    return _permute_call(x, expert_ids, num_experts)


def _permute_fwd(x, expert_ids, num_experts):
    x_sorted, group_sizes, row_index = _permute_call(x, expert_ids, num_experts)
    # Named so that a remat policy can keep it (the model's "dots_experts_attention" does): else the backward
    # pass runs the whole permute again only to get this index back.
    residual = checkpoint_name(row_index, ROW_INDEX_NAME)
    return (x_sorted, group_sizes, row_index), (residual, x[:0])  # x[:0]: x's type, no data


def _permute_bwd(num_experts, residuals, cotangents):
    row_index, x_type = residuals
    d_sorted = cotangents[0]  # (T*k, H); group_sizes and row_index are integers: no gradient
    ones = jnp.ones(row_index.shape, jnp.float32)
    return match_varying(unpermute_call(d_sorted, row_index, ones), x_type), None


_permute.defvjp(_permute_fwd, _permute_bwd)
