"""Ragged expert-parallel exchange (MaxText `ragged_all_to_all` style) with static worst-case buffers.

Each rank holds its token copies sorted by global expert, so the rows for destination rank p are one
contiguous block. `exchange_plan` turns the per-expert counts of every rank (one `all_gather` of E
int32 per rank) into the offsets and sizes `jax.lax.ragged_all_to_all` needs, on the device: no count
ever reaches the host. Rank r's receive buffer holds the blocks of sources 0..P-1 back to back, each
block ordered by local expert.

`ragged_exchange` is a custom_vjp whose backward pass is the reverse exchange (the same plan read the
other way). XLA:CPU has no `ragged-all-to-all` thunk (jax 0.10.2), so on the CPU the same semantics
are emulated with a padded `all_to_all` of (P, rows, H) blocks; tests run the emulation, GPUs the
native collective. Each destination's block is split into `chunks_per_peer` updates: XLA's one-shot
GPU kernel copies each update with one 128-thread block, so one update per peer left 2 blocks to
move the whole exchange at EP=2 (0.01x of an all_to_all, experiments/NOTES.md).

The expert-parallel exchanges (call inside shard_map; same signature as the one-device exchanges of
`exchanges.py`, which they wrap: `ep(local)(tokens, expert_ids, combine_w, n_experts, ffn)` with
global expert ids, `ffn` running this rank's E/P experts):
- `ragged_all_to_all(local)`: the local exchange sorts copies by global expert; its ffn sends them to
  the owning ranks (`ragged_exchange`), regroups them by local expert with the same local exchange
  (k = 1, weight 1), runs the experts and sends the outputs back (MaxText `sparse_matmul` + EP).
- `deepep(local)`: `turbo_moe.ops.moe_dispatch` sends each token once per destination rank with its
  local top-k; the local exchange sums its local experts; `moe_combine` brings the sums back.
- `all_to_all(local)`: capacity slots (E, B, C, D) to the experts' owners (split E, gather B) and back.
Buffers are static worst cases (ragged: P*T*k received rows), so no count ever goes to the host.
"""

from __future__ import annotations

import functools
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from turbo_moe.ops.varying import make_varying, match_varying, varying_axes

NATIVE, EMULATED = "native", "emulated"
UPDATES_IN_FLIGHT = 1024  # 128-thread copy blocks of the one-shot kernel per exchange (H200: 132 SMs x 16)


def chunks_per_peer(n_ranks: int) -> int:
    """Updates per destination rank (env TURBO_MOE_RAGGED_CHUNKS overrides: 1 is the old behaviour)."""
    forced = os.environ.get("TURBO_MOE_RAGGED_CHUNKS")
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"TURBO_MOE_RAGGED_CHUNKS must be a positive integer, got {forced!r}")
        return int(forced)
    return max(1, UPDATES_IN_FLIGHT // n_ranks)


class ExchangePlan(NamedTuple):
    """All int32 (P,). Forward: block p of my send rows [input_offsets[p], +send_sizes[p]) lands at
    output_offsets[p] of rank p; I receive recv_sizes[s] rows from rank s at recv_offsets[s], which
    came from offset return_offsets[s] of rank s's send buffer (where the reverse exchange puts them)."""

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array
    recv_offsets: jax.Array
    return_offsets: jax.Array

    def reversed(self) -> "ExchangePlan":
        return ExchangePlan(self.recv_offsets, self.recv_sizes, self.return_offsets,
                            self.send_sizes, self.input_offsets, self.output_offsets)


def _exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def exchange_plan(expert_counts: jax.Array, axis_name: str) -> tuple[ExchangePlan, jax.Array]:
    """expert_counts int32 (E,) copies this rank sends to each global expert ->
    (plan, recv_counts int32 (P, E/P): rows each source sends to each of my local experts)."""
    n_ranks = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    n_local = expert_counts.shape[0] // n_ranks
    all_counts = jax.lax.all_gather(expert_counts, axis_name).reshape(n_ranks, n_ranks, n_local)  # (src, dst, El)
    block = all_counts.sum(-1)  # (src, dst) rows each source sends each destination
    send_sizes = block[me]  # (P,)
    recv_sizes = block[:, me]  # (P,)
    plan = ExchangePlan(
        input_offsets=_exclusive_cumsum(send_sizes, 0),
        send_sizes=send_sizes,
        output_offsets=_exclusive_cumsum(block, 0)[me],  # sources before me fill rank p's buffer first
        recv_sizes=recv_sizes,
        recv_offsets=_exclusive_cumsum(recv_sizes, 0),
        return_offsets=_exclusive_cumsum(block, 1)[:, me],
    )
    plan = jax.tree.map(lambda a: a.astype(jnp.int32), plan)
    return plan, all_counts[:, me, :].astype(jnp.int32)


def received_local_expert(recv_counts: jax.Array, n_rows: int) -> jax.Array:
    """int32 (n_rows,) local expert of each receive-buffer row (E/P for rows past the data).

    recv_counts (P, El): the buffer is P source blocks, each El expert segments, back to back."""
    n_local = recv_counts.shape[1]
    ends = jnp.cumsum(recv_counts.reshape(-1))  # (P*El,)
    rows = jnp.arange(n_rows, dtype=jnp.int32)
    segment = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)  # (n_rows,)
    return jnp.where(rows < ends[-1], segment % n_local, n_local)


