"""Decoder blocks and the layer stack that runs them with one `jax.lax.scan`.

A `BlockStack` holds `n` blocks of one kind (dense or MoE) as ONE module whose every array has a
leading layer axis (L, ...). Initialisation vmaps the block constructor over L keys and the forward
pass scans over L, so both compile one block, whatever the depth. Per-layer meaning is kept: the
router biases are (L, E), the stats the scan returns are per layer.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from turbo_moe.model.config import ModelConfig
from turbo_moe.model.normal_init import vmap_layers
from turbo_moe.model.ep_exchange import EP_RECEIVED_NAME
from turbo_moe.model.experts import RoutedExperts
from turbo_moe.model.layers import ATTENTION_SAVE_NAME, MLAttention, RMSNorm, SwiGLU
from turbo_moe.model.moe_layer import LayerStats, MoELayer
from turbo_moe.model.router import ROUTER_SAVE_NAME
from turbo_moe.model.paths import path_row
from turbo_moe.ops.expert_block import EXPERT_SAVE_NAMES
from turbo_moe.ops.fp8_scaling import fp8_weights
from turbo_moe.ops.permute import ROW_INDEX_NAME
from turbo_moe.model.sharding import LAYER_AXIS, with_leading_axis

# The routed experts' tensors the backward pass reads (named in `ops.expert_ffn` / `ops.expert_block`), and the cuDNN
# attention kernel's outputs (its output and softmax statistics are its backward's residuals). Neither is
# a plain dot, so under "dots_no_batch" the grouped GEMMs, the permute and cuDNN's forward run again in the
# backward pass (docs/performance.md).
_CUDNN_ATTENTION_FWD = "dot_product_attention_fwd_wrapper"
# The routing's integer results (the router's picks; the permute's row index, a residual of its backward):
# a few bytes a token, and without them the backward pass runs the router's selection and the permute again.
ROUTING_SAVE_NAMES = (ROUTER_SAVE_NAME, ROW_INDEX_NAME)


def _cudnn_attention_outputs(prim, *_, **__) -> bool:
    return prim.name == _CUDNN_ATTENTION_FWD


REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "dots_experts_attention": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.save_only_these_names(*EXPERT_SAVE_NAMES, *ROUTING_SAVE_NAMES, ATTENTION_SAVE_NAME,
                                                          EP_RECEIVED_NAME),
            _cudnn_attention_outputs)),
}


class DecoderBlock(nnx.Module):
    """Pre-norm block: x + MLA(norm(x)), then x + FFN(norm(x)), FFN dense SwiGLU or MoE."""

    def __init__(self, cfg: ModelConfig, layer_index: int, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg)
        self.attn = MLAttention(cfg, rngs)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg)
        self.is_moe = cfg.is_moe_layer(layer_index)
        self.ffn = MoELayer(cfg, rngs) if self.is_moe else SwiGLU(cfg, cfg.dense_ffn_dim, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, LayerStats | None]:
        with jax.named_scope("attention"):
            x = x + self.attn(self.attn_norm(x), cos, sin)  # (B, S, D)
        if self.is_moe:
            with jax.named_scope("moe"):
                y, stats = self.ffn(self.ffn_norm(x))
            return x + y, stats
        with jax.named_scope("dense_ffn"):
            return x + self.ffn(self.ffn_norm(x)), None


def block_fn(cfg: ModelConfig, graphdef):
    """(h, block state, cos, sin) -> (h, stats): one block as a pure function, rematerialised per
    `cfg.remat_policy`. Pure (split/merge) so that it can sit inside `jax.lax.scan` and `jax.checkpoint`."""

    def run(h, state, cos, sin):
        return nnx.merge(graphdef, state)(h, cos, sin)

    if cfg.remat_policy == "none":
        return run
    # prevent_cse=False: the scan already keeps XLA from merging the recomputation with the forward.
    return jax.checkpoint(run, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=False)


def apply_block(cfg: ModelConfig, block: DecoderBlock, h, cos, sin):
    """Run one (unstacked) block, e.g. an MTP block, rematerialised like the stacked ones. On an FP8 path its weights
    are prepared as the stacks' are (`prepared_weights`: the experts quantised once for the step, not at each use);
    elsewhere it casts at use as before (preparing them there is unmeasured)."""
    graphdef, state = nnx.split(block)
    if block.is_moe and path_row(cfg.moe_path).gemm == "fp8":
        state = prepared_weights(cfg, block, state, block.is_moe)
    return block_fn(cfg, graphdef)(h, state, cos, sin)


def prepared_weights(cfg: ModelConfig, blocks: nnx.Module, state, is_moe: bool):
    """`state` of `blocks` (a stack, or one block) as the blocks read it in a step: the cast-at-use weights cast to
    the compute dtype once, and on an FP8 path the routed experts' weights quantised once (`fp8_weights`), so that
    neither the forward, the backward nor a remat's recomputation does it again. Values and gradients unchanged."""
    state = cast_stacked_weights(blocks, state, jnp.dtype(cfg.dtype))
    if is_moe and path_row(cfg.moe_path).gemm == "fp8":
        state = quantize_stacked_experts(blocks, state)
    return state


