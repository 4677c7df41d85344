"""Grouped GEMM: a drop-in for `jax.lax.ragged_dot` backed by the turbo_moe FFI kernels.

Row block g of `lhs` (its size is `group_sizes[g]`) is multiplied by `rhs[g]`. Group sizes stay on
the device (no host sync, static shapes). Runtime semantics: negative sizes count as 0, the
cumulative layout is clamped to M, and rows past `sum(group_sizes)` are zero.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call, match_varying, workspace


def grouped_gemm(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, preferred_element_type=None,
                 precision=None, zero_tail: bool = True):
    """(M, K) x (G, K, N) -> (M, N) with per-group weights; `(G, N, K)` when `transpose_rhs`.

    Args:
      lhs: (M, K) rows sorted by group. bfloat16, float16 or float32.
      rhs: (G, K, N), or (G, N, K) with `transpose_rhs=True` (saves a transpose for tied/down weights).
      group_sizes: int32 (G,), rows per group, on the device.
      preferred_element_type: output dtype (default: the promoted input dtype). Accumulation is
        always float32.
      precision: accepted for signature compatibility with `jax.lax.ragged_dot`; ignored.
      zero_tail: False lets the rows past sum(group_sizes) stay unwritten, for a caller that reads only group
        rows (the expert block on worst-case EP buffers, mostly tail); the CUDA kernels then skip them, the CPU
        handlers fill them with NaN (so a reader of them shows). The data gradient takes the same setting.
    Returns:
      (M, N); rows past sum(group_sizes) are zero (unspecified with zero_tail=False). Differentiable in lhs and rhs.
    """
    del precision
    compute = check_operands(lhs, rhs, group_sizes, transpose_rhs, "N")
    out_dtype = compute if preferred_element_type is None else _checks.float_dtype(
        "preferred_element_type", preferred_element_type)
    return _grouped_gemm(lhs.astype(compute), rhs.astype(compute), _checks.as_int32(group_sizes),
                         bool(transpose_rhs), jnp.dtype(out_dtype), _checks.static_bool("zero_tail", zero_tail))


def check_operands(lhs, rhs, group_sizes, transpose_rhs: bool, n_name: str):
    """Names the argument and the expected layout for a bad forward call; returns the promoted compute dtype.
    n_name: how the layout strings spell the output width ("N", or "2F" for grouped_gemm_swiglu)."""
    layout = f"(G, {n_name}, K)" if transpose_rhs else f"(G, K, {n_name})"
    _checks.check_rank("lhs", lhs, 2, "(M, K)")
    _checks.check_rank("rhs", rhs, 3, layout)
    _checks.check_rank("group_sizes", group_sizes, 1, "(G,)")
    _checks.check_integer("group_sizes", group_sizes)
    _checks.float_dtype("lhs", lhs.dtype)
    _checks.float_dtype("rhs", rhs.dtype)
    rhs_k = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if rhs_k != lhs.shape[1]:
        raise ValueError(f"rhs {layout} has contraction size {rhs_k} but lhs (M, K) has K={lhs.shape[1]} "
                         f"(lhs {lhs.shape}, rhs {rhs.shape}, transpose_rhs={transpose_rhs})")
    if group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"group_sizes must have shape (G,) = ({rhs.shape[0]},) to match rhs {rhs.shape}, "
                         f"got {group_sizes.shape}")
    return jnp.promote_types(lhs.dtype, rhs.dtype)


def grouped_gemm_weight_grad(lhs, d_out, group_sizes, *, preferred_element_type=None):
    """Variable-K grouped GEMM: (M, K), (M, N) -> (G, K, N), out[g] = lhs[rows_g]^T @ d_out[rows_g].

    The weight gradient of `grouped_gemm`. Empty groups give zeros; deterministic (no atomics).
    """
    _checks.check_rank("lhs", lhs, 2, "(M, K)")
    _checks.check_rank("d_out", d_out, 2, "(M, N)")
    _checks.check_rank("group_sizes", group_sizes, 1, "(G,)")
    _checks.check_integer("group_sizes", group_sizes)
    if d_out.shape[0] != lhs.shape[0]:
        raise ValueError(f"d_out (M, N) must have M={lhs.shape[0]} rows like lhs, got {d_out.shape}")
    _checks.float_dtype("lhs", lhs.dtype)
    _checks.float_dtype("d_out", d_out.dtype)
    compute = jnp.promote_types(lhs.dtype, d_out.dtype)
    out_dtype = compute if preferred_element_type is None else _checks.float_dtype(
        "preferred_element_type", preferred_element_type)
    return _weight_grad_call(lhs.astype(compute), d_out.astype(compute), _checks.as_int32(group_sizes),
                             jnp.dtype(out_dtype))


# The workspace counter's dtype codes (kernels/cuda/grouped_gemm.cu).
_DTYPE_CODE = {jnp.dtype(jnp.bfloat16): 0, jnp.dtype(jnp.float16): 1, jnp.dtype(jnp.float32): 2}


def _workspace(group_sizes, dtype, weight_grad):
    return workspace("turbo_moe_grouped_gemm_workspace_bytes", 1, group_sizes.shape[-1], _DTYPE_CODE[jnp.dtype(dtype)],
                     int(weight_grad), batch=group_sizes.shape[:-1])


def _gemm_call(lhs, rhs, group_sizes, transpose_rhs, out_dtype, zero_tail=True):
    n = rhs.shape[-2] if transpose_rhs else rhs.shape[-1]
    out = jax.ShapeDtypeStruct(lhs.shape[:-1] + (n,), out_dtype)
    ws = _workspace(group_sizes, lhs.dtype, False)
    return ffi_call("turbo_moe_grouped_gemm", (out, ws), lhs, rhs, group_sizes, transpose_rhs=transpose_rhs,
                    zero_tail=zero_tail)[0]


def _weight_grad_call(lhs, d_out, group_sizes, out_dtype):
    G, K, N = group_sizes.shape[-1], lhs.shape[-1], d_out.shape[-1]
    out = jax.ShapeDtypeStruct(lhs.shape[:-2] + (G, K, N), out_dtype)
    ws = _workspace(group_sizes, lhs.dtype, True)
    return ffi_call("turbo_moe_grouped_gemm_weight_grad", (out, ws), lhs, d_out, group_sizes)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _grouped_gemm(lhs, rhs, group_sizes, transpose_rhs, out_dtype, zero_tail):
    return _gemm_call(lhs, rhs, group_sizes, transpose_rhs, out_dtype, zero_tail)


def _grouped_gemm_fwd(lhs, rhs, group_sizes, transpose_rhs, out_dtype, zero_tail):
    return _gemm_call(lhs, rhs, group_sizes, transpose_rhs, out_dtype, zero_tail), (lhs, rhs, group_sizes)


def _grouped_gemm_bwd(transpose_rhs, out_dtype, zero_tail, residuals, d_out):
    lhs, rhs, group_sizes = residuals
    d_out = d_out.astype(lhs.dtype)  # (M, N)
    # dgrad: the same grouped GEMM against the other layout of rhs, i.e. rhs[g] transposed.
    d_lhs = _gemm_call(d_out, rhs, group_sizes, not transpose_rhs, lhs.dtype, zero_tail)  # (M, K)
    # wgrad: variable-K grouped GEMM over each group's rows.
    if transpose_rhs:
        d_rhs = _weight_grad_call(d_out, lhs, group_sizes, rhs.dtype)  # (G, N, K)
    else:
        d_rhs = _weight_grad_call(lhs, d_out, group_sizes, rhs.dtype)  # (G, K, N)
    return match_varying(d_lhs, lhs), match_varying(d_rhs, rhs), None


_grouped_gemm.defvjp(_grouped_gemm_fwd, _grouped_gemm_bwd)