def split_updates(offsets_in, sizes, offsets_out, n_chunks: int):
    """(P,) updates -> (P*n_chunks,) updates, peer-major: update p covers rows [in, in+size) and becomes
    n_chunks consecutive pieces of ceil(size/n_chunks) rows (the last ones shorter or empty). Both
    sides of an exchange apply it to the same size, so send and receive pieces match."""
    piece = (sizes + n_chunks - 1) // n_chunks  # (P,)
    start = jnp.minimum(piece[:, None] * jnp.arange(n_chunks, dtype=sizes.dtype), sizes[:, None])  # (P, n)
    size = jnp.minimum(piece[:, None], sizes[:, None] - start)
    flat = lambda a: a.reshape(-1).astype(jnp.int32)
    return flat(offsets_in[:, None] + start), flat(size), flat(offsets_out[:, None] + start)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def ragged_exchange(x: jax.Array, plan: ExchangePlan, out_rows: int, axis_name: str, impl: str) -> jax.Array:
    """x (N, H) send rows -> (out_rows, H) received rows (zeros past the data)."""
    return _exchange(x, plan, out_rows, axis_name, impl)


def _exchange_fwd(x, plan, out_rows, axis_name, impl):
    return _exchange(x, plan, out_rows, axis_name, impl), (plan, x.shape[0], x[:0])  # x[:0]: x's type


def _exchange_bwd(out_rows, axis_name, impl, residuals, d_out):
    plan, in_rows, x_type = residuals
    d_x = _exchange(d_out, plan.reversed(), in_rows, axis_name, impl)
    # shard_map types: the cotangent must vary over exactly the mesh axes x varies over.
    d_x = match_varying(make_varying(d_x, varying_axes(x_type)), x_type)
    return d_x, jax.tree.map(lambda _: None, plan)


ragged_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _exchange(x, plan, out_rows, axis_name, impl):
    n = chunks_per_peer(jax.lax.axis_size(axis_name))
    in_off, send, out_off = split_updates(plan.input_offsets, plan.send_sizes, plan.output_offsets, n)
    _, recv, _ = split_updates(plan.recv_offsets, plan.recv_sizes, plan.recv_offsets, n)
    if impl == NATIVE:
        output = make_varying(jnp.zeros((out_rows,) + x.shape[1:], x.dtype), varying_axes(x))
        return jax.lax.ragged_all_to_all(x, output, in_off, send, out_off, recv, axis_name=axis_name)
    if impl == EMULATED:
        return _emulated_exchange(x, in_off, send, out_off, out_rows, axis_name)
    raise ValueError(f"impl must be {NATIVE!r} or {EMULATED!r}, got {impl!r}")


def _emulated_exchange(x, in_off, send, out_off, out_rows, axis_name):
    """ragged_all_to_all semantics through a padded all_to_all (moves P*N rows: CPU tests only).

    Updates (P*n,) are peer-major, n per destination; like the native collective, rows land where
    the *sender's* out_off says."""
    n_rows = x.shape[0]
    n_ranks = jax.lax.axis_size(axis_name)
    i = jnp.arange(n_rows, dtype=jnp.int32)
    lo, hi = in_off.reshape(n_ranks, -1, 1), (in_off + send).reshape(n_ranks, -1, 1)  # (P, n, 1)
    inside = (i >= lo) & (i < hi)  # (P, n, N): row i belongs to update (p, j)
    shift = (out_off - in_off).reshape(n_ranks, -1, 1)
    valid = inside.any(1)  # (P, N)
    target = jnp.where(valid, jnp.sum(jnp.where(inside, shift + i, 0), axis=1), out_rows)  # (P, N)
    blocks = jnp.where(valid[..., None], x[None], 0)  # (P, N, H)
    got = jax.lax.all_to_all(blocks, axis_name, 0, 0)  # (P src, N, H)
    got_target = jax.lax.all_to_all(target, axis_name, 0, 0)  # (P src, N)
    output = jnp.zeros((out_rows,) + x.shape[1:], x.dtype)
    return output.at[got_target.reshape(-1)].set(got.reshape((-1,) + x.shape[1:]), mode="drop")


