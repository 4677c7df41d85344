"""MaxText's expert-parallel routed body (`RoutedMoE.sparse_matmul` under `ici_expert_parallelism > 1`) on turbo.

MaxText's own body is one shard_map over its mesh: permute (sort the top-k copies by global expert) ->
`ragged_all_to_all` -> local permute -> grouped GEMMs -> unsort -> `ragged_all_to_all` -> unpermute and weight sum.
`sparse_matmul(layer, ...)` here computes the same `(output, lb_loss, bias_updates)` as:
  1. MaxText's routing, in a shard_map with MaxText's own specs and `check_vma`, so the routing helpers see exactly
     what they see in MaxText's body: `layer.get_topk` on its logits (gating, normalisation, routed scaling,
     aux-free bias selection), `layer.load_balance_loss` on this shard's top-k and softmax of the pre-bias logits,
     `calculate_expert_counts` summed over the batch axes and MaxText's bias update from them (or, for sigmoid
     routers, `megatron_seq_aux_loss` on the whole batch after the shard_map, as MaxText does);
  2. `turbo_moe.model.expert_parallel.ep_moe_path("turbo", ep_exchange="deepep")`: `moe_dispatch` sends each token
     once per rank that owns one of its experts, each rank runs its experts (`ops.expert_block`: permute, grouped
     GEMMs with SwiGLU, unpermute) and `moe_combine` returns the weighted sums.
The expert weights, `ep_weights`:
  "fused" (default): MaxText's wi_0 / wi_1 (E, D, F) become turbo's fused gate/up (E, D, 2F) by one concatenate a
    step on each rank's E/P experts, and its gradient is split back (a copy of the gate/up weights each way; with
    MaxText's `prefuse_moe_weights` the two are slices of one array, XLA folds the forward concatenate away and
    only the backward copy is left). Then `ep_moe_path` as is: the expert block with its fused SwiGLU kernel.
  "split": no copy: the same dispatch/combine around turbo's permute -> three grouped GEMMs on wi_0, wi_1, wo
    (SwiGLU by XLA) -> unpermute, differentiated by autodiff (the expert block's backward is not used).
wo (E, F, D) is turbo's w_down as is.

`unsupported(layer, ...)` names the first thing this body cannot compute exactly as MaxText would; the caller
(`turbo_moe.integrations.maxtext`) then runs MaxText's own body, with its GEMMs on turbo.
"""
from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from turbo_moe.model.expert_parallel import ep_moe_path
from turbo_moe.model.experts import ExpertWeights
from turbo_moe.model.mesh import mesh_platform
from turbo_moe.model.paths import build_stage, path_row, run_stage
from turbo_moe.model.router import Routing
from turbo_moe.ops.gemm_sets import GEMM_SETS
from turbo_moe.ops.ragged_exchange import default_impl
from turbo_moe.ops.varying import make_varying

MOE_MODULE = "maxtext.layers.moe"
EXPERT_AXIS = "expert"  # MaxText's expert-parallel mesh axis (its default `_expert_parallelism_name`)
# MaxText's logical axes of the tokens and the logits inside its sparse_matmul (batch sharded by expert).
TOKEN_AXES = ("activation_batch", "activation_norm_length", None)
# model_name prefixes whose pre-bias logits MaxText passes into its shard_map sharded like the tokens.
PRE_BIAS_MODELS = ("deepseek3", "deepseek4", "kimi-k2")
EP_WEIGHTS = ("fused", "split")


def _moe():
    return importlib.import_module(MOE_MODULE)


def _plain_float(*xs) -> bool:
    return all(isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) for x in xs)


def _axes_of(dim) -> tuple[str, ...]:
    if dim is None:
        return ()
    return (dim,) if isinstance(dim, str) else tuple(a for a in dim if a is not None)


