"""The expert block's SwiGLU backward with its combine weights, in one pass (`ops.expert_block`).

For h (..., 2F) = [gate | up], g (..., F) (the down GEMM's data gradient of the *unweighted* output cotangent) and
w (...) float32 (each row's combine weight):
  d_w[r] = sum_j act[r, j] * g[r, j]          act = silu(gate) * up in float32: the combine weight's gradient
  d_h[r] = SwiGLU's backward at h[r] for d_act = (w[r] * g[r]) rounded to h's dtype: the gate/up output's gradient
  act_w[r] = (act[r] rounded to h's dtype, as `grouped_gemm_swiglu` returns it) * w[r], rounded: the down weight
             gradient's lhs, (w act)^T @ g
One FFI call reads h and g once; as XLA fusions (a row reduction and two elementwise passes) h was read three times.
A backward-pass building block: it has no VJP of its own.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call


def swiglu_combine_grad(h, g, w, valid_rows=None):
    """h (..., 2F), g (..., F) of one float dtype, w (...) -> (d_h (..., 2F) like h, d_w (...) float32,
    act_w (..., F) like g).

    valid_rows: None (every row), or int32 of h's shape[:-2]: the rows of each (M, 2F) problem to compute; rows from
    it on are left unspecified (unwritten on CUDA, NaN on the CPU), for the expert block, whose worst-case EP
    buffers are mostly rows past the groups that nothing reads."""
    _checks.float_dtype("h", h.dtype)
    if g.dtype != h.dtype:
        raise TypeError(f"g must have h's dtype {h.dtype}, got {g.dtype}")
    if h.ndim < 1 or h.shape[-1] % 2:
        raise ValueError(f"h must be (..., 2F) = [gate | up] with an even last dim, got {h.shape}")
    if g.shape != h.shape[:-1] + (h.shape[-1] // 2,):
        raise ValueError(f"g must be (..., F) = {h.shape[:-1] + (h.shape[-1] // 2,)} for h {h.shape}, got {g.shape}")
    if w.shape != h.shape[:-1]:
        raise ValueError(f"w must be (...) = {h.shape[:-1]} (one combine weight a row of h), got {w.shape}")
    if h.ndim == 1:  # one row: the kernels take (..., M, 2F)
        return tuple(out[0] for out in swiglu_combine_grad(h[None], g[None], w[None], valid_rows))
    if valid_rows is None:
        valid_rows = jnp.full(h.shape[:-2], h.shape[-2], jnp.int32)
    _checks.check_integer("valid_rows", valid_rows)
    if jnp.shape(valid_rows) != h.shape[:-2]:
        raise ValueError(f"valid_rows must be {h.shape[:-2]} (one count a problem of h {h.shape}), "
                         f"got {jnp.shape(valid_rows)}")
    return tuple(ffi_call("turbo_moe_swiglu_combine_grad",
                          (jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(w.shape, jnp.float32),
                           jax.ShapeDtypeStruct(g.shape, h.dtype)),
                          h, g, w.astype(jnp.float32), jnp.asarray(valid_rows).astype(jnp.int32)))
