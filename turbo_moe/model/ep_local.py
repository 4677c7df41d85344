"""Per-rank bodies of the `turbo`/deepep and `dense_cf` EP paths (call inside shard_map).

turbo, ep_exchange="deepep" (the blog's `sparse-gmm-deepep`): `moe_dispatch` sends each token once
per destination rank with its local top-k ids/weights -> `permute` by local expert -> grouped GEMMs ->
`unpermute` (weighted sum of the token's local experts: one row per token and rank) -> `moe_combine`.

dense_cf (MaxText `dense_matmul` with EP): per-sequence capacity slots (E, B, C, D) -> all_to_all over
the expert axis (split E, concatenate B) -> the rank's E/P experts over every rank's sequences ->
all_to_all back -> weighted combine. The capacity is per sequence, so the result equals one device's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from turbo_moe.model.experts import ExpertWeights, swiglu_fused
from turbo_moe.model.moe_dense_cf import dispatch_masks, expert_capacity


def turbo_deepep_local(tokens, expert_ids, combine_w, w_local: ExpertWeights, *, n_experts: int, axis_name: str,
                       capacity: int | None) -> tuple[jax.Array, jax.Array]:
    """tokens (T, D), expert_ids (T, k) global, combine_w (T, k) f32, w_local (El, ...) ->
    (y (T, D), copies computed on this rank () int32). capacity: token slots per source rank (None: T)."""
    from turbo_moe import ops

    recv_x, recv_ids, recv_w, handle = ops.moe_dispatch(
        tokens, expert_ids, combine_w, num_experts=n_experts, axis_name=axis_name, capacity=capacity)
    # recv_x (P*C, D): one row per (source token, this rank); recv_ids (P*C, k) local ids, -1 = none.
    x_sorted, group_sizes, handle_local = ops.permute(recv_x, recv_ids, w_local.n_experts)  # (P*C*k, D)
    h = ops.grouped_gemm(x_sorted, w_local.w_gate_up, group_sizes)  # (P*C*k, 2F)
    out_sorted = ops.grouped_gemm(swiglu_fused(h), w_local.w_down, group_sizes)  # (P*C*k, D)
    per_token = ops.unpermute(out_sorted, handle_local, recv_w)  # (P*C, D) local experts reduced
    y = ops.moe_combine(per_token, handle, axis_name=axis_name)  # (T, D)
    return y, group_sizes.sum()


def deepep_capacity(tokens_per_rank: int, capacity_factor: float) -> int | None:
    """Token slots per source rank: None (= T, the worst case) unless a hint 0 < cf < 1 caps them.

    A hint of cf gives ceil(cf * T) slots: every rank can then take at most that share of another
    rank's tokens (cf = 1 is the worst case itself). Overflowing copies are counted as dropped."""
    if capacity_factor <= 0 or capacity_factor >= 1:
        return None
    return max(1, math.ceil(capacity_factor * tokens_per_rank))


def dense_cf_ep_local(x, expert_ids, combine_w, w_local: ExpertWeights, *, n_experts: int, axis_name: str,
                      capacity_factor: float) -> tuple[jax.Array, jax.Array]:
    """x (B, S, D), expert_ids / combine_w (B, S, k) -> (y (B, S, D), kept copies () int32).

    capacity_factor <= 0 (dense on one device) uses C = S slots: no expert gets more than S copies of a
    sequence (top-k picks distinct experts), so nothing drops and the result equals the dense one."""
    b, s, _ = x.shape
    k = expert_ids.shape[-1]
    if capacity_factor > 0:
        capacity = expert_capacity(s, k, n_experts, capacity_factor)
    else:
        capacity = s
    kept, position = dispatch_masks(expert_ids, n_experts, capacity)  # (B, S, k, E), (B, S, E)
    choice = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.float32)  # (B, S, k, E)
    gate = jnp.sum(choice * combine_w[..., None], axis=2)  # (B, S, E)
    dispatch = jax.nn.one_hot(position, capacity + 1, dtype=x.dtype)[..., 1:]  # (B, S, E, C)
    combine = gate[..., None] * dispatch.astype(jnp.float32)  # (B, S, E, C)

    x_dispatched = jnp.einsum("bsd,bsec->ebcd", x, dispatch)  # (E, B, C, D)
    # Experts to their owners: split E over the ranks, gather every rank's sequences on B.
    x_local = jax.lax.all_to_all(x_dispatched, axis_name, 0, 1, tiled=True)  # (E/P, P*B, C, D)
    h = jnp.einsum("ebcd,edf->ebcf", x_local, w_local.w_gate_up)  # (E/P, P*B, C, 2F)
    out_local = jnp.einsum("ebcf,efd->ebcd", swiglu_fused(h), w_local.w_down)  # (E/P, P*B, C, D)
    out = jax.lax.all_to_all(out_local, axis_name, 1, 0, tiled=True)  # (E, B, C, D)
    y = jnp.einsum("ebcd,bsec->bsd", out.astype(jnp.float32), combine)  # (B, S, D)
    return y.astype(x.dtype), jnp.sum(kept)