def default_impl(platform: str) -> str:
    """The native collective where XLA implements it (GPU/TPU), the emulation on CPU."""
    return EMULATED if platform == "cpu" else NATIVE


def ragged_all_to_all(local, *, axis_name: str, impl: str, **_):
    """EP exchange through `ragged_exchange` around a token exchange `local` (sort or permute)."""

    def exchange(tokens, expert_ids, combine_w, n_experts: int, ffn):
        t, k = expert_ids.shape
        n_ranks = jax.lax.axis_size(axis_name)
        n_local = n_experts // n_ranks
        n_recv = n_ranks * t * k  # worst case: every copy of every rank comes here

        def remote_ffn(rows, expert_sizes):  # rows (T*k, D) sorted by global expert = by rank
            plan, recv_counts = exchange_plan(expert_sizes, axis_name)
            received = ragged_exchange(rows, plan, n_recv, axis_name, impl)  # (n_recv, D)
            local_expert = received_local_expert(recv_counts, n_recv)  # (n_recv,), El past the data
            ones = make_varying(jnp.ones((n_recv, 1), jnp.float32), varying_axes(received))
            out_recv, _ = local(received, local_expert[:, None], ones, n_local, ffn)  # (n_recv, D)
            return ragged_exchange(out_recv, plan.reversed(), t * k, axis_name, impl)  # (T*k, D)

        return local(tokens, expert_ids, combine_w, n_experts, remote_ffn)

    return exchange


def deepep(local, *, axis_name: str, capacity: int | None, impl: str = NATIVE, **_):
    """EP exchange through turbo_moe.ops.moe_dispatch / moe_combine around a token exchange `local`.

    capacity: token slots per source rank (None: T, the worst case); overflowing copies are dropped.
    The dispatch layout is moe_dispatch's "auto" unless env TURBO_MOE_DEEPEP_LAYOUT names one
    (dense | packed | ragged: a switch for side-by-side benchmarks)."""
    layout = os.environ.get("TURBO_MOE_DEEPEP_LAYOUT", "auto")

    def exchange(tokens, expert_ids, combine_w, n_experts: int, ffn):
        from turbo_moe import ops

        n_local = n_experts // jax.lax.axis_size(axis_name)
        recv_x, recv_ids, recv_w, handle = ops.moe_dispatch(
            tokens, expert_ids, combine_w, num_experts=n_experts, axis_name=axis_name, capacity=capacity,
            layout=layout, impl=impl)
        # recv_x (P*C, D): one row per (source token, this rank); recv_ids (P*C, k) local ids, -1 = none.
        per_token, computed = local(recv_x, recv_ids, recv_w, n_local, ffn)  # (P*C, D) local experts summed
        return ops.moe_combine(per_token, handle, axis_name=axis_name), computed  # (T, D)

    return exchange


def deepep_capacity(tokens_per_rank: int, capacity_factor: float) -> int | None:
    """Token slots per source rank: None (= T, the worst case) unless a hint 0 < cf < 1 caps them.

    A hint of cf gives ceil(cf * T) slots: every rank can then take at most that share of another
    rank's tokens (cf = 1 is the worst case itself). Overflowing copies are counted as dropped."""
    if capacity_factor <= 0 or capacity_factor >= 1:
        return None
    return max(1, math.ceil(capacity_factor * tokens_per_rank))


def all_to_all(local, *, axis_name: str, **_):
    """EP exchange of capacity slots around `capacity_exchange`: the capacity is per sequence, so the
    result equals one device's."""

    def exchange(tokens, expert_ids, combine_w, n_experts: int, ffn):
        def remote_ffn(slots, group_sizes):  # slots (E, B, C, D)
            # Experts to their owners: split E over the ranks, gather every rank's sequences on B.
            slots_local = jax.lax.all_to_all(slots, axis_name, 0, 1, tiled=True)  # (E/P, P*B, C, D)
            out_local = ffn(slots_local, group_sizes)  # (E/P, P*B, C, D)
            return jax.lax.all_to_all(out_local, axis_name, 1, 0, tiled=True)  # (E, B, C, D)

        return local(tokens, expert_ids, combine_w, n_experts, remote_ffn)

    return exchange
