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
ragged_all_to_all and deepep are `PhasedStage`s (dispatch, compute, combine): `micro_batched` runs several
micro-batches of the tokens with one's exchange beside another's experts.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

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


class PhasedStage(NamedTuple):
    """An EP exchange as three phases, so that `micro_batched` can interleave several micro-batches' phases:
    `dispatch(tokens, expert_ids, combine_w, n_experts) -> sent` (the collective there), `compute(sent, n_experts)
    -> done` (this rank's experts), `combine(done) -> (y, computed)` (the collective back). Called, it is a Stage."""

    dispatch: Callable
    compute: Callable
    combine: Callable

    def __call__(self, tokens, expert_ids, combine_w, n_experts: int):
        return self.combine(self.compute(self.dispatch(tokens, expert_ids, combine_w, n_experts), n_experts))


def ragged_all_to_all(local, *, stage, axis_name: str, impl: str, **_):
    """EP exchange through `ragged_exchange` around a token exchange `local` (sort or permute)."""

    def dispatch(tokens, expert_ids, combine_w, n_experts: int):
        t, k = expert_ids.shape
        n_recv = jax.lax.axis_size(axis_name) * t * k  # worst case: every copy of every rank comes here
        rows, expert_sizes, back = local.to_rows(tokens, expert_ids, n_experts)  # (T*k, D) by global expert = rank
        plan, recv_counts = exchange_plan(expert_sizes, axis_name)
        received = ragged_exchange(rows, plan, n_recv, axis_name, impl)  # (n_recv, D)
        return received, recv_counts, (plan, back, combine_w, expert_sizes.sum())

    def compute(sent, n_experts: int):
        received, recv_counts, keep = sent
        n_recv = received.shape[0]
        local_expert = received_local_expert(recv_counts, n_recv)  # (n_recv,), El past the data
        ones = make_varying(jnp.ones((n_recv, 1), jnp.float32), varying_axes(received))
        out_recv, _ = stage(received, local_expert[:, None], ones, n_experts // jax.lax.axis_size(axis_name))
        return out_recv, keep

    def combine(done):
        out_recv, (plan, back, combine_w, computed) = done
        t, k = combine_w.shape
        out_rows = ragged_exchange(out_recv, plan.reversed(), t * k, axis_name, impl)  # (T*k, D)
        return local.from_rows(out_rows, back, combine_w), computed

    return PhasedStage(dispatch, compute, combine)


def deepep(local, *, stage, axis_name: str, capacity: int | None, impl: str = NATIVE, layout: str = "auto", **_):
    """EP exchange through turbo_moe.ops.moe_dispatch / moe_combine around this rank's experts `stage`.

    capacity: token slots per source rank (None: T, the worst case); overflowing copies are dropped.
    layout: moe_dispatch's ("auto" | "dense" | "packed" | "ragged"; `ModelConfig.ep_layout`). The received rows are
    named for the remat policy "dots_experts_attention", which keeps them: its backward then needs no second
    dispatch."""
    del local  # the stage lays out the received copies itself

    def dispatch(tokens, expert_ids, combine_w, n_experts: int):
        recv_x, recv_ids, recv_w, handle = ops.moe_dispatch(
            tokens, expert_ids, combine_w, num_experts=n_experts, axis_name=axis_name, capacity=capacity,
            layout=layout, impl=impl)
        # recv_x (P*C, D): one row per (source token, this rank); recv_ids (P*C, k) local ids, -1 = none.
        return tuple(saved(t, EP_RECEIVED_NAME) for t in (recv_x, recv_ids, recv_w)), handle

    def compute(sent, n_experts: int):
        (recv_x, recv_ids, recv_w), handle = sent
        n_local = n_experts // jax.lax.axis_size(axis_name)
        per_token, computed = stage(recv_x, recv_ids, recv_w, n_local)  # (P*C, D) local experts summed
        return per_token, computed, handle

    def combine(done):
        per_token, computed, handle = done
        return ops.moe_combine(per_token, handle, axis_name=axis_name), computed  # (T, D)

    return PhasedStage(dispatch, compute, combine)


# Named scopes of micro-batch i's phases, under "ep_micro_batch{i}" (for profiles and tests)
PHASE_NAMES = ("ep_dispatch", "ep_experts", "ep_combine")


def micro_batched(stage, n: int):
    """`stage` run on n equal micro-batches of the tokens, its exchange overlapped with its experts.

    With a PhasedStage, micro-batch i is dispatched while micro-batch i-1's experts run, and combined while micro-batch
    i+1's experts run (DeepSeek-V3's dual micro-batch overlap, MaxText's batch split): at each step every micro-batch
    in flight moves one phase on, and their values first pass one optimization barrier together. The barrier is the
    order: a collective of step s cannot start before step s-1's collectives are done (so XLA cannot merge two
    micro-batches' collectives into one) and runs beside the experts of step s. Its transpose orders the backward
    pass the same way, mirrored. Other stages run their micro-batches one after another. Results equal one batch's
    (the tokens are independent), except a deepep capacity, which then applies to each micro-batch."""
    if n == 1:
        return stage

    def run(tokens, expert_ids, combine_w, n_experts: int):
        t = tokens.shape[0]
        if t % n:
            raise ValueError(f"ep_micro_batches={n}: the {t} tokens of a rank must divide into {n} equal micro-batches")
        m = t // n
        parts = [(tokens[i * m:(i + 1) * m], expert_ids[i * m:(i + 1) * m], combine_w[i * m:(i + 1) * m])
                 for i in range(n)]
        if not isinstance(stage, PhasedStage):
            outs = [stage(*part, n_experts) for part in parts]
        else:
            phases = (lambda v: stage.dispatch(*v, n_experts), lambda v: stage.compute(v, n_experts), stage.combine)
            values = list(parts)  # micro-batch i at step s is in phase s - i: 0..2 the phases, 3 done
            for step in range(n + len(phases)):
                live = [i for i in range(n) if 0 <= step - i <= len(phases)]
                if len(live) > 1:
                    with jax.named_scope("ep_micro_batch_order"):
                        synced = _barrier_floats([values[i] for i in live])
                    for i, v in zip(live, synced):
                        values[i] = v
                for i in live:
                    if step - i < len(phases):
                        with jax.named_scope(f"ep_micro_batch{i}"), jax.named_scope(PHASE_NAMES[step - i]):
                            values[i] = phases[step - i](values[i])
            outs = values
        ys, computed = zip(*outs)
        return jnp.concatenate(ys), sum(computed)

    return run


def _barrier_floats(values):
    """One optimization barrier over the float arrays of `values` (integers pass beside it: an integer's tangent
    has no values for the barrier's own derivative)."""
    leaves, tree = jax.tree.flatten(values)
    floats = [i for i, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.inexact)]
    for i, a in zip(floats, jax.lax.optimization_barrier([leaves[i] for i in floats])):
        leaves[i] = a
    return jax.tree.unflatten(tree, leaves)


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
