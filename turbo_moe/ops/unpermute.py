"""Single-device MoE combine: bring expert outputs back to token order and sum each token's copies."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call, match_varying, workspace


class PermuteHandle(NamedTuple):
    """What `unpermute` needs to bring rows back. A pytree, so it passes through jit/scan/vmap.

    row_index: int32 (T, k), the row of x_sorted holding token t's j-th copy; -1 for a dropped copy.
    Defined here, beside its reader, so that permute imports unpermute and never the other way round.
    """

    row_index: jax.Array


def unpermute(y_sorted, handle: PermuteHandle, weights):
    """out[t] = sum_j weights[t, j] * y_sorted[handle.row_index[t, j]], accumulated in float32.

    Args:
      y_sorted: (R, H) rows in the order `permute` produced (R = T*k), bfloat16/float16/float32.
        Any R works: row_index entries outside [0, R) contribute nothing.
      handle: the PermuteHandle returned by `permute`.
      weights: (T, k) combine weights (e.g. router probabilities); any float dtype.
    Returns:
      (T, H) in y_sorted's dtype. Differentiable in y_sorted and weights; the gradient wrt
      y_sorted is `permute`'s scatter (its transpose), rows of dropped copies get zero.
    """
    if not isinstance(handle, PermuteHandle):
        raise TypeError(f"handle must be the PermuteHandle returned by permute, got {type(handle).__name__}")
    row_index = handle.row_index
    _checks.check_rank("handle.row_index", row_index, 2, "(T, k)")
    _checks.check_integer("handle.row_index", row_index)
    _checks.check_rank("y_sorted", y_sorted, 2, "(T*k, H)")
    _checks.check_rank("weights", weights, 2, "(T, k)")
    _checks.float_dtype("y_sorted", y_sorted.dtype)
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"weights must be a float array (T, k), got dtype {weights.dtype}")
    if weights.shape != row_index.shape:
        raise ValueError(f"weights must have shape (T, k) = {row_index.shape} like the handle, got {weights.shape}")
    # Entries outside [0, R) contribute nothing; in a wider dtype they must not wrap into range.
    row_index = _checks.index_as_int32(row_index, y_sorted.shape[0])
    return _unpermute(y_sorted, row_index, weights.astype(jnp.float32))


def unpermute_call(y_sorted, row_index, weights_f32):
    T = row_index.shape[-2]
    out = jax.ShapeDtypeStruct(y_sorted.shape[:-2] + (T, y_sorted.shape[-1]), y_sorted.dtype)
    return ffi_call("turbo_moe_unpermute", out, y_sorted, row_index, weights_f32)


@jax.custom_vjp
def _unpermute(y_sorted, row_index, weights_f32):
    return unpermute_call(y_sorted, row_index, weights_f32)


def _unpermute_fwd(y_sorted, row_index, weights_f32):
    return unpermute_call(y_sorted, row_index, weights_f32), (y_sorted, row_index, weights_f32)


def _unpermute_bwd(residuals, d_out):
    y_sorted, row_index, weights_f32 = residuals
    out = (jax.ShapeDtypeStruct(y_sorted.shape, y_sorted.dtype),
           jax.ShapeDtypeStruct(weights_f32.shape, jnp.float32),
           workspace("turbo_moe_unpermute_bwd_workspace_bytes", 1, y_sorted.shape[-2], batch=y_sorted.shape[:-2]))
    d_y, d_weights, _ = ffi_call("turbo_moe_unpermute_bwd", out, d_out, y_sorted, row_index, weights_f32)
    return match_varying(d_y, y_sorted), None, match_varying(d_weights, weights_f32)


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)
