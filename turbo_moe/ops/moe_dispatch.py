"""Expert-parallel dispatch, DeepEP-style, with static worst-case buffers (no count goes to the host).

Call inside `shard_map` over the expert mesh axis `axis_name` (P ranks; rank p owns experts
[p*El, (p+1)*El)). Each token travels ONCE per destination rank that owns any of its experts,
with the local ids and weights of those experts; on arrival, `permute` expands the rows per local
expert for the grouped GEMM. `moe_combine` is the exact transpose.

    recv_x, recv_ids, recv_w, handle = moe_dispatch(x, expert_ids, weights, num_experts=E, axis_name="expert")
    x_sorted, sizes, ph = permute(recv_x, recv_ids, E // P)        # group by local expert
    y = unpermute(experts(x_sorted, sizes), ph, recv_w)           # (P*C, H): one row per received token
    out = moe_combine(y, handle, axis_name="expert")              # (T, H)

Receive buffers hold C = T slots per source rank (every token could go to every rank), or
`capacity` slots when the caller caps them; overflowing tokens are counted in handle.overflow
(per destination rank) and contribute nothing — never silently.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call, match_varying
from turbo_moe.ops.unpermute import unpermute_call


class DispatchHandle(NamedTuple):
    """What `moe_combine` needs. slot int32 (T, P): the send slot of token t on rank p, or -1.
    counts int32 (P,): tokens sent to each rank; overflow int32 (P,): tokens that did not fit."""

    slot: jax.Array
    counts: jax.Array
    overflow: jax.Array


def slot_rows(slot, capacity: int):
    """(T, P) rows of a flattened (P*C, H) buffer for each (token, rank), -1 where nothing was sent."""
    P = slot.shape[-1]
    return jnp.where(slot >= 0, slot + jnp.arange(P, dtype=jnp.int32) * capacity, -1)


def moe_dispatch(x, expert_ids, weights, *, num_experts: int, axis_name: str, capacity: int | None = None):
    """Packs tokens per destination rank and exchanges them with one all_to_all.

    Args:
      x: (T, H) this rank's tokens.  expert_ids: int32 (T, k) global expert ids (out of range: dropped).
      weights: (T, k) combine weights.  num_experts: E (divisible by the axis size P).
      capacity: slots per destination rank (default T: the worst case, nothing can overflow).
    Returns:
      recv_x (P*C, H), recv_ids int32 (P*C, k) local expert ids (-1: none / empty slot),
      recv_w float32 (P*C, k), handle (DispatchHandle) for moe_combine.
    """
    _checks.check_rank("x", x, 2, "(T, H)")
    _checks.check_rank("expert_ids", expert_ids, 2, "(T, k)")
    _checks.check_rank("weights", weights, 2, "(T, k)")
    _checks.check_integer("expert_ids", expert_ids)
    _checks.float_dtype("x", x.dtype)
    T, k = expert_ids.shape
    if x.shape[0] != T or weights.shape != (T, k):
        raise ValueError(f"x (T, H), expert_ids (T, k) and weights (T, k) disagree: {x.shape}, "
                         f"{expert_ids.shape}, {weights.shape}")
    num_experts = _checks.static_int("num_experts", num_experts)
    P = jax.lax.axis_size(axis_name)
    if num_experts % P:
        raise ValueError(f"num_experts={num_experts} must be divisible by the size {P} of mesh axis {axis_name!r}")
    if capacity is not None:
        _checks.static_int("capacity", capacity)
    C = T if capacity is None else int(capacity)
    if not 0 < C <= T:
        raise ValueError(f"capacity must be in [1, T={T}] slots per destination rank, got {capacity}")
    send_x, send_ids, send_w, counts, overflow, slot = _dispatch_pack(
        x, _checks.index_as_int32(expert_ids, num_experts), weights.astype(jnp.float32), P, num_experts // P, C)
    exchange = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0)
    recv_x, recv_ids, recv_w = exchange(send_x), exchange(send_ids), exchange(send_w)  # (P, C, ...)
    handle = DispatchHandle(slot, counts, overflow)
    return recv_x.reshape(P * C, -1), recv_ids.reshape(P * C, k), recv_w.reshape(P * C, k), handle


def _pack_call(x, expert_ids, weights, P, El, C):
    T, k = expert_ids.shape[-2:]
    batch = x.shape[:-2]
    out = (
        jax.ShapeDtypeStruct(batch + (P, C, x.shape[-1]), x.dtype),
        jax.ShapeDtypeStruct(batch + (P, C, k), jnp.int32),
        jax.ShapeDtypeStruct(batch + (P, C, k), jnp.float32),
        jax.ShapeDtypeStruct(batch + (P,), jnp.int32),
        jax.ShapeDtypeStruct(batch + (P,), jnp.int32),
        jax.ShapeDtypeStruct(batch + (T, P), jnp.int32),
    )
    return ffi_call("turbo_moe_dispatch_pack", out, x, expert_ids, weights,
                    num_ranks=P, experts_per_rank=El, capacity=C)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _dispatch_pack(x, expert_ids, weights, P, El, C):
    return _pack_call(x, expert_ids, weights, P, El, C)


def _dispatch_pack_fwd(x, expert_ids, weights, P, El, C):
    outs = _pack_call(x, expert_ids, weights, P, El, C)
    return outs, (expert_ids, outs[5], x[:0], weights[:0])  # [:0]: the inputs' types, no data


def _dispatch_pack_bwd(P, El, C, residuals, cotangents):
    expert_ids, slot, x_type, w_type = residuals
    d_send_x, _, d_send_w = cotangents[:3]
    T, k = expert_ids.shape
    rows = slot_rows(slot, C)  # (T, P)
    # x was copied once per destination: its gradient is the sum of those copies' gradients.
    d_x = unpermute_call(d_send_x.reshape(P * C, -1), rows, jnp.ones((T, P), jnp.float32))
    # weights[t, j] went to slot (rank of expert, slot[t, rank], j).
    valid = (expert_ids >= 0) & (expert_ids < P * El)
    dest = jnp.where(valid, expert_ids // El, 0)  # (T, k)
    dest_slot = jnp.take_along_axis(slot, dest, axis=1)  # (T, k)
    sent = valid & (dest_slot >= 0)
    flat = (dest * C + jnp.maximum(dest_slot, 0)) * k + jnp.arange(k, dtype=jnp.int32)
    d_w = jnp.where(sent, d_send_w.reshape(-1)[flat], 0.0)
    return match_varying(d_x, x_type), None, match_varying(d_w, w_type)


_dispatch_pack.defvjp(_dispatch_pack_fwd, _dispatch_pack_bwd)
