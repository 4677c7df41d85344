"""DeepSeek-V3-style decoder: MLA + (dense | MoE) blocks, optional multi-token prediction, LM loss.

Read bottom-up: DecoderBlock -> MTPModule -> DeepSeekModel -> lm_loss / update_router_bias.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from turbo_moe.model.config import ModelConfig
from turbo_moe.model.layers import MLAttention, RMSNorm, SwiGLU, compute_dtype, linear, rope_tables
from turbo_moe.model.moe_layer import LayerStats, MoELayer
from turbo_moe.model.router import Router, updated_bias

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class MoEStats(NamedTuple):
    expert_load: jax.Array  # (L_moe, E) float32 token copies per expert, main MoE layers then MTP ones
    dropped_fraction: jax.Array  # () float32, mean over MoE layers
    balance_loss: jax.Array  # () float32, sum over MoE layers of the sequence-wise balance loss


class ModelOutput(NamedTuple):
    logits: jax.Array  # (B, S, V) float32; position i predicts token i+1
    mtp_logits: tuple  # D arrays (B, S, V) float32; depth d at position i predicts token i+d+1
    moe: MoEStats


class DecoderBlock(nnx.Module):
    """Pre-norm block: x + MLA(norm(x)), then x + FFN(norm(x)), FFN dense SwiGLU or MoE."""

    def __init__(self, cfg: ModelConfig, layer_index: int, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg)
        self.attn = MLAttention(cfg, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg)
        self.is_moe = cfg.is_moe_layer(layer_index)
        self.ffn = MoELayer(cfg, rngs) if self.is_moe else SwiGLU(cfg, cfg.dense_ffn_dim, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, LayerStats | None]:
        x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, S, D)
        if self.is_moe:
            y, stats = self.ffn(self.ffn_norm(x))
            return x + y, stats
        return x + self.ffn(self.ffn_norm(x)), None


def _run_block(block: DecoderBlock, x: jax.Array, cos: jax.Array, sin: jax.Array):
    return block(x, cos, sin)


def apply_block(cfg: ModelConfig, block: DecoderBlock, x, cos, sin):
    """Run a block, rematerialised per `cfg.remat_policy`."""
    if cfg.remat_policy == "none":
        return block(x, cos, sin)
    return nnx.remat(_run_block, policy=REMAT_POLICIES[cfg.remat_policy])(block, x, cos, sin)


class MTPModule(nnx.Module):
    """One multi-token-prediction depth (DeepSeek-V3 Sec. 2.2).

    h' = W [RMSNorm(h_prev); RMSNorm(Emb(t_{i+d}))], then one decoder block and its own final norm;
    the embedding and output head are shared with the main model.
    """

    def __init__(self, cfg: ModelConfig, depth: int, rngs: nnx.Rngs):
        self.hidden_norm = RMSNorm(cfg.d_model, cfg)
        self.embed_norm = RMSNorm(cfg.d_model, cfg)
        self.proj = linear(cfg, 2 * cfg.d_model, cfg.d_model, rngs)
        self.block = DecoderBlock(cfg, cfg.n_layers + depth - 1, rngs)
        self.final_norm = RMSNorm(cfg.d_model, cfg)


def _stack_stats(stats: list[LayerStats], n_experts: int) -> MoEStats:
    if not stats:
        zero = jnp.zeros((), jnp.float32)
        return MoEStats(jnp.zeros((0, n_experts), jnp.float32), zero, zero)
    return MoEStats(
        expert_load=jnp.stack([s.expert_load for s in stats]),
        dropped_fraction=jnp.mean(jnp.stack([s.dropped_fraction for s in stats])),
        balance_loss=jnp.sum(jnp.stack([s.balance_loss for s in stats])),
    )


class DeepSeekModel(nnx.Module):
    """Embedding -> n_layers DecoderBlocks (first n_dense_layers dense, rest MoE) -> RMSNorm -> head,
    plus `mtp_depth` MTP modules chained on the final hidden state. Params float32, compute cfg.dtype."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=compute_dtype(cfg),
                               param_dtype=jnp.dtype(cfg.param_dtype),
                               embedding_init=nnx.initializers.normal(cfg.embedding_std), rngs=rngs)
        self.layers = nnx.List([DecoderBlock(cfg, i, rngs) for i in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg)
        self.head = None if cfg.tie_embeddings else linear(
            cfg, cfg.d_model, cfg.vocab_size, rngs, preferred_element_type=jnp.float32)
        self.mtp = nnx.List([MTPModule(cfg, d + 1, rngs) for d in range(cfg.mtp_depth)])

    def logits(self, h: jax.Array) -> jax.Array:
        """Normalised hidden (B, S, D) -> float32 logits (B, S, V) through the (shared) output head."""
        if self.head is None:
            return jnp.einsum("bsd,vd->bsv", h, self.embed.embedding[...].astype(h.dtype),
                              preferred_element_type=jnp.float32)
        return self.head(h).astype(jnp.float32)

    def __call__(self, inputs: jax.Array, targets: jax.Array | None = None) -> ModelOutput:
        """inputs (B, S) int32 -> ModelOutput. `targets` (B, S), if given, supplies the token after the
        last input, which the MTP modules read as a future token."""
        cfg = self.cfg
        if inputs.ndim != 2 or not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"inputs must be integer (B, S), got {inputs.dtype}{tuple(inputs.shape)}")
        b, s = inputs.shape
        if s > cfg.max_seq_len:
            raise ValueError(f"inputs: sequence length {s} > ModelConfig.max_seq_len={cfg.max_seq_len}")
        cos, sin = rope_tables(s, cfg.qk_rope_head_dim, cfg.rope_theta)  # (S, R/2) each

        h = self.embed(inputs)  # (B, S, D)
        stats: list[LayerStats] = []
        for block in self.layers:
            h, layer_stats = apply_block(cfg, block, h, cos, sin)
            if layer_stats is not None:
                stats.append(layer_stats)
        logits = self.logits(self.final_norm(h))

        stream = inputs if targets is None else jnp.concatenate([inputs, targets[:, -1:]], axis=1)
        mtp_logits = []
        for depth, module in enumerate(self.mtp, start=1):
            ahead = _shift_left(stream, depth)[:, :s]  # (B, S): token i+depth (0 past the end)
            merged = jnp.concatenate([module.hidden_norm(h), module.embed_norm(self.embed(ahead))], axis=-1)
            h, layer_stats = apply_block(cfg, module.block, module.proj(merged), cos, sin)
            if layer_stats is not None:
                stats.append(layer_stats)
            mtp_logits.append(self.logits(module.final_norm(h)))
        return ModelOutput(logits, tuple(mtp_logits), _stack_stats(stats, cfg.n_experts))

    def routers(self) -> list[Router]:
        """Routers in `MoEStats.expert_load` row order: main MoE layers, then MTP blocks."""
        blocks = list(self.layers) + [m.block for m in self.mtp]
        return [blk.ffn.router for blk in blocks if blk.is_moe]


