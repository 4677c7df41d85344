"""The expert-parallel exchanges (call inside shard_map): each is built from a one-device exchange `local` of
`exchanges.py`, this rank's E/P experts behind it (`stage`, a `exchanges.Stage`) and their `ffn`, and is a
stage itself: `ep(local, stage=..., ffn=...)(tokens, expert_ids, combine_w, n_experts)` with global expert ids.
- `ragged_all_to_all` (MaxText `sparse_matmul` + EP): the local exchange sorts copies by global expert; its
  ffn sends them to the owning ranks (`turbo_moe.ops.ragged_exchange`), where the stage regroups them by
  local expert (k = 1, weight 1) and runs the experts, and sends the outputs back.
- `deepep`: `turbo_moe.ops.moe_dispatch` sends each token once per destination rank with its local top-k;
  the stage sums its local experts; `moe_combine` brings the sums back.
- `all_to_all`: capacity slots (E, B, C, D) to the experts' owners (split E, gather B), ffn, and back.
Buffers are static worst cases (ragged: P*T*k received rows), so no count ever goes to the host.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from turbo_moe import ops
from turbo_moe.ops.expert_block import saved
from turbo_moe.ops.ragged_exchange import NATIVE, exchange_plan, ragged_exchange, received_local_expert
from turbo_moe.ops.varying import make_varying, varying_axes

# What deepep's dispatch delivered (rows, local ids, weights), named for the remat policies: the policy
# "dots_experts_attention" saves it, so the backward pass does not run the dispatch's collectives again
# (the expert block's backward copies its rows from these).
EP_RECEIVED_NAME = "moe_ep_received"


def ragged_all_to_all(local, *, stage, axis_name: str, impl: str, **_):
    """EP exchange through `ragged_exchange` around a token exchange `local` (sort or permute)."""

    def exchange(tokens, expert_ids, combine_w, n_experts: int):
        t, k = expert_ids.shape
        n_ranks = jax.lax.axis_size(axis_name)
        n_local = n_experts // n_ranks
        n_recv = n_ranks * t * k  # worst case: every copy of every rank comes here

        def remote_ffn(rows, expert_sizes):  # rows (T*k, D) sorted by global expert = by rank
            plan, recv_counts = exchange_plan(expert_sizes, axis_name)
            received = ragged_exchange(rows, plan, n_recv, axis_name, impl)  # (n_recv, D)
            local_expert = received_local_expert(recv_counts, n_recv)  # (n_recv,), El past the data
            ones = make_varying(jnp.ones((n_recv, 1), jnp.float32), varying_axes(received))
            out_recv, _ = stage(received, local_expert[:, None], ones, n_local)  # (n_recv, D)
            return ragged_exchange(out_recv, plan.reversed(), t * k, axis_name, impl)  # (T*k, D)

        return local(tokens, expert_ids, combine_w, n_experts, remote_ffn)

    return exchange


def deepep(local, *, stage, axis_name: str, capacity: int | None, impl: str = NATIVE, layout: str = "auto", **_):
    """EP exchange through turbo_moe.ops.moe_dispatch / moe_combine around this rank's experts `stage`.

    capacity: token slots per source rank (None: T, the worst case); overflowing copies are dropped.
    layout: moe_dispatch's ("auto" | "dense" | "packed" | "ragged"; `ModelConfig.ep_layout`). The received rows are
    named for the remat policy "dots_experts_attention", which keeps them: its backward then needs no second
    dispatch."""
    del local  # the stage lays out the received copies itself

    def exchange(tokens, expert_ids, combine_w, n_experts: int):
        n_local = n_experts // jax.lax.axis_size(axis_name)
        recv_x, recv_ids, recv_w, handle = ops.moe_dispatch(
            tokens, expert_ids, combine_w, num_experts=n_experts, axis_name=axis_name, capacity=capacity,
            layout=layout, impl=impl)
        # recv_x (P*C, D): one row per (source token, this rank); recv_ids (P*C, k) local ids, -1 = none.
        recv_x, recv_ids, recv_w = (saved(t, EP_RECEIVED_NAME) for t in (recv_x, recv_ids, recv_w))
        per_token, computed = stage(recv_x, recv_ids, recv_w, n_local)  # (P*C, D) local experts summed
        return ops.moe_combine(per_token, handle, axis_name=axis_name), computed  # (T, D)

    return exchange


def deepep_capacity(tokens_per_rank: int, capacity_factor: float) -> int | None:
    """Token slots per source rank: None (= T, the worst case) unless a hint 0 < cf < 1 caps them.

    A hint of cf gives ceil(cf * T) slots: every rank can then take at most that share of another
    rank's tokens (cf = 1 is the worst case itself). Overflowing copies are counted as dropped."""
    if capacity_factor <= 0 or capacity_factor >= 1:
        return None
    return max(1, math.ceil(capacity_factor * tokens_per_rank))


def all_to_all(local, *, ffn, axis_name: str, **_):
    """EP exchange of capacity slots around `capacity_exchange`: the capacity is per sequence, so the
    result equals one device's."""

    def exchange(tokens, expert_ids, combine_w, n_experts: int):
        def remote_ffn(slots, group_sizes):  # slots (E, B, C, D)
            # Experts to their owners: split E over the ranks, gather every rank's sequences on B.
            slots_local = jax.lax.all_to_all(slots, axis_name, 0, 1, tiled=True)  # (E/P, P*B, C, D)
            out_local = ffn(slots_local, group_sizes)  # (E/P, P*B, C, D)
            return jax.lax.all_to_all(out_local, axis_name, 1, 0, tiled=True)  # (E, B, C, D)

        return local(tokens, expert_ids, combine_w, n_experts, remote_ffn)

    return exchange
