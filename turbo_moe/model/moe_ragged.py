"""`ragged` MoE path: dropless, pure JAX (MaxText `sparse_matmul` without megablox).

Token copies are sorted by expert, the expert GEMMs run as `jax.lax.ragged_dot` over contiguous
per-expert row groups, and the outputs are unsorted and summed with the routing weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.model.experts import ExpertStats, ExpertWeights, swiglu_fused
from turbo_moe.model.router import Routing


def ragged_experts(x: jax.Array, routing: Routing, weights: ExpertWeights) -> tuple[jax.Array, ExpertStats]:
    """x (B, S, D) compute dtype -> (y (B, S, D), stats); no token is dropped."""
    b, s, d = x.shape
    k = routing.expert_ids.shape[-1]
    n_experts = weights.n_experts
    w = weights.astype(x.dtype)
    tokens = x.reshape(b * s, d)  # (T, D)
    flat_ids = routing.expert_ids.reshape(-1)  # (T*k,) copy c = token c // k, choice c % k

    order = jnp.argsort(flat_ids, stable=True)  # (T*k,) copies grouped by expert
    x_sorted = tokens[order // k]  # (T*k, D)
    group_sizes = jnp.bincount(flat_ids, length=n_experts).astype(jnp.int32)  # (E,)

    h = jax.lax.ragged_dot(x_sorted, w.w_gate_up, group_sizes)  # (T*k, 2F)
    out_sorted = jax.lax.ragged_dot(swiglu_fused(h), w.w_down, group_sizes)  # (T*k, D)

    inverse = jnp.argsort(order)  # sorted row of each copy
    out = out_sorted[inverse].reshape(b * s, k, d).astype(jnp.float32)  # (T, k, D)
    y = jnp.einsum("tkd,tk->td", out, routing.weights.reshape(b * s, k))  # (T, D) float32
    stats = ExpertStats(group_sizes.astype(jnp.float32), jnp.zeros((), jnp.float32))
    return y.reshape(b, s, d).astype(x.dtype), stats
