"""dense_cf's token dropping on a dropless path: the same (token, choice) pairs dropped, at that path's speed.

dense_cf (`exchanges.capacity_exchange`) gives every expert C = `expert_capacity(S, k, E, cf)` slots per
sequence of S tokens; the copies of a sequence claim them in (token, choice) order and those past C
contribute nothing to the output, to the loss or to any gradient. Here the same pairs are found with
dense_cf's own `dispatch_masks` and their combine weights set to 0 before the exchange: the dropless
path still computes them (its cost is unchanged) but they add 0 to the output, and the gradients of
their weights and of their expert computations are 0, as in dense_cf. The router's gradient is dense_cf's
too: the weights are normalised over all k picks before the drop, in both.

Asked for with `ModelConfig.drop_tokens` on a dropless path (turbo, ragged, pallas): it drops what dense_cf
at `capacity_factor` drops. Without it (the default) those paths ignore `capacity_factor` and drop nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.model.config import ModelConfig
from turbo_moe.model.exchanges import dispatch_masks, expert_capacity
from turbo_moe.model.router import Routing

CAPACITY_PATH = "dense_cf"  # the path whose drops are reproduced (its exchange is the capacity one)


def drop_capacity_factor(cfg: ModelConfig) -> float | None:
    """The capacity factor whose dense_cf drops this dropless path reproduces, or None: it drops nothing."""
    if cfg.moe_path == CAPACITY_PATH or not cfg.drop_tokens:
        return None
    return float(cfg.capacity_factor)


def regime(cfg: ModelConfig) -> str:
    """What a run's MoE layers do with overflowing copies, in words for records and figure labels."""
    if cfg.moe_path == CAPACITY_PATH:
        return f"drops at cf={cfg.capacity_factor:g}" if cfg.capacity_factor > 0 else "dense (no drops)"
    cf = drop_capacity_factor(cfg)
    return "dropless" if cf is None else f"drops as dense_cf at cf={cf:g}"


def kept_pairs(expert_ids: jax.Array, n_experts: int, capacity_factor: float) -> jax.Array:
    """(B, S, k) bool: the (token, choice) pairs that dense_cf at `capacity_factor` keeps, for expert_ids (B, S, k)
    routed per sequence of S tokens."""
    _, s, k = expert_ids.shape
    capacity = expert_capacity(s, k, n_experts, capacity_factor)
    kept, _ = dispatch_masks(expert_ids, n_experts, capacity)  # (B, S, k, E) one-hot of the kept copies
    return kept.sum(-1) > 0


def drop_overflow(routing: Routing, cfg: ModelConfig) -> tuple[Routing, jax.Array | None]:
    """Routing with the combine weights of dense_cf's dropped pairs set to 0, and the dropped fraction () float32
    as dense_cf reports it (1 - kept / (B S k)); (routing, None) when the path is dropless."""
    cf = drop_capacity_factor(cfg)
    if cf is None:
        return routing, None
    if routing.expert_ids.ndim != 3:
        raise ValueError(f"drop_tokens (dense_cf's drops at {cfg.capacity_factor} on {cfg.moe_path!r}) needs routing "
                         f"per sequence, expert_ids (batch, seq, k); got shape {routing.expert_ids.shape}")
    kept = jax.lax.stop_gradient(kept_pairs(routing.expert_ids, cfg.n_experts, cf))
    weights = jnp.where(kept, routing.weights, 0.0)  # a dropped pair: no output, no gradient
    dropped = 1.0 - kept.sum(dtype=jnp.float32) / kept.size
    return routing._replace(weights=weights), dropped
