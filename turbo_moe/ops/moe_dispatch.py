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

Layouts (the results are the same; they differ in what crosses the wire and what runs around it):
- "packed": a kernel packs each destination's tokens into (P, C, H) in token order; one all_to_all
  moves the whole buffer, full or not.
- "dense" (C = T only): each block of the receive buffer is ALL of one rank's tokens in token order,
  so no packing: x goes to every rank (the same bytes as the worst-case packed buffer; by all_gather,
  all_to_all or collective permutes: `dense_via`, turbo_moe.ops.dense_exchange), the ids and weights
  by one all_gather; rows of tokens with no expert here carry id -1. The combine is a sum over ranks.
- "ragged": packed, but only the real rows of each destination cross (`ragged_all_to_all`, counts
  exchanged first by a (P,) all_to_all): fewer bytes when tokens reach few of the ranks (large P).
- "auto": for P <= WORST_CASE_MAX_RANKS (a token reaches 1 - (1 - 1/P)^k of the ranks: nearly all, so
  real rows ~ the buffer) dense where C = T, else packed; ragged for more ranks (real rows only: reasoned
  from the bytes, not measured past P = 4). Dense was the fastest layout at EP=2 and EP=4 on four H200s
  (docs/expert-parallel.md has the measurements).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call, match_varying
from turbo_moe.ops.dense_exchange import DEFAULT_DENSE_VIA, dispatch_dense, resolve_via
from turbo_moe.ops.ragged_exchange import ExchangePlan, default_impl, ragged_exchange
from turbo_moe.ops.unpermute import unpermute_call

LAYOUTS = ("auto", "dense", "packed", "ragged")
WORST_CASE_MAX_RANKS = 4  # top-8 at P=4: 90% of (token, remote rank) pairs are real rows; 66% at P=8


@functools.partial(jax.tree_util.register_dataclass, data_fields=("slot", "counts", "overflow", "plan"),
                   meta_fields=("layout", "impl", "dense_via"))
@dataclasses.dataclass(frozen=True)
class DispatchHandle:
    """What `moe_combine` needs. slot int32 (T, P): the row of token t in rank p's block, or -1.
    counts int32 (P,): tokens sent to each rank; overflow int32 (P,): tokens that did not fit.
    plan: the ragged layout's ExchangePlan (None otherwise); layout: the one the dispatch used;
    impl: the ragged collective ("native" | "emulated") the combine must use too;
    dense_via: the dense layout's collectives as resolved (turbo_moe.ops.dense_exchange), the combine's too."""

    slot: jax.Array
    counts: jax.Array
    overflow: jax.Array
    plan: object = None
    layout: str = "packed"
    impl: str | None = None
    dense_via: str | None = None


def slot_rows(slot, capacity: int):
    """(T, P) rows of a flattened (P*C, H) buffer for each (token, rank), -1 where nothing was sent."""
    P = slot.shape[-1]
    return jnp.where(slot >= 0, slot + jnp.arange(P, dtype=jnp.int32) * capacity, -1)


def resolve_layout(layout: str, n_ranks: int, tokens: int, capacity: int) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "dense" and capacity != tokens:
        raise ValueError(f"layout='dense' sends every token to every rank: capacity must be T={tokens}, "
                         f"got {capacity}")
    if layout == "auto" and n_ranks <= WORST_CASE_MAX_RANKS:  # few ranks: every buffer is nearly all real rows
        return "dense" if capacity == tokens else "packed"
    return "ragged" if layout == "auto" else layout


def moe_dispatch(x, expert_ids, weights, *, num_experts: int, axis_name: str, capacity: int | None = None,
                 layout: str = "auto", impl: str | None = None, dense_via: str = DEFAULT_DENSE_VIA):
    """Sends each token to the ranks owning its experts (see the module docstring for the layouts).

    Args:
      x: (T, H) this rank's tokens.  expert_ids: int (T, k) global expert ids (out of range: dropped).
      weights: (T, k) combine weights.  num_experts: E (divisible by the axis size P).
      capacity: slots per destination rank (default T: the worst case, nothing can overflow).
      layout: "auto" | "dense" | "packed" | "ragged".  impl: the ragged layout's collective,
        "native" or "emulated" (XLA:CPU has no ragged_all_to_all); default by jax.default_backend().
      dense_via: the dense layout's collectives: "auto" (permute at P = 2, else all_gather) |
        "all_gather" | "all_to_all" | "permute" (turbo_moe.ops.dense_exchange; the results are the same).
    Returns:
      recv_x (P*C, H), recv_ids int32 (P*C, k) local expert ids (-1: none / empty slot),
      recv_w float32 (P*C, k), handle (DispatchHandle) for moe_combine.
    """
    T, k, num_experts, P = _checks.expert_parallel_inputs(x, expert_ids, weights, num_experts, axis_name)
    if capacity is not None:
        _checks.static_int("capacity", capacity)
    C = T if capacity is None else int(capacity)
    if not 0 < C <= T:
        raise ValueError(f"capacity must be in [1, T={T}] slots per destination rank, got {capacity}")
    layout = resolve_layout(layout, P, T, C)
    dense_via = resolve_via(dense_via, P)
    ids = _checks.index_as_int32(expert_ids, num_experts)
    if layout == "dense":
        recv_x, recv_ids, recv_w, sent = dispatch_dense(x, ids, weights.astype(jnp.float32), P, num_experts // P,
                                                        axis_name, dense_via)
        slot = jnp.where(sent, jnp.arange(T, dtype=jnp.int32)[:, None], -1)
        counts = sent.sum(0, dtype=jnp.int32)
        return recv_x, recv_ids, recv_w, DispatchHandle(slot, counts, jnp.zeros_like(counts), None, "dense", None,
                                                        dense_via)
    send_x, send_ids, send_w, counts, overflow, slot = _dispatch_pack(
        x, ids, weights.astype(jnp.float32), P, num_experts // P, C)
    exchange = functools.partial(jax.lax.all_to_all, axis_name=axis_name, split_axis=0, concat_axis=0)
    recv_ids, recv_w = exchange(send_ids), exchange(send_w)  # (P, C, k): small
    plan = None
    if layout == "ragged":
        plan = slot_plan(counts, C, axis_name)
        impl = impl or default_impl(jax.default_backend())  # XLA:CPU has no ragged_all_to_all
        recv_x = ragged_exchange(send_x.reshape(P * C, -1), plan, P * C, axis_name, impl)
    else:
        recv_x = exchange(send_x)  # (P, C, H)
    handle = DispatchHandle(slot, counts, overflow, plan, layout, impl)
    return recv_x.reshape(P * C, -1), recv_ids.reshape(P * C, k), recv_w.reshape(P * C, k), handle


def slot_plan(counts, capacity: int, axis_name: str):
    """ExchangePlan of the ragged layout: my counts[p] real rows of block p (rows [p*C, p*C+counts[p]))
    land at block `me` of rank p; the receive buffer keeps the (P, C) slot layout of the packed one."""
    P = counts.shape[0]
    me = jax.lax.axis_index(axis_name).astype(jnp.int32)
    blocks = jnp.arange(P, dtype=jnp.int32) * capacity  # (P,)
    mine = jnp.full((P,), me * capacity, jnp.int32)
    recv = jax.lax.all_to_all(counts.astype(jnp.int32), axis_name, 0, 0, tiled=True)  # (P,) rows from each source
    return ExchangePlan(input_offsets=blocks, send_sizes=counts.astype(jnp.int32), output_offsets=mine,
                        recv_sizes=recv, recv_offsets=blocks, return_offsets=mine)


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
