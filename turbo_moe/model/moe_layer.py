"""MoE feed-forward: shared experts + routed experts through the configured path (`paths.PATHS`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
from flax import nnx

from turbo_moe.model.capacity import drop_overflow
from turbo_moe.model.config import ModelConfig
from turbo_moe.model.expert_parallel import data_parallel_moe_path, ep_moe_path, expert_axis_size, mesh_device_count
from turbo_moe.model.experts import RoutedExperts
from turbo_moe.model.layers import SwiGLU
from turbo_moe.model.paths import moe_path_fn
from turbo_moe.model.router import Router, sequence_balance_loss


class LayerStats(NamedTuple):
    expert_load: jax.Array  # (E,) float32
    dropped_fraction: jax.Array  # () float32
    balance_loss: jax.Array  # () float32, sequence-wise, without its weight


class MoELayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.router = Router(cfg, rngs)
        self.experts = RoutedExperts(cfg, rngs)
        self.shared = SwiGLU(cfg, cfg.n_shared_experts * cfg.moe_ffn_dim, rngs) if cfg.n_shared_experts else None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, LayerStats]:
        """x (B, S, D) -> (y (B, S, D), per-layer stats)."""
        # Named scopes label the compiled ops for profiles (benchmarks/step_breakdown.py).
        with jax.named_scope("router"):
            routing = self.router(x)
            routing, capacity_dropped = drop_overflow(routing, self.cfg)  # None: the path's own drops
        path = moe_path_fn(self.cfg.moe_path, self.cfg.capacity_factor)
        if expert_axis_size() > 1:  # traced under a mesh with an "expert" axis: routed experts split over it
            path = ep_moe_path(self.cfg.moe_path, capacity_factor=self.cfg.capacity_factor,
                               ep_exchange=self.cfg.ep_exchange, ep_capacity_factor=self.cfg.ep_capacity_factor,
                               ep_layout=self.cfg.ep_layout)
        elif mesh_device_count() > 1:  # data parallel: each device runs its own tokens
            path = data_parallel_moe_path(path)
        with jax.named_scope("routed_experts"):
            y, stats = path(x, routing, self.experts.weights())
        if self.shared is not None:
            with jax.named_scope("shared_expert"):
                y = y + self.shared(x)
        with jax.named_scope("router"):
            balance = sequence_balance_loss(routing.scores, routing.expert_ids, self.cfg.n_experts)
        dropped = stats.dropped_fraction if capacity_dropped is None else capacity_dropped
        return y, LayerStats(stats.expert_load, dropped, balance)
