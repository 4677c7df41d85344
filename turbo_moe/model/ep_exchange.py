"""Ragged expert-parallel exchange (MaxText `ragged_all_to_all` style) with static worst-case buffers.

Each rank holds its token copies sorted by global expert, so the rows for destination rank p are one
contiguous block. `exchange_plan` turns the per-expert counts of every rank (one `all_gather` of E
int32 per rank) into the offsets and sizes `jax.lax.ragged_all_to_all` needs, on the device: no count
ever reaches the host. Rank r's receive buffer holds the blocks of sources 0..P-1 back to back, each
block ordered by local expert.

`ragged_exchange` is a custom_vjp whose backward pass is the reverse exchange (the same plan read the
other way). XLA:CPU has no `ragged-all-to-all` thunk (jax 0.10.2), so on the CPU the same semantics
are emulated with a padded `all_to_all` of (P, rows, H) blocks; tests run the emulation, GPUs the
native collective.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from turbo_moe.ops._ffi import make_varying, match_varying, varying_axes

NATIVE, EMULATED = "native", "emulated"


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
    if impl == NATIVE:
        output = make_varying(jnp.zeros((out_rows,) + x.shape[1:], x.dtype), varying_axes(x))
        return jax.lax.ragged_all_to_all(x, output, plan.input_offsets, plan.send_sizes, plan.output_offsets,
                                         plan.recv_sizes, axis_name=axis_name)
    if impl == EMULATED:
        return _emulated_exchange(x, plan, out_rows, axis_name)
    raise ValueError(f"impl must be {NATIVE!r} or {EMULATED!r}, got {impl!r}")


def _emulated_exchange(x, plan, out_rows, axis_name):
    """ragged_all_to_all semantics through a padded all_to_all (moves P*N rows: CPU tests only).

    Like the native collective, rows land where the *sender's* output_offsets say."""
    n = x.shape[0]
    i = jnp.arange(n, dtype=jnp.int32)
    valid = i < plan.send_sizes[:, None]  # (P, N)
    blocks = jnp.where(valid[..., None], x[jnp.clip(plan.input_offsets[:, None] + i, 0, n - 1)], 0)  # (P, N, H)
    target = jnp.where(valid, plan.output_offsets[:, None] + i, out_rows)  # (P, N) rows in the receiver
    got = jax.lax.all_to_all(blocks, axis_name, 0, 0)  # (P src, N, H)
    got_target = jax.lax.all_to_all(target, axis_name, 0, 0)  # (P src, N)
    output = jnp.zeros((out_rows,) + x.shape[1:], x.dtype)
    return output.at[got_target.reshape(-1)].set(got.reshape((-1,) + x.shape[1:]), mode="drop")


def default_impl(platform: str) -> str:
    """The native collective where XLA implements it (GPU/TPU), the emulation on CPU."""
    return EMULATED if platform == "cpu" else NATIVE
