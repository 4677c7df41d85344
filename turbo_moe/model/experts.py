"""Routed-expert weights, the expert FFN written once, and the interface shared by the MoE paths.

A MoE path (built from its row of `turbo_moe.model.paths.PATHS`) is a pure function
    path(x (B, S, D), routing: Routing, weights: ExpertWeights) -> (y (B, S, D), ExpertStats)
returning the weighted sum of the routed experts' outputs (shared experts not included). Expert weights
keep the expert axis E leading so a later shard_map can split it over an `expert` mesh axis.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from turbo_moe.model.config import ModelConfig
from turbo_moe.model.sharding import EXPERT_AXIS


class ExpertWeights(NamedTuple):
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


@jax.custom_vjp
def swiglu_fused(h: jax.Array) -> jax.Array:
    """silu(gate) * up for h (..., 2F) = [gate | up] -> (..., F).

    Its backward is written out: d_h = [d_gate | d_up] as one concatenate, computed in float32. Autodiff of the
    two slices gave pad(d_gate) + pad(d_up), which XLA fused into a loop that evaluated both halves for every
    element of d_h, at almost twice its bytes' time (docs/performance.md)."""
    return _swiglu(h)


def _swiglu(h):
    f = h.shape[-1] // 2
    return jax.nn.silu(h[..., :f]) * h[..., f:]


def _swiglu_fwd(h):
    return _swiglu(h), h


def _swiglu_bwd(h, d_act):
    from turbo_moe.ops.grouped_gemm_swiglu import swiglu_grad  # pure JAX; the FFI op's backward shares it

    return (swiglu_grad(h, d_act).astype(h.dtype),)


swiglu_fused.defvjp(_swiglu_fwd, _swiglu_bwd)


# A grouped GEMM: (rows, w (E, K, N), group_sizes (E,) or None) -> rows @ w[expert of each row].
GroupedGemm = Callable[[jax.Array, jax.Array, "jax.Array | None"], jax.Array]


# Names of the expert FFN's inputs and GEMM outputs (`jax.ad_checkpoint.checkpoint_name`): the remat
# policy "dots_experts_attention" saves them so that no path's expert GEMMs run again in the backward pass.
EXPERT_SAVE_NAMES = ("moe_expert_rows", "moe_expert_gate_up", "moe_expert_down", "moe_expert_group_sizes",
                     "moe_expert_act")


def saved(x: jax.Array, name: str) -> jax.Array:
    """x named `name` for the remat policies, behind an optimization barrier."""
    # The barrier keeps XLA's dynamic-slice fusion from wrapping a *clone* of the FFI call that made x
    # around the write into the scan's stacked residuals (it did: every saved grouped GEMM ran twice in
    # the forward pass). Values are unchanged.
    return checkpoint_name(jax.lax.optimization_barrier(x), name)


def expert_ffn(rows: jax.Array, weights: ExpertWeights, group_sizes: jax.Array | None,
               gemm: GroupedGemm) -> jax.Array:
    """The E SwiGLU experts on expert-sorted rows, for any grouped GEMM: gate+up GEMM -> SwiGLU -> down GEMM.

    rows (M, D) sorted by expert with group_sizes (E,) rows each (or (E, ..., D) slots and None for the
    batched einsum) -> (M, D) (or (E, ..., D)). gate and up are one GEMM to 2F (fused weights)."""
    rows = saved(rows, EXPERT_SAVE_NAMES[0])
    if group_sizes is not None:  # the grouped GEMMs' backward reads them: saved, the permute need not run again
        group_sizes = saved(group_sizes, EXPERT_SAVE_NAMES[3])
    with jax.named_scope("grouped_gemm"):
        h = saved(gemm(rows, weights.w_gate_up, group_sizes), EXPERT_SAVE_NAMES[1])  # (M, 2F)
    with jax.named_scope("swiglu"):
        act = checkpoint_name(swiglu_fused(h), EXPERT_SAVE_NAMES[4])  # (M, F); saved: not recomputed for the backward
    with jax.named_scope("grouped_gemm"):
        return saved(gemm(act, weights.w_down, group_sizes), EXPERT_SAVE_NAMES[2])  # (M, D)


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
        init = nnx.initializers.normal(cfg.init_std)
        e, d, f = cfg.n_experts, cfg.d_model, cfg.moe_ffn_dim
        dtype = jnp.dtype(cfg.param_dtype)
        # The expert dim is declared for sharding (turbo_moe.model.sharding): split over "expert".
        axes = (EXPERT_AXIS, None, None)
        self.w_gate_up = nnx.Param(init(rngs.params(), (e, d, 2 * f), dtype), logical_axes=axes)  # (E, D, 2F)
        w_down = init(rngs.params(), (e, f, d), dtype)  # drawn either way: the other parameters do not change
        if cfg.zero_init_out_proj:
            w_down = jnp.zeros_like(w_down)
        self.w_down = nnx.Param(w_down, logical_axes=axes)  # (E, F, D)

    def weights(self) -> ExpertWeights:
        return ExpertWeights(self.w_gate_up[...], self.w_down[...])
