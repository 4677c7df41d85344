"""Ragged exchange: rows of variable count between the ranks of a mesh axis, with static buffers.

A pure-JAX building block (no FFI kernel): `ragged_exchange(x, plan, out_rows, axis_name, impl)` sends
block p of this rank's rows to rank p and returns the blocks received, as `ExchangePlan` offsets and
sizes say. It is a custom_vjp whose backward pass is the reverse exchange (the same plan read the other
way). impl "native" runs `jax.lax.ragged_all_to_all` with each destination's block split into
`chunks_per_peer` updates: XLA's one-shot GPU kernel copies each update with one 128-thread block, so
one update per peer left 2 blocks to move the whole exchange at EP=2 (docs/expert-parallel.md). XLA:CPU has no `ragged-all-to-all` thunk (jax 0.10.2), so impl "emulated" gives
the same semantics through a padded `all_to_all` of (P, rows, H) blocks; tests run the emulation, GPUs
the native collective (`default_impl` picks by platform).

`exchange_plan` builds the plan of rows sorted by global expert (rank p's block is contiguous) from the
per-expert counts of every rank (one `all_gather` of E int32 per rank), on the device: no count ever
reaches the host. Rank r's receive buffer holds the blocks of sources 0..P-1 back to back, each block
ordered by local expert (`received_local_expert` reads that layout back).

It lives in the ops because `moe_dispatch`'s ragged layout moves its rows with it, and the ops must
not import `turbo_moe.model` (which imports the ops); the model's expert-parallel exchanges
(`turbo_moe/model/ep_exchange.py`) use it from here too.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from turbo_moe.ops.varying import make_varying, match_varying, varying_axes

NATIVE, EMULATED = "native", "emulated"
UPDATES_IN_FLIGHT = 1024  # 128-thread copy blocks of the one-shot kernel per exchange (H200: 132 SMs x 16)


def chunks_per_peer(n_ranks: int) -> int:
    """Updates per destination rank: enough copy blocks in flight to fill the GPU whatever the rank count."""
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
