"""Per-rank bodies of the ragged-exchange EP paths (call inside shard_map over the expert axis).

`ragged`: MaxText `sparse_matmul` with expert parallelism. Copies sorted by global expert ->
`ragged_exchange` to the ranks owning the experts -> regroup by local expert -> `ragged_dot` GEMMs ->
ungroup -> reverse exchange -> weighted sum over each token's k copies.
`turbo` with ep_exchange="ragged_all_to_all": the same exchange, with our permute / grouped GEMM /
unpermute kernels for the local sorting and the GEMMs (the blog's `sparse-gmm` configuration).

Buffers are static: a rank can receive at most P * T * k copies (every copy of every rank), so the
receive buffer has that many rows and nothing is ever dropped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.model.ep_exchange import exchange_plan, ragged_exchange, received_local_expert
from turbo_moe.model.experts import ExpertWeights, swiglu_fused


def _local_counts(expert_ids: jax.Array, n_experts: int) -> jax.Array:
    return jnp.bincount(expert_ids.reshape(-1), length=n_experts).astype(jnp.int32)  # (E,)


def ragged_ep_local(tokens, expert_ids, combine_w, w_local: ExpertWeights, *, n_experts: int, axis_name: str,
                    impl: str) -> tuple[jax.Array, jax.Array]:
    """tokens (T, D), expert_ids (T, k) global, combine_w (T, k) f32, w_local (El, ...) ->
    (y (T, D), copies computed on this rank () int32)."""
    t, d = tokens.shape
    k = expert_ids.shape[1]
    n_ranks = jax.lax.axis_size(axis_name)
    flat_ids = expert_ids.reshape(-1)  # (T*k,) copy c = token c // k, choice c % k
    order = jnp.argsort(flat_ids, stable=True)  # (T*k,) copies grouped by global expert = by rank
    x_sorted = tokens[order // k]  # (T*k, D)

    plan, recv_counts = exchange_plan(_local_counts(flat_ids, n_experts), axis_name)
    n_recv = n_ranks * t * k  # worst case: every copy of every rank comes here
    received = ragged_exchange(x_sorted, plan, n_recv, axis_name, impl)  # (n_recv, D)

    local_expert = received_local_expert(recv_counts, n_recv)  # (n_recv,), El past the data
    regroup = jnp.argsort(local_expert, stable=True)  # (n_recv,) by local expert, padding last
    group_sizes = recv_counts.sum(0)  # (El,)
    h = jax.lax.ragged_dot(received[regroup], w_local.w_gate_up, group_sizes)  # (n_recv, 2F)
    out_grouped = jax.lax.ragged_dot(swiglu_fused(h), w_local.w_down, group_sizes)  # (n_recv, D)
    out_recv = out_grouped[jnp.argsort(regroup)]  # (n_recv, D) back in receive order

    returned = ragged_exchange(out_recv, plan.reversed(), t * k, axis_name, impl)  # (T*k, D)
    out = returned[jnp.argsort(order)].reshape(t, k, d).astype(jnp.float32)  # (T, k, D)
    y = jnp.einsum("tkd,tk->td", out, combine_w)
    return y.astype(tokens.dtype), group_sizes.sum()


def turbo_ragged_ep_local(tokens, expert_ids, combine_w, w_local: ExpertWeights, *, n_experts: int,
                          axis_name: str, impl: str) -> tuple[jax.Array, jax.Array]:
    """As `ragged_ep_local`, with the turbo_moe kernels for sorting, GEMMs and the weighted sum."""
    from turbo_moe import ops

    t, _ = tokens.shape
    k = expert_ids.shape[1]
    n_ranks = jax.lax.axis_size(axis_name)
    n_local = w_local.n_experts
    x_sorted, expert_sizes, handle = ops.permute(tokens, expert_ids, n_experts)  # (T*k, D), (E,)

    plan, recv_counts = exchange_plan(expert_sizes, axis_name)
    n_recv = n_ranks * t * k
    received = ragged_exchange(x_sorted, plan, n_recv, axis_name, impl)  # (n_recv, D)

    local_expert = received_local_expert(recv_counts, n_recv)  # El (out of range -> dropped) for padding
    x_grouped, group_sizes, local_handle = ops.permute(received, local_expert[:, None], n_local)
    h = ops.grouped_gemm(x_grouped, w_local.w_gate_up, group_sizes)  # (n_recv, 2F)
    out_grouped = ops.grouped_gemm(swiglu_fused(h), w_local.w_down, group_sizes)  # (n_recv, D)
    ones = jnp.ones((n_recv, 1), jnp.float32)
    out_recv = ops.unpermute(out_grouped, local_handle, _like(ones, out_grouped))  # (n_recv, D)

    returned = ragged_exchange(out_recv, plan.reversed(), t * k, axis_name, impl)  # (T*k, D) expert order
    y = ops.unpermute(returned, handle, combine_w)  # (T, D)
    return y, group_sizes.sum()


def _like(a, ref):
    """`a` typed as varying over the same mesh axes as `ref` (FFI operands share one vma type)."""
    from turbo_moe.ops._ffi import make_varying, varying_axes

    return make_varying(a, varying_axes(ref))