class BlockStack(nnx.Module):
    """`n_blocks` DecoderBlocks numbered from `first_layer` (all dense or all MoE), stacked on axis 0."""

    def __init__(self, cfg: ModelConfig, first_layer: int, n_blocks: int, rngs: nnx.Rngs):
        kinds = {cfg.is_moe_layer(i) for i in range(first_layer, first_layer + n_blocks)}
        if n_blocks <= 0 or len(kinds) != 1:
            raise ValueError(f"BlockStack: layers {first_layer}..{first_layer + n_blocks - 1} must be "
                             f"one or more blocks of one kind (dense or MoE)")
        self.cfg = cfg
        self.n_blocks = n_blocks
        self.is_moe = kinds.pop()

        def new_block_state(key):
            return nnx.state(DecoderBlock(cfg, first_layer, nnx.Rngs(params=key)))

        # One vmapped constructor: the init program holds one RNG kernel per parameter, not per layer.
        stacked = vmap_layers(new_block_state, jax.random.split(rngs.params(), n_blocks))
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: DecoderBlock(cfg, first_layer, nnx.Rngs(params=0))))
        self.blocks = nnx.merge(graphdef, with_leading_axis(stacked, LAYER_AXIS))

    def __call__(self, h: jax.Array, cos: jax.Array, sin: jax.Array):
        """h (B, S, D) -> (h, stats stacked over the layers (L, ...) or None for dense blocks)."""
        graphdef, state = nnx.split(self.blocks)
        # Prepared once for all layers, not per layer inside the scan: less slicing traffic, the same values.
        state = prepared_weights(self.cfg, self.blocks, state, self.is_moe)
        run = block_fn(self.cfg, graphdef)

        def body(carry, layer_state):
            return run(carry, layer_state, cos, sin)

        return jax.lax.scan(body, h, state)


def cast_at_use_paths(blocks: nnx.Module, dtype) -> set[tuple]:
    """State paths of the weights the block casts to `dtype` at use: the kernels (and biases) of the
    nnx.Linear layers computing in `dtype` and the routed experts' weights (`paths.moe_path_fn` and
    the EP paths cast them to the tokens' dtype). Norm scales and the float32 router gate stay out."""
    paths = routed_expert_paths(blocks)
    for path, node in nnx.iter_graph(blocks):
        if isinstance(node, nnx.Linear) and node.dtype is not None and jnp.dtype(node.dtype) == dtype:
            paths |= {(*path, "kernel"), (*path, "bias")}
    return paths


def routed_expert_paths(blocks: nnx.Module) -> set[tuple]:
    """State paths of the routed experts' weights (w_gate_up, w_down) in `blocks`."""
    return {(*path, name) for path, node in nnx.iter_graph(blocks) if isinstance(node, RoutedExperts)
            for name in ("w_gate_up", "w_down")}


def stacked_cast_paths(model: nnx.Module, dtype) -> set[tuple]:
    """Paths (in `nnx.state(model)`) of every BlockStack's cast-at-use weights: what `cast_stacked_weights` casts."""
    paths = set()
    for path, node in nnx.iter_graph(model):
        if isinstance(node, BlockStack):
            paths |= {(*path, "blocks", *p) for p in cast_at_use_paths(node.blocks, dtype)}
    return paths


def cast_stacked_weights(blocks: nnx.Module, state, dtype):
    """`state` with the cast-at-use weights cast to `dtype` for all layers at once, before the scan slices
    them: each layer then reads its slice in `dtype` instead of
    the float32 one. Rounding commutes with slicing, so values and gradients are unchanged."""
    cast = cast_at_use_paths(blocks, dtype)
    flat = [(path, var.replace(var[...].astype(dtype)) if path in cast and isinstance(var, nnx.Param) else var)
            for path, var in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def quantize_stacked_experts(blocks: nnx.Module, state):
    """`state` with the routed experts' weights replaced by `ops.fp8_weights` of them, all layers in one pass before
    the scan: the FP8 path's forward and backward (and a remat's recomputation) of every layer then read the blocks
    made here instead of quantising each weight at each use (once a step instead of two to three times a layer). The
    values and gradients are those of quantising at each use: the same blocks, the gradient to the weight."""
    weights = routed_expert_paths(blocks)
    flat = [(path, var.replace(fp8_weights(var.get_value())) if path in weights else var)
            for path, var in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


class StackStats(NamedTuple):
    """LayerStats of several stacks and single blocks, concatenated in router order."""

    expert_load: jax.Array  # (L_moe, E)
    dropped_fraction: jax.Array  # (L_moe,)
    balance_loss: jax.Array  # (L_moe,)


def concat_stats(parts: list[LayerStats], n_experts: int) -> StackStats:
    """Concatenate per-layer stats in router order: a stack's have a leading layer axis, a single
    block's (an MTP block) none."""
    rows = [p if p.expert_load.ndim == 2 else jax.tree.map(lambda a: a[None], p) for p in parts]
    if not rows:
        empty = jnp.zeros((0,), jnp.float32)
        return StackStats(jnp.zeros((0, n_experts), jnp.float32), empty, empty)
    return StackStats(*(jnp.concatenate(xs) for xs in zip(*rows)))
