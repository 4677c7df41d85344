"""The expert block's SwiGLU backward with its combine weights, in one pass (`ops.expert_block`).

For h (..., 2F) = [gate | up], g (..., F) (the down GEMM's data gradient of the *unweighted* output cotangent) and
w (...) float32 (each row's combine weight):
  d_w[r] = sum_j act[r, j] * g[r, j]          act = silu(gate) * up in float32: the combine weight's gradient
  d_h[r] = SwiGLU's backward at h[r] for d_act = (w[r] * g[r]) rounded to h's dtype: the gate/up output's gradient
  act_w[r] = (act[r] rounded to h's dtype, as `grouped_gemm_swiglu` returns it) * w[r], rounded: the down weight
             gradient's lhs, (w act)^T @ g
One FFI call reads h and g once; as XLA fusions (a row reduction and two elementwise passes) h was read three times.
`swiglu_combine_grad_fp8` also writes d_h quantised to FP8 per 1x128 tile (the FP8 data gradient's lhs) in the same
pass, in place of a `quantize_rows(d_h)` pass that reads d_h again.
A backward-pass building block: it has no VJP of its own.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call
from turbo_moe.ops.fp8_scaling import BLOCK as TILE  # d_h_q's scale tile along 2F
from turbo_moe.ops.fp8_scaling import E4M3, fp8_dtype


def _checked_valid_rows(h, g, w, valid_rows):
    """The operands' checks; valid_rows as int32 of h.shape[:-2] (h has rank >= 2)."""
    _checks.float_dtype("h", h.dtype)
    if g.dtype != h.dtype:
        raise TypeError(f"g must have h's dtype {h.dtype}, got {g.dtype}")
    if h.ndim < 1 or h.shape[-1] % 2:
        raise ValueError(f"h must be (..., 2F) = [gate | up] with an even last dim, got {h.shape}")
    if g.shape != h.shape[:-1] + (h.shape[-1] // 2,):
        raise ValueError(f"g must be (..., F) = {h.shape[:-1] + (h.shape[-1] // 2,)} for h {h.shape}, got {g.shape}")
    if w.shape != h.shape[:-1]:
        raise ValueError(f"w must be (...) = {h.shape[:-1]} (one combine weight a row of h), got {w.shape}")
    if h.ndim == 1:
        return None  # one row: the caller adds a row axis (the kernels take (..., M, 2F))
    return _checks.rows_per_problem(valid_rows, h)


def _outputs(h):
    """(d_h, d_w, act_w) as the kernels return them."""
    return (jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct(h.shape[:-1], jnp.float32),
            jax.ShapeDtypeStruct(h.shape[:-1] + (h.shape[-1] // 2,), h.dtype))


def swiglu_combine_grad(h, g, w, valid_rows=None):
    """h (..., 2F), g (..., F) of one float dtype, w (...) -> (d_h (..., 2F) like h, d_w (...) float32,
    act_w (..., F) like g).

    valid_rows: None (every row), or int32 of h's shape[:-2]: the rows of each (M, 2F) problem to compute; rows from
    it on are left unspecified (unwritten on CUDA, NaN on the CPU), for the expert block, whose worst-case EP
    buffers are mostly rows past the groups that nothing reads."""
    valid = _checked_valid_rows(h, g, w, valid_rows)
    if h.ndim == 1:
        return tuple(out[0] for out in swiglu_combine_grad(h[None], g[None], w[None], valid_rows))
    return tuple(ffi_call("turbo_moe_swiglu_combine_grad", _outputs(h), h, g, w.astype(jnp.float32), valid))


def swiglu_combine_grad_fp8(h, g, w, valid_rows=None, dtype=E4M3):
    """`swiglu_combine_grad` also writing d_h in FP8 per 1x128 tile, in the same pass.

    Args:
      h, g, w, valid_rows: as `swiglu_combine_grad`; 2F (h's last dim) a positive multiple of 128.
      dtype: d_h_q's FP8 format, float8_e4m3fn (default) or float8_e5m2.
    Returns:
      (d_h, d_h_q, d_h_scale, d_w, act_w): d_h, d_w and act_w bit for bit `swiglu_combine_grad`'s;
      d_h_q (..., 2F) `dtype` and d_h_scale (..., 2F/128) float32 bit for bit `quantize_rows(d_h, dtype)` (the tiles
      run along [d_gate | d_up]; with F % 128 == 64 one straddles the two). Rows from valid_rows on are unspecified
      in every output.
    """
    valid = _checked_valid_rows(h, g, w, valid_rows)
    dtype = fp8_dtype("dtype", dtype)
    two_f = h.shape[-1]
    if two_f == 0 or two_f % TILE:
        raise ValueError(f"h (..., 2F) must have 2F a positive multiple of {TILE} (the FP8 scale tiles), "
                         f"got 2F={two_f}")
    if h.ndim == 1:
        return tuple(out[0] for out in swiglu_combine_grad_fp8(h[None], g[None], w[None], valid_rows, dtype))
    quantized = (jax.ShapeDtypeStruct(h.shape, dtype), jax.ShapeDtypeStruct(h.shape[:-1] + (two_f // TILE,),
                                                                             jnp.float32))
    d_h, d_w, act_w, d_h_q, d_h_scale = ffi_call("turbo_moe_swiglu_combine_grad_fp8", _outputs(h) + quantized, h, g,
                                                 w.astype(jnp.float32), valid)
    return d_h, d_h_q, d_h_scale, d_w, act_w
