"""DeepSeek-V3-style decoder: MLA + (dense | MoE) blocks, optional multi-token prediction, LM loss.

Read bottom-up: (stack.py: DecoderBlock, BlockStack) -> MTPModule -> DeepSeekModel -> lm_loss /
update_router_bias. The dense prefix and the MoE blocks are two BlockStacks (one scan each).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from turbo_moe.model.chunked_loss import chunked_cross_entropy
from turbo_moe.model.config import ModelConfig
from turbo_moe.model.normal_init import normal
from turbo_moe.model.embedding import lookup
from turbo_moe.model.layers import RMSNorm, compute_dtype, linear, rope_tables
from turbo_moe.model.router import RouterBias, updated_bias
from turbo_moe.model.stack import BlockStack, DecoderBlock, StackStats, apply_block, concat_stats


class MoEStats(NamedTuple):
    expert_load: jax.Array  # (L_moe, E) float32 token copies per expert, main MoE layers then MTP ones
    dropped_fraction: jax.Array  # () float32, mean over MoE layers
    balance_loss: jax.Array  # () float32, sum over MoE layers of the sequence-wise balance loss
    dropped_fraction_per_layer: jax.Array  # (L_moe,) float32, same row order as expert_load


class ModelOutput(NamedTuple):
    logits: jax.Array  # (B, S, V) float32; position i predicts token i+1
    mtp_logits: tuple  # D arrays (B, S, V) float32; depth d at position i predicts token i+d+1
    moe: MoEStats


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


class DeepSeekModel(nnx.Module):
    """Embedding -> n_layers DecoderBlocks (first n_dense_layers dense, rest MoE) -> RMSNorm -> head,
    plus `mtp_depth` MTP modules chained on the final hidden state. Params float32, compute cfg.dtype.

    The blocks live in two stacks, `dense_layers` and `moe_layers` (None when empty), each holding its
    blocks' weights on a leading layer axis."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=compute_dtype(cfg),
                               param_dtype=jnp.dtype(cfg.param_dtype),
                               embedding_init=normal(cfg.embedding_std), rngs=rngs)
        n_dense, n_moe = cfg.n_dense_layers, cfg.n_moe_layers
        self.dense_layers = BlockStack(cfg, 0, n_dense, rngs) if n_dense else None
        self.moe_layers = BlockStack(cfg, n_dense, n_moe, rngs) if n_moe else None
        self.final_norm = RMSNorm(cfg.d_model, cfg)
        self.head = linear(cfg, cfg.d_model, cfg.vocab_size, rngs, preferred_element_type=jnp.dtype(cfg.logits_dtype))
        # float32 whatever the param dtype: log-frequencies span ~15 nats, bf16 would round them by ~0.06
        self.head_bias = (None if cfg.router.head_bias == "none"
                          else nnx.Param(jnp.zeros((cfg.vocab_size,), jnp.float32)))
        self.mtp = nnx.List([MTPModule(cfg, d + 1, rngs) for d in range(cfg.mtp_depth)])

    def logits(self, h: jax.Array) -> jax.Array:
        """Normalised hidden (B, S, D) -> float32 logits (B, S, V) through the (shared) output head (the GEMM's
        output in `cfg.logits_dtype`, upcast)."""
        logits = self.head(h).astype(jnp.float32)
        return logits if self.head_bias is None else logits + self.head_bias[...]

    def head_weight(self) -> tuple[jax.Array, bool, jax.Array | None]:
        """The output head's kernel (D, V) in the parameter dtype, whether it is vocab-major (False: chunked_loss
        also takes a (V, D) weight), and its float32 (V,) bias or None. For losses that apply the head themselves."""
        bias = None if self.head_bias is None else self.head_bias[...]
        return self.head.kernel[...], False, bias

    def _embed(self, ids: jax.Array) -> jax.Array:
        """nnx.Embed's lookup (the table cast to the compute dtype) with the configured backward."""
        table = self.embed.embedding[...].astype(self.embed.dtype or self.embed.embedding.dtype)
        return lookup(table, ids)

    def __call__(self, inputs: jax.Array, targets: jax.Array | None = None, *, apply_head: bool = True
                 ) -> ModelOutput:
        """inputs (B, S) int32 -> ModelOutput. `targets` (B, S), if given, supplies the token after the
        last input, which the MTP modules read as a future token. `apply_head=False`: `logits` and
        `mtp_logits` hold the final-normalised hidden states (B, S, D, compute dtype) the head would read
        (for a loss that applies the head itself: `chunked_loss`)."""
        cfg = self.cfg
        head = self.logits if apply_head else (lambda normed: normed)
        if inputs.ndim != 2 or not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError(f"inputs must be integer (B, S), got {inputs.dtype}{tuple(inputs.shape)}")
        b, s = inputs.shape
        if s > cfg.max_seq_len:
            raise ValueError(f"inputs: sequence length {s} > ModelConfig.max_seq_len={cfg.max_seq_len}")
        cos, sin = rope_tables(s, cfg.qk_rope_head_dim, cfg.rope_theta)  # (S, R/2) each

        with jax.named_scope("embedding"):
            h = self._embed(inputs)  # (B, S, D)
        stats = []  # per-layer LayerStats in router order: main MoE layers, then MTP blocks
        for stack in (self.dense_layers, self.moe_layers):
            if stack is not None:
                h, layer_stats = stack(h, cos, sin)
                if layer_stats is not None:
                    stats.append(layer_stats)
        with jax.named_scope("lm_head"):
            logits = head(self.final_norm(h))

        stream = inputs if targets is None else jnp.concatenate([inputs, targets[:, -1:]], axis=1)
        mtp_logits = []
        with jax.named_scope("mtp"):
            for depth, module in enumerate(self.mtp, start=1):
                ahead = _shift_left(stream, depth)[:, :s]  # (B, S): token i+depth (0 past the end)
                merged = jnp.concatenate([module.hidden_norm(h), module.embed_norm(self._embed(ahead))], axis=-1)
                h, layer_stats = apply_block(cfg, module.block, module.proj(merged), cos, sin)
                if layer_stats is not None:
                    stats.append(layer_stats)
                mtp_logits.append(head(module.final_norm(h)))
        per_layer = concat_stats([StackStats(*s[:3]) for s in stats], cfg.n_experts)
        n_rows = per_layer.expert_load.shape[0]
        zero = jnp.zeros((), jnp.float32)
        return ModelOutput(logits, tuple(mtp_logits), MoEStats(
            expert_load=per_layer.expert_load,
            dropped_fraction=jnp.mean(per_layer.dropped_fraction) if n_rows else zero,
            balance_loss=jnp.sum(per_layer.balance_loss) if n_rows else zero,
            dropped_fraction_per_layer=per_layer.dropped_fraction))

    def router_biases(self) -> list[RouterBias]:
        """Router bias variables in `MoEStats.expert_load` row order: the MoE stack's (L_moe, E), then
        one (E,) per MoE MTP block."""
        biases = [self.moe_layers.blocks.ffn.router.bias] if self.moe_layers is not None else []
        return biases + [m.block.ffn.router.bias for m in self.mtp if m.block.is_moe]

    def router_bias_table(self) -> jax.Array:
        """(L_router, E) float32: every router's bias, one row per MoE layer (MTP blocks last)."""
        return jnp.concatenate([jnp.reshape(b[...], (-1, self.cfg.n_experts)) for b in self.router_biases()])


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
    # loss_chunk_tokens > 0: the model returns normalised hidden states and the head runs chunk by chunk
    out = model(inputs, targets, apply_head=not cfg.loss_chunk_tokens)
    if cfg.loss_chunk_tokens:
        weight, vocab_major, bias = model.head_weight()
        cross_entropy_fn = lambda h, t, m: chunked_cross_entropy(h, weight, t, m, cfg.loss_chunk_tokens, vocab_major,
                                                                 bias=bias, logits_dtype=cfg.logits_dtype)
    else:
        cross_entropy_fn = cross_entropy
    with jax.named_scope("loss"):
        ce = cross_entropy_fn(out.logits, targets, mask)

    mtp_terms = []
    for depth, logits in enumerate(out.mtp_logits, start=1):
        mtp_mask = _shift_left(mask, depth)  # (B, S): 0 where token i+depth does not exist
        with jax.named_scope("mtp"):
            mtp_terms.append(cross_entropy_fn(logits, _shift_left(targets, depth), mtp_mask))
    mtp = jnp.mean(jnp.stack(mtp_terms)) if mtp_terms else jnp.zeros((), jnp.float32)

    loss = ce + cfg.mtp_loss_weight * mtp + cfg.balance_loss_weight * out.moe.balance_loss
    load = out.moe.expert_load  # (L_moe, E)
    max_over_mean = (jnp.mean(jnp.max(load, -1) / jnp.maximum(jnp.mean(load, -1), 1e-9))
                     if load.shape[0] else jnp.ones((), jnp.float32))
    metrics = {
        "loss": loss, "ce_loss": ce, "mtp_loss": mtp, "balance_loss": out.moe.balance_loss,
        "dropped_fraction": out.moe.dropped_fraction, "load_max_over_mean": max_over_mean,
        "dropped_fraction_per_layer": out.moe.dropped_fraction_per_layer,
        "expert_load": load,
    }
    return loss, metrics


def update_router_bias(model: DeepSeekModel, expert_load: jax.Array, rate: float | None = None) -> None:
    """Aux-loss-free balancing, in place, for each MoE layer: `router.updated_bias` with
    the router recipe's bias_update (sign: b_i += rate * sign(mean load - load_i)).

    expert_load (L_moe, E) as in `MoEStats.expert_load`; rate defaults to cfg.router_bias_rate.
    Call outside the gradient (after the optimizer step).
    """
    rate = model.cfg.router_bias_rate if rate is None else rate
    n_rows = model.cfg.n_router_layers
    if expert_load.shape != (n_rows, model.cfg.n_experts):
        raise ValueError(f"expert_load shape {tuple(expert_load.shape)} != (L_moe, E) = "
                         f"{(n_rows, model.cfg.n_experts)}")
    row = 0
    for bias in model.router_biases():  # (L, E) for the MoE stack, (E,) for an MTP block
        rows = bias[...].shape[0] if bias[...].ndim == 2 else 1
        load = expert_load[row:row + rows].reshape(bias[...].shape)
        bias[...] = updated_bias(bias[...], load, rate, model.cfg.router.bias_update)
        row += rows