def _shift_left(tokens: jax.Array, n: int) -> jax.Array:
    """(B, L) -> (B, L): tokens[:, i + n], zero-padded at the end."""
    return jnp.pad(tokens[:, n:], ((0, 0), (0, min(n, tokens.shape[1]))))


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean token cross-entropy over mask; logits (B, S, V) float32, targets/mask (B, S)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]  # (B, S)
    mask = mask.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def lm_loss(model: DeepSeekModel, batch: dict) -> tuple[jax.Array, dict]:
    """Cross-entropy + mtp_loss_weight * mean MTP loss + balance_loss_weight * balance loss.

    batch: {"inputs": (B, S) int32, "targets": (B, S) int32, optional "mask": (B, S) 0/1}.
    MTP depth d at position i predicts targets[i + d]; positions without that target are masked.
    """
    for key in ("inputs", "targets"):
        if key not in batch:
            raise ValueError(f"batch is missing {key!r}; expected keys 'inputs' and 'targets'")
    cfg = model.cfg
    inputs, targets = batch["inputs"], batch["targets"]
    if targets.shape != inputs.shape:
        raise ValueError(f"batch['targets'] shape {targets.shape} != batch['inputs'] shape {inputs.shape}")
    mask = batch.get("mask", jnp.ones(targets.shape, jnp.float32))
    out = model(inputs, targets)
    ce = cross_entropy(out.logits, targets, mask)

    mtp_terms = []
    for depth, logits in enumerate(out.mtp_logits, start=1):
        mtp_mask = _shift_left(mask, depth)  # (B, S): 0 where token i+depth does not exist
        mtp_terms.append(cross_entropy(logits, _shift_left(targets, depth), mtp_mask))
    mtp = jnp.mean(jnp.stack(mtp_terms)) if mtp_terms else jnp.zeros((), jnp.float32)

    loss = ce + cfg.mtp_loss_weight * mtp + cfg.balance_loss_weight * out.moe.balance_loss
    load = out.moe.expert_load  # (L_moe, E)
    max_over_mean = (jnp.mean(jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9))
                     if load.shape[0] else jnp.ones((), jnp.float32))
    metrics = {
        "loss": loss, "ce_loss": ce, "mtp_loss": mtp, "balance_loss": out.moe.balance_loss,
        "dropped_fraction": out.moe.dropped_fraction, "load_max_over_mean": max_over_mean,
        "expert_load": load,
    }
    return loss, metrics


def update_router_bias(model: DeepSeekModel, expert_load: jax.Array, rate: float | None = None) -> None:
    """Aux-loss-free balancing, in place: b_i += rate * sign(mean load - load_i) for each MoE layer.

    expert_load (L_moe, E) as in `MoEStats.expert_load`; rate defaults to cfg.router_bias_rate.
    Call outside the gradient (after the optimizer step).
    """
    routers = model.routers()
    rate = model.cfg.router_bias_rate if rate is None else rate
    if expert_load.shape != (len(routers), model.cfg.n_experts):
        raise ValueError(f"expert_load shape {tuple(expert_load.shape)} != (L_moe, E) = "
                         f"{(len(routers), model.cfg.n_experts)}")
    for router, load in zip(routers, expert_load):
        router.bias[...] = updated_bias(router.bias[...], load, rate)
