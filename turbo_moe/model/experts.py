"""Routed-expert weights and the interface shared by the MoE paths (the FFN itself is `ops.expert_ffn`).

A MoE path (built from its row of `turbo_moe.model.paths.PATHS`) is a pure function
    path(x (B, S, D), routing: Routing, weights: ExpertWeights) -> (y (B, S, D), ExpertStats)
returning the weighted sum of the routed experts' outputs (shared experts not included). Expert weights
keep the expert axis E leading so a later shard_map can split it over an `expert` mesh axis.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from turbo_moe.model.config import ModelConfig
from turbo_moe.model.normal_init import normal
from turbo_moe.model.sharding import EXPERT_AXIS


class ExpertWeights(NamedTuple):
    # Each an array or, on the FP8 path, `ops.fp8_weights` of it (quantised once per step for all layers).
    w_gate_up: jax.Array  # (E, D, 2F): gate and up projections fused along the output dim
    w_down: jax.Array  # (E, F, D)

    @property
    def n_experts(self) -> int:
        return self.w_gate_up.shape[0]

    def astype(self, dtype) -> "ExpertWeights":
        return ExpertWeights(self.w_gate_up.astype(dtype), self.w_down.astype(dtype))


class ExpertStats(NamedTuple):
    expert_load: jax.Array  # (E,) float32: token copies routed to each expert (before any dropping)
    dropped_fraction: jax.Array  # () float32: fraction of token copies dropped (0 for dropless paths)


def routed_load(expert_ids: jax.Array, n_experts: int) -> jax.Array:
    """(E,) float32 count of token copies per expert (ids outside [0, E) count for none).

    A row reduction of an (E, T*k) one-hot that XLA never materialises: one block per expert reads the ids from L2.
    The scatter-add it replaces sent T*k atomic adds to E addresses, which serialise."""
    ids = expert_ids.reshape(1, -1)
    experts = jnp.arange(n_experts, dtype=ids.dtype)[:, None]
    return jnp.sum(ids == experts, axis=1, dtype=jnp.float32)


class RoutedExperts(nnx.Module):
    """The E routed SwiGLU experts' parameters (fused gate+up, down)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        init = normal(cfg.init_std)
        e, d, f = cfg.n_experts, cfg.d_model, cfg.moe_ffn_dim
        dtype = jnp.dtype(cfg.param_dtype)
        # The expert dim is declared for sharding (turbo_moe.model.sharding): split over "expert".
        axes = (EXPERT_AXIS, None, None)
        self.w_gate_up = nnx.Param(init(rngs.params(), (e, d, 2 * f), dtype), logical_axes=axes)  # (E, D, 2F)
        w_down = init(rngs.params(), (e, f, d), dtype)  # drawn either way: the other parameters do not change
        if cfg.router.zero_init_out_proj:
            w_down = jnp.zeros_like(w_down)
        self.w_down = nnx.Param(w_down, logical_axes=axes)  # (E, F, D)

    def weights(self) -> ExpertWeights:
        # get_value, not [...]: a layer stack may have replaced the values by `ops.fp8_weights` pytrees
        # (`stack.quantize_stacked_experts`), which cannot be indexed
        return ExpertWeights(self.w_gate_up.get_value(), self.w_down.get_value())