def _unsupported_config(layer) -> str | None:
    """The first config setting this body does not reproduce, as a short reason key (None: all supported)."""
    moe, cfg = _moe(), layer.config
    blocks = moe.ctypes.DecoderBlockType
    checks = (
        ("expert_axis", layer._expert_parallelism_name != EXPERT_AXIS),  # e.g. context-as-expert, vLLM's axes
        ("tensor_parallelism", layer.get_tensor_parallelism_size() > 1),
        ("quantization", layer.quant is not None or getattr(layer, "weight_quant", None) is not None
         or moe.qpl.get_current_rule("gmm") is not None),
        ("ring_of_experts", bool(cfg.use_ring_of_experts)),
        ("capacity", layer.get_ragged_buffer_factor() > 0),
        ("dropless_fallback", cfg.moe_dropless_fallback not in (None, "None", "none", "")),
        ("expert_bias", bool(cfg.mlp_bias)),
        ("activation", list(cfg.mlp_activations) != ["silu", "linear"]),
        ("decoder_block", cfg.decoder_block in (blocks.GPT_OSS, blocks.LLAMA4)),  # clipped / pre-scaled experts
        ("activation_limit", cfg.decoder_block in (blocks.DEEPSEEK, blocks.DEEPSEEK4)
         and cfg.mlp_activations_limit > 0.0),
        ("hash_routing", bool(layer.is_hash_routing)),
        ("random_routing", bool(cfg.use_random_routing)),
        ("emb_chunks", cfg.num_moe_emb_chunks > 0),
        ("load_probes", bool(getattr(cfg, "moe_log_max_load_ratio", False))
         or bool(getattr(cfg, "log_required_ragged_buffer_factor", False))),
        # turbo's combine sums the k copies in float32, MaxText's in its dtype unless float32_weight_sum.
        ("weight_sum_dtype", not cfg.float32_weight_sum and jnp.dtype(layer.dtype) != jnp.float32),
        ("shard_mode", cfg.shard_mode != moe.ShardMode.AUTO),
        ("experts_not_divisible", cfg.num_experts % layer.get_expert_parallelism_size() != 0),
    )
    return next((reason for reason, hit in checks if hit), None)


def unsupported(layer, inputs, w0_kernel, w1_kernel, wo_kernel, w0_bias, w1_bias, wo_bias, input_ids=None,
                forced_routed_experts=None) -> str | None:
    """Why this body cannot replace `layer.sparse_matmul` on these arguments, or None. Call under MaxText's mesh
    and logical axis rules (as its layer is called)."""
    reason = _unsupported_config(layer)
    if reason:
        return reason
    if input_ids is not None:
        return "hash_routing"
    if forced_routed_experts is not None:
        return "forced_routing"
    if any(b is not None for b in (w0_bias, w1_bias, wo_bias)):
        return "expert_bias"
    if not _plain_float(inputs, w0_kernel, w1_kernel, wo_kernel):
        return "quantization"  # AQT / qwix containers or integer payloads
    spec = layer._logical_to_mesh_axes(TOKEN_AXES)
    batch_axes = _axes_of(spec[0]) if len(spec) else ()
    mesh_shape = dict(layer.mesh.shape)
    # Tokens must be split over the expert axis, and over every other axis of more than one device, on the batch
    # dim alone (a split sequence, a pipeline stage or a replicated batch would need a different exchange).
    split = all(a in batch_axes for a, n in mesh_shape.items() if n > 1)
    n_devices = math.prod(mesh_shape.values())
    if inputs.shape[0] <= 1 or EXPERT_AXIS not in batch_axes or not split or inputs.shape[0] % n_devices:
        return "batch_not_split"
    return None


def _route(layer, gate_logits, pre_bias_logits, token_spec, pre_bias_spec, count_axes, with_lb_loss: bool):
    """MaxText's routing as its sparse_matmul body runs it, per shard: (top-k weights, ids, lb_loss, counts)."""
    moe, cfg = _moe(), layer.config

    def route(logits, pre_bias):
        weights, ids = layer.get_topk(logits, pre_bias, None)
        lb_loss = None
        if with_lb_loss:
            # MaxText's permute: the pre-bias logits keep the router bias out of the loss's gradient.
            probs = jax.nn.softmax((pre_bias if pre_bias is not None else logits).astype(jnp.float32), axis=-1)
            lb_loss = layer.load_balance_loss(ids, probs.astype(layer.dtype))
        counts = None
        if layer.should_update_load_balance():
            counts = moe.calculate_expert_counts(ids, cfg.num_experts, axis_names=count_axes)
        return weights, ids, lb_loss, counts

    return jax.shard_map(route, mesh=layer.mesh, in_specs=(token_spec, pre_bias_spec),
                         out_specs=(token_spec, token_spec, P(), P()), check_vma=cfg.check_vma)(
        gate_logits, pre_bias_logits)


def _bias_updates(layer, counts):
    """MaxText's finalize_bias_updates: raw counts under gradient accumulation, else its loss-free update."""
    cfg = layer.config
    if counts is None or getattr(cfg, "gradient_accumulation_steps", 1) > 1:
        return counts
    return _moe().load_balance_updates_from_counts(counts, cfg.num_experts, cfg.routed_bias_update_rate)


class _SplitFfn:
    """The exchanges' `ffn(rows, group_sizes)` on separate gate / up weights (E, D, F): SwiGLU experts, autodiff."""

    def __init__(self, w_gate, w_up, w_down):
        self.w_gate, self.w_up, self.w_down = w_gate, w_up, w_down

    def __call__(self, rows, group_sizes):
        gemm = GEMM_SETS["turbo"].forward
        gate, up = gemm(rows, self.w_gate, group_sizes), gemm(rows, self.w_up, group_sizes)
        return gemm((jax.nn.silu(gate) * up).astype(rows.dtype), self.w_down, group_sizes)


