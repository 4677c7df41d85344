"""Grouped GEMM with SwiGLU: the expert FFN's first half, `h = grouped_gemm(lhs, rhs)` and `act = SwiGLU(h)`,
in one FFI call that returns both.

`act[r, j] = silu(h[r, j]) * h[r, F + j]` for h (M, 2F) = [gate | up], computed in float32 from h as stored
(rounded to the output dtype) and rounded once. Why one call: a caller that keeps h for its backward pass and
feeds act to the next GEMM (`model.expert_block`) then leaves h with a single reader, the write into a layer
scan's stacked residuals, which XLA does in place; with SwiGLU as a separate XLA fusion reading h too, XLA
copied h into the stack instead.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call, match_varying
from turbo_moe.ops.grouped_gemm import _gemm_call, _weight_grad_call, _workspace, check_operands


def grouped_gemm_swiglu(lhs, rhs, group_sizes, *, transpose_rhs: bool = False, zero_tail: bool = True):
    """(M, K) x (G, K, 2F) -> (h (M, 2F), act (M, F)) with per-group weights; rhs `(G, 2F, K)` when `transpose_rhs`.

    Args:
      lhs: (M, K) rows sorted by group. bfloat16, float16 or float32 (the outputs take the promoted dtype).
      rhs: (G, K, 2F) = [gate | up] columns, or (G, 2F, K) with `transpose_rhs=True`.
      group_sizes: int32 (G,), rows per group, on the device.
      zero_tail: False lets the rows past sum(group_sizes) of h and act stay unwritten (see `grouped_gemm`).
    Returns:
      h = lhs @ rhs[group of row] and act = silu(h[:, :F]) * h[:, F:]; rows past sum(group_sizes) are zero in
      both (unspecified with zero_tail=False). Differentiable in lhs and rhs through both outputs.
    """
    compute = check_operands(lhs, rhs, group_sizes, transpose_rhs, "2F")
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if n % 2:
        raise ValueError(f"rhs must have an even output width 2F = [gate | up], got {n} (rhs {rhs.shape}, "
                         f"transpose_rhs={transpose_rhs})")
    return _gemm_swiglu(lhs.astype(compute), rhs.astype(compute), _checks.as_int32(group_sizes), bool(transpose_rhs),
                        _checks.static_bool("zero_tail", zero_tail))


def _call(lhs, rhs, group_sizes, transpose_rhs, zero_tail):
    n = rhs.shape[-2] if transpose_rhs else rhs.shape[-1]
    h = jax.ShapeDtypeStruct(lhs.shape[:-1] + (n,), lhs.dtype)
    act = jax.ShapeDtypeStruct(lhs.shape[:-1] + (n // 2,), lhs.dtype)
    ws = _workspace(group_sizes, lhs.dtype, False)
    return tuple(ffi_call("turbo_moe_grouped_gemm_swiglu", (h, act, ws), lhs, rhs, group_sizes,
                          transpose_rhs=transpose_rhs, zero_tail=zero_tail)[:2])


def swiglu_grad(h, d_act):
    """d(silu(gate) * up)/dh for h (..., 2F) = [gate | up] and d_act (..., F), in float32 -> (..., 2F) float32."""
    f = h.shape[-1] // 2
    gate, up = h[..., :f].astype(jnp.float32), h[..., f:].astype(jnp.float32)
    d = d_act.astype(jnp.float32)
    sig = jax.nn.sigmoid(gate)
    d_up = d * gate * sig  # d silu(g) u / du = silu(g)
    d_gate = d * up * sig * (1 + gate * (1 - sig))  # silu'(g) = sig (1 + g (1 - sig))
    return jnp.concatenate([d_gate, d_up], axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gemm_swiglu(lhs, rhs, group_sizes, transpose_rhs, zero_tail):
    return _call(lhs, rhs, group_sizes, transpose_rhs, zero_tail)


def _gemm_swiglu_fwd(lhs, rhs, group_sizes, transpose_rhs, zero_tail):
    h, act = _call(lhs, rhs, group_sizes, transpose_rhs, zero_tail)
    return (h, act), (lhs, rhs, group_sizes, h)


def _gemm_swiglu_bwd(transpose_rhs, zero_tail, residuals, cotangents):
    lhs, rhs, group_sizes, h = residuals
    d_h, d_act = cotangents
    d_h = (d_h.astype(jnp.float32) + swiglu_grad(h, d_act)).astype(lhs.dtype)  # both outputs' paths into h
    d_lhs = _gemm_call(d_h, rhs, group_sizes, not transpose_rhs, lhs.dtype, zero_tail)  # (M, K)
    if transpose_rhs:
        d_rhs = _weight_grad_call(d_h, lhs, group_sizes, rhs.dtype)  # (G, 2F, K)
    else:
        d_rhs = _weight_grad_call(lhs, d_h, group_sizes, rhs.dtype)  # (G, K, 2F)
    return match_varying(d_lhs, lhs), match_varying(d_rhs, rhs), None


_gemm_swiglu.defvjp(_gemm_swiglu_fwd, _gemm_swiglu_bwd)
