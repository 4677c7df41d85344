"""Expert-parallel combine: the transpose of `moe_dispatch`.

Each rank sends back one row per received token (its local experts already reduced, weighted, by
`unpermute`); the source rank sums the rows that come back from every rank. Call inside
`shard_map` with the same `axis_name` as the dispatch; the handle says which layout it used.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import make_varying, varying_axes
from turbo_moe.ops.dense_exchange import sum_blocks
from turbo_moe.ops.moe_dispatch import DispatchHandle, slot_rows
from turbo_moe.ops.permute import PermuteHandle
from turbo_moe.ops.ragged_exchange import ragged_exchange
from turbo_moe.ops.unpermute import unpermute


def moe_combine(y, handle: DispatchHandle, *, axis_name: str):
    """(P*C, H) per-received-token outputs -> (T, H) outputs of this rank's tokens.

    Token t's result is the sum over ranks p of the row rank p computed for it (none where the
    token was not sent to p, or overflowed). Differentiable in y; the gradient is the dispatch.
    """
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be the DispatchHandle returned by moe_dispatch, got {type(handle).__name__}")
    _checks.check_rank("y", y, 2, "(P*C, H)")
    _checks.float_dtype("y", y.dtype)
    T, P = handle.slot.shape
    if y.shape[0] % P:
        raise ValueError(f"y must have P*C rows (P={P}), got {y.shape}")
    C = y.shape[0] // P
    if handle.layout == "dense":
        if C != T:
            raise ValueError(f"y must have P*T = {P * T} rows for a dense dispatch, got {y.shape}")
        return sum_blocks(y, axis_name, handle.dense_via)  # (T, H): rows for other tokens' ranks are zero
    if handle.layout == "ragged":
        back = ragged_exchange(y, handle.plan.reversed(), P * C, axis_name, handle.impl)  # real rows only
    else:
        back = jax.lax.all_to_all(y.reshape(P, C, -1), axis_name, 0, 0)  # (P, C, H): rows for my tokens
    rows = PermuteHandle(slot_rows(handle.slot, C))  # (T, P)
    ones = make_varying(jnp.ones((T, P), jnp.float32), varying_axes(back))  # typed like the data
    return unpermute(back.reshape(P * C, -1), rows, ones)
