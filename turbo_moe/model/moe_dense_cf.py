"""`dense_cf` MoE path: MaxText `dense_matmul` semantics with a per-sequence expert capacity.

Each sequence gives every expert `capacity` slots. Token copies claim slots in order (token t's j-th
choice sits at position t*k + j of the sequence's flattened choices); copies past the capacity are
dropped and contribute nothing. Tokens are dispatched to (E, B, C, D) with one-hot einsums, the experts
run as batched dense matmuls, and a weighted one-hot einsum combines them back.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from turbo_moe.model.experts import ExpertStats, ExpertWeights, routed_load, swiglu_fused
from turbo_moe.model.router import Routing


def expert_capacity(seq_len: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """MaxText: int(max(ceil(seq_len * k / E) * cf, cf)) slots per expert per sequence."""
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0 for a capacity, got {capacity_factor}")
    return int(max(math.ceil(seq_len * top_k / n_experts) * capacity_factor, capacity_factor))


def dispatch_masks(expert_ids: jax.Array, n_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """kept (B, S, k, E) int32 one-hot of copies that fit; position (B, S, E) 1-based slot, 0 = none."""
    b, s, k = expert_ids.shape
    expert_mask = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.int32)  # (B, S, k, E)
    # Running count per expert over the sequence's choices in (token, choice) order.
    count = jnp.cumsum(expert_mask.reshape(b, s * k, n_experts), axis=1).reshape(b, s, k, n_experts)
    kept = expert_mask * (count <= capacity)  # (B, S, k, E)
    position = jnp.sum(kept * count, axis=2)  # (B, S, E)
    return kept, position


def dense_cf_experts(
    x: jax.Array, routing: Routing, weights: ExpertWeights, *, capacity_factor: float
) -> tuple[jax.Array, ExpertStats]:
    """x (B, S, D) compute dtype -> (y (B, S, D), stats). `capacity_factor <= 0`: every expert, no drops."""
    b, s, _ = x.shape
    k = routing.expert_ids.shape[-1]
    n_experts = weights.n_experts
    w = weights.astype(x.dtype)
    load = routed_load(routing.expert_ids, n_experts)
    choice = jax.nn.one_hot(routing.expert_ids, n_experts, dtype=jnp.float32)  # (B, S, k, E)
    gate = jnp.sum(choice * routing.weights[..., None], axis=2)  # (B, S, E) float32, 0 if not chosen

    if capacity_factor <= 0:
        h = jnp.einsum("bsd,edf->bsef", x, w.w_gate_up)  # (B, S, E, 2F)
        out = jnp.einsum("bsef,efd->bsed", swiglu_fused(h), w.w_down)  # (B, S, E, D)
        y = jnp.einsum("bsed,bse->bsd", out.astype(jnp.float32), gate)
        return y.astype(x.dtype), ExpertStats(load, jnp.zeros((), jnp.float32))

    capacity = expert_capacity(s, k, n_experts, capacity_factor)
    kept, position = dispatch_masks(routing.expert_ids, n_experts, capacity)
    dispatch = jax.nn.one_hot(position, capacity + 1, dtype=x.dtype)[..., 1:]  # (B, S, E, C); slot 0 = none
    combine = gate[..., None] * dispatch.astype(jnp.float32)  # (B, S, E, C) float32

    x_dispatched = jnp.einsum("bsd,bsec->ebcd", x, dispatch)  # (E, B, C, D)
    h = jnp.einsum("ebcd,edf->ebcf", x_dispatched, w.w_gate_up)  # (E, B, C, 2F)
    out = jnp.einsum("ebcf,efd->ebcd", swiglu_fused(h), w.w_down)  # (E, B, C, D)
    y = jnp.einsum("ebcd,bsec->bsd", out.astype(jnp.float32), combine)  # (B, S, D) float32

    dropped = 1.0 - jnp.sum(kept).astype(jnp.float32) / (b * s * k)
    return y.astype(x.dtype), ExpertStats(load, dropped)