def _split_experts(mesh, x, ids, weights, w0, w1, wo):
    """ep_moe_path("turbo", ep_exchange="deepep")'s shard_map with `_SplitFfn` behind the dispatch: y (B, S, D)."""
    batch_axes = tuple(mesh.axis_names)  # tokens split over every device, as ep_moe_path splits them
    row, impl, n_experts = path_row("turbo", "deepep"), default_impl(mesh_platform(mesh)), w0.shape[0]

    def sharded(x, ids, combine_w, w0, w1, wo):
        # Replicated over the non-expert axes: typed varying, their gradients are summed over those axes.
        ffn = _SplitFfn(*(make_varying(w.astype(x.dtype), frozenset(batch_axes)) for w in (w0, w1, wo)))
        stage = build_stage(row, ffn, False, seq_len=x.shape[1], capacity_factor=1.0, axis_name=EXPERT_AXIS,
                            impl=impl, capacity=None, layout="auto")
        return run_stage(stage, x, ids, combine_w, n_experts)[0]

    tokens, experts = P(batch_axes), P(EXPERT_AXIS)
    return jax.shard_map(sharded, mesh=mesh, in_specs=(tokens, tokens, tokens, experts, experts, experts),
                         out_specs=tokens)(x, ids, weights.astype(jnp.float32), w0, w1, wo)


def sparse_matmul(layer, inputs, gate_logits, pre_bias_logits, w0_kernel, w1_kernel, wo_kernel,
                  ep_weights: str = "fused"):
    """`layer.sparse_matmul`'s (output, lb_loss, bias_updates) through turbo's dispatch -> experts -> combine.
    Only for arguments `unsupported` accepts. ep_weights: "fused" or "split" (module docstring)."""
    if ep_weights not in EP_WEIGHTS:
        raise ValueError(f"ep_weights: expected one of {EP_WEIGHTS}, got {ep_weights!r}")
    moe, cfg = _moe(), layer.config
    token_spec = layer._logical_to_mesh_axes(TOKEN_AXES)
    pre_bias_spec = token_spec if cfg.model_name.startswith(PRE_BIAS_MODELS) else None
    inputs = layer._maybe_shard_with_pspec(inputs, token_spec, logical_axes=TOKEN_AXES)
    gate_logits = layer._maybe_shard_with_pspec(gate_logits, token_spec, logical_axes=TOKEN_AXES)
    if pre_bias_logits is not None and pre_bias_spec is not None:
        pre_bias_logits = layer._maybe_shard_with_pspec(pre_bias_logits, pre_bias_spec, logical_axes=TOKEN_AXES)
    megatron_loss = (cfg.load_balance_loss_weight > 0.0 and not layer.is_hash_routing
                     and moe.uses_megatron_seq_aux_loss(cfg))
    with_lb_loss = cfg.load_balance_loss_weight > 0.0 and not layer.is_hash_routing and not megatron_loss
    with jax.named_scope("turbo_ep_routing"):
        weights, ids, lb_loss, counts = _route(layer, gate_logits, pre_bias_logits, token_spec, pre_bias_spec,
                                               moe._batch_axis_names(token_spec), with_lb_loss)
    if megatron_loss:  # whole sequences, after the shard_map, as MaxText does
        lb_loss = layer.megatron_seq_aux_loss(pre_bias_logits if pre_bias_logits is not None else gate_logits)
    with jax.named_scope("turbo_ep_experts"):
        if ep_weights == "split":
            output = _split_experts(layer.mesh, inputs, ids, weights, w0_kernel, w1_kernel, wo_kernel)
        else:
            experts = ExpertWeights(jnp.concatenate([w0_kernel, w1_kernel], axis=-1), wo_kernel)
            path = ep_moe_path("turbo", mesh=layer.mesh, expert_axis=EXPERT_AXIS, ep_exchange="deepep")
            output, _ = path(inputs, Routing(ids, weights, None), experts)
    # MaxText's body reports whether its capped buffers overflowed, one flag a device; this one never drops.
    n_devices = math.prod(dict(layer.mesh.shape).values())
    overflow_shape = () if getattr(layer, "force_dropless", False) else (n_devices,)
    layer.sow(moe.nnx.Intermediate, "moe_has_overflow", jnp.zeros(overflow_shape, jnp.bool_))
    return output.astype(layer.dtype), lb_loss, _bias_updates(layer, counts)
