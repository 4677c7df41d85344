"""DeepSeek-V3 router: sigmoid scores, group-limited top-k, auxiliary-loss-free bias, balance loss.

Selection uses `score + bias` (bias only steers which experts are picked); the combine weights are the
plain sigmoid scores of the picked experts, normalised to sum to 1 and multiplied by
`routed_scaling_factor`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jax.ad_checkpoint import checkpoint_name

from turbo_moe.model.config import ModelConfig
from turbo_moe.model.normal_init import normal
from turbo_moe.model.mesh import batch_sharded
from turbo_moe.ops.router_topk import SEQ_LOAD_PRIOR_TOKENS, router_topk


# The name of the router's picks (expert ids) for the remat policies (model/stack.py).
ROUTER_SAVE_NAME = "moe_router_expert_ids"


class RouterBias(nnx.Variable):
    """Per-expert selection bias. Not an nnx.Param: the optimizer skips it; `update_router_bias` sets it."""


class Routing(NamedTuple):
    """Router output for tokens (..., D). All float32 except the ids."""

    expert_ids: jax.Array  # (..., k) int32, experts chosen per token
    weights: jax.Array  # (..., k) float32, combine weights (normalised, scaled)
    scores: jax.Array  # (..., E) float32, sigmoid affinities (no bias), for the balance loss


def group_limited_topk(
    scores: jax.Array, bias: jax.Array, *, top_k: int, n_groups: int, topk_groups: int
) -> jax.Array:
    """Expert ids (..., k) int32: top-k of `scores + bias` restricted to the best `topk_groups` groups.

    A group's score is the sum of its two best biased scores (its best one when a group holds one
    expert), as in DeepSeek-V3. Ties break toward the lower index (jax.lax.top_k).
    """
    n_experts = scores.shape[-1]
    per_group = n_experts // n_groups
    biased = scores + bias  # (..., E)
    if n_groups > 1:
        grouped = biased.reshape(*biased.shape[:-1], n_groups, per_group)  # (..., G, E/G)
        group_score = jax.lax.top_k(grouped, min(2, per_group))[0].sum(-1)  # (..., G)
        _, keep_groups = jax.lax.top_k(group_score, topk_groups)  # (..., topk_groups)
        group_mask = jnp.any(jax.nn.one_hot(keep_groups, n_groups, dtype=bool), axis=-2)  # (..., G)
        masked = jnp.where(group_mask[..., None], grouped, -jnp.inf)
        biased = masked.reshape(biased.shape)
    _, expert_ids = jax.lax.top_k(biased, top_k)
    return expert_ids.astype(jnp.int32)


def _top_mask(values: jax.Array, k: int) -> jax.Array:
    """(..., n) bool: the k largest along the last axis, ties toward the lower index (jax.lax.top_k's set),
    from pairwise comparisons: elementwise work and one reduction that XLA fuses into one kernel, no sort."""
    n = values.shape[-1]
    index = jnp.arange(n)
    mine, other = values[..., :, None], values[..., None, :]
    ahead = (other > mine) | ((other == mine) & (index[None, :] < index[:, None]))  # (..., n, n)
    return ahead.sum(-1) < k


def group_limited_topk_mask(
    scores: jax.Array, bias: jax.Array, *, top_k: int, n_groups: int, topk_groups: int
) -> jax.Array:
    """(..., E) bool: the experts `group_limited_topk` picks (the same set, ties included), without a sort:
    the sequence load penalty's chunk loop runs it once per chunk, where top-k kernels dominated the cost."""
    n_experts = scores.shape[-1]
    per_group = n_experts // n_groups
    biased = scores + bias
    if n_groups > 1:
        grouped = biased.reshape(*biased.shape[:-1], n_groups, per_group)
        group_score = jnp.where(_top_mask(grouped, min(2, per_group)), grouped, 0.0).sum(-1)  # the best two
        keep = _top_mask(group_score, topk_groups)
        biased = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(biased.shape)
    return _top_mask(biased, top_k)


def route(scores: jax.Array, bias: jax.Array, cfg: ModelConfig, selection: jax.Array | None = None,
          expert_ids: jax.Array | None = None) -> Routing:
    """Pure routing from sigmoid scores (..., E) float32 and bias (E,). `selection` (..., E), if given,
    replaces `scores` in the top-k choice only (the combine weights are always the picked `scores`).
    `expert_ids` (..., k), if given, are the picks already made (`kernel_expert_ids`)."""
    if expert_ids is None:
        select = scores if selection is None else jax.lax.stop_gradient(selection)
        expert_ids = group_limited_topk(
            select, jax.lax.stop_gradient(bias), top_k=cfg.top_k, n_groups=cfg.n_groups,
            topk_groups=cfg.topk_groups)
    # Named so that the remat policy "dots_experts_attention" keeps the picks: the backward pass then needs none
    # of the selection (centering, the penalty's chunk walk, top-k) again. The barrier: see experts._named.
    expert_ids = checkpoint_name(jax.lax.optimization_barrier(expert_ids), ROUTER_SAVE_NAME)
    picked = jnp.take_along_axis(scores, expert_ids, axis=-1)  # (..., k)
    weights = picked / (picked.sum(-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    return Routing(expert_ids=expert_ids, weights=weights, scores=scores)


def causal_centered_selection(logits: jax.Array) -> jax.Array:
    """Selection scores sigmoid(l_t - mean_{s<=t} l_s) (stop-gradient) from gate logits (B, S, E): each
    token's logits minus the running mean of its sequence up to and including itself. A vector added to
    every token of a sequence shifts all its logits alike and leaves the selection unchanged."""
    if logits.ndim != 3:
        raise ValueError(f"the router recipe's causal centering needs the router input as (batch, seq, d_model); "
                         f"got logits of shape {logits.shape}")
    logits = jax.lax.stop_gradient(logits)
    count = jnp.arange(1, logits.shape[1] + 1, dtype=jnp.float32)[None, :, None]
    return jax.nn.sigmoid(logits - jnp.cumsum(logits, axis=1) / count)


# SEQ_LOAD_PRIOR_TOKENS (imported from turbo_moe.ops.router_topk, its owner): pseudo-tokens at the fair share
# that every sequence's counts start with (`seq_load_penalized_selection`), so that the first chunk's picks do
# not read as a large share of a short past.


def _needs_sequence_axis(selection: jax.Array) -> None:
    if selection.ndim != 3:
        raise ValueError(f"the router recipe's sequence load penalty needs the router input as (batch, seq, "
                         f"d_model); got selection scores of shape {selection.shape}")


def seq_load_penalized_selection(selection: jax.Array, bias: jax.Array, cfg: ModelConfig, penalty: float,
                                 chunk: int) -> jax.Array:
    """Selection scores (B, S, E) with the causal sequence load penalty (`penalty`: the router recipe's
    seq_load_penalty; the model's top-k settings from `cfg`).

    The sequence runs through group-limited top-k (on ``selection + bias``) chunk by chunk, C = `chunk`
    tokens at a time (the recipe's seq_load_chunk). For a token of chunk j, share_e = (picks of e by chunks < j +
    P k/E) / ((tokens in chunks < j + P) k/E), P = SEQ_LOAD_PRIOR_TOKENS (1: the fair share), and its selection
    becomes selection - penalty * max(share_e - 1, 0). Past chunks only: causal; stop-gradient. The counts are
    the picks made *with* the penalty, which is what splits tokens that look alike over the chunks.
    """
    _needs_sequence_axis(selection)
    selection = jax.lax.stop_gradient(selection).astype(jnp.float32)
    bias = jax.lax.stop_gradient(bias)
    b, seq, n_experts = selection.shape
    chunk = min(chunk, seq)
    fair = cfg.top_k / n_experts
    counts = jnp.zeros((b, n_experts), jnp.float32)  # picks by the earlier chunks of each sequence
    out = []
    # A Python loop, not lax.scan: the chunks' ops stay plain equations that the backward pass, which needs
    # none of them, drops under remat; a scan was run again there.
    for start in range(0, seq, chunk):
        share = (counts + fair * SEQ_LOAD_PRIOR_TOKENS) / ((start + SEQ_LOAD_PRIOR_TOKENS) * fair)
        sel = selection[:, start:start + chunk] - penalty * jnp.maximum(share - 1.0, 0.0)[:, None]
        out.append(sel)
        if start + chunk < seq:
            picks = group_limited_topk_mask(sel, bias, top_k=cfg.top_k, n_groups=cfg.n_groups,
                                            topk_groups=cfg.topk_groups)
            counts = counts + picks.sum(1, dtype=jnp.float32)
    return jnp.concatenate(out, axis=1)


def topk_kernel_on(platform: str) -> bool:
    """Who picks the experts: the router_topk kernel on GPUs (one FFI call, the sequence load penalty fused in),
    jnp elsewhere (the kernel's speed-up was measured on GPUs only). Both make the same picks with the same combine
    weights (tests/model/test_router_seq_load_penalty.py), so the choice is the device's, not the user's."""
    return platform == "gpu"


def topk_kernel_here() -> bool:
    """`topk_kernel_on` JAX's default backend (tests replace this to run the other side)."""
    return topk_kernel_on(jax.default_backend())


def kernel_expert_ids(selection: jax.Array, bias: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Expert ids (..., k) int32 from the router_topk kernel (`topk_kernel_here`, or a test): the picks of
    `group_limited_topk` on `selection` (..., E), or with the sequence load penalty on
    `seq_load_penalized_selection(selection)` ((B, S, E) then), in one call."""
    penalty, chunk = float(cfg.router.seq_load_penalty), cfg.router.seq_load_chunk
    if penalty > 0:
        _needs_sequence_axis(selection)

    def local(selection, bias):
        rows = selection.reshape(1, -1, selection.shape[-1]) if penalty == 0 else selection  # no sequence axis needed
        ids = router_topk(rows.astype(jnp.float32), bias.astype(jnp.float32), top_k=cfg.top_k, n_groups=cfg.n_groups,
                          topk_groups=cfg.topk_groups, penalty=penalty, chunk=chunk)
        return ids.reshape(*selection.shape[:-1], cfg.top_k)

    # Each device picks for its own sequences (they are independent) rather than all of them.
    return batch_sharded(local)(jax.lax.stop_gradient(selection), jax.lax.stop_gradient(bias))


class Router(nnx.Module):
    """Gate projection (D -> E, float32 operands and sums; TF32 products on GPUs) + the selection bias."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        # Stored as gate / lr_scale (see RouterRecipe.lr_scale); `gate()` is the effective one.
        init = normal(cfg.router_std / cfg.router.lr_scale)
        self.kernel = nnx.Param(init(rngs.params(), (cfg.d_model, cfg.n_experts), jnp.dtype(cfg.param_dtype)))
        self.bias = RouterBias(jnp.zeros((cfg.n_experts,), jnp.float32))

    def gate(self) -> jax.Array:
        """(D, E) float32 effective gate kernel."""
        return self.kernel[...].astype(jnp.float32) * self.cfg.router.lr_scale

    def __call__(self, x: jax.Array) -> Routing:
        # The gate's arithmetic is float32: small score differences decide the routing. On NVIDIA GPUs XLA's DEFAULT
        # precision multiplies float32 operands in TF32 (10 mantissa bits): x, cast from bf16, is exact there, the gate
        # kernel is rounded, the sums stay float32; on the CPU float32 throughout.
        gate = self.gate()
        logits = jnp.einsum("...d,de->...e", x.astype(jnp.float32), gate)
        scores = jax.nn.sigmoid(logits)
        recipe = self.cfg.router
        selection = causal_centered_selection(logits) if recipe.center_causal else None
        if topk_kernel_here():
            expert_ids = kernel_expert_ids(scores if selection is None else selection, self.bias[...], self.cfg)
            return route(scores, self.bias[...], self.cfg, expert_ids=expert_ids)
        if recipe.seq_load_penalty > 0:
            selection = seq_load_penalized_selection(scores if selection is None else selection, self.bias[...],
                                                     self.cfg, recipe.seq_load_penalty, recipe.seq_load_chunk)
        return route(scores, self.bias[...], self.cfg, selection)


def sequence_balance_loss(scores: jax.Array, expert_ids: jax.Array, n_experts: int) -> jax.Array:
    """DeepSeek-V3 sequence-wise balance loss sum_i f_i * P_i, averaged over sequences (no alpha).

    scores (B, S, E) float32 sigmoid affinities; expert_ids (B, S, k).
    f_i = E / (k S) * #{tokens of the sequence routed to i};  P_i = mean_t s_{t,i} / sum_j s_{t,j}.
    Equals 1 for perfectly uniform routing and affinities.
    """
    _, s, k = expert_ids.shape
    counts = jax.nn.one_hot(expert_ids, n_experts, dtype=jnp.float32).sum(axis=(1, 2))  # (B, E)
    f = jax.lax.stop_gradient(counts * n_experts / (k * s))
    p = (scores / (scores.sum(-1, keepdims=True) + 1e-20)).mean(axis=1)  # (B, E)
    return jnp.mean(jnp.sum(f * p, axis=-1))


def updated_bias(bias: jax.Array, expert_load: jax.Array, rate, rule: str = "sign") -> jax.Array:
    """Aux-loss-free update (raise under-loaded experts), expert_load (..., E):
    "sign": b_i += rate * sign(mean - load_i) (DeepSeek-V3); "proportional": b_i += rate * (mean - load_i) / mean.
    """
    load = expert_load.astype(jnp.float32)
    mean = load.mean(-1, keepdims=True)
    if rule == "sign":
        return bias + rate * jnp.sign(mean - load)
    if rule == "proportional":
        return bias + rate * (mean - load) / jnp.maximum(mean, 1e-20)
    raise ValueError(f"rule: expected 'sign' or 'proportional', got {rule!r}")


def bias_rate_at(cfg: ModelConfig, step) -> jax.Array:
    """Bias update rate for the update made after optimizer step `step`: `router_bias_rate` throughout
    (DeepSeek-V3 / Megatron-Core / MaxText: one constant rate). `step` is kept for the callers."""
    del step
    return jnp.float32(cfg.router_bias_rate)
