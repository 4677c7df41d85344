"""`turbo` MoE path: dropless with the `turbo_moe.ops` FFI kernels.

permute -> grouped GEMM (gate and up fused: one GEMM to 2F) -> SwiGLU -> grouped GEMM -> unpermute
(the routing-weighted sum over a token's k copies is fused into unpermute).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from turbo_moe.model.experts import ExpertStats, ExpertWeights, swiglu_fused
from turbo_moe.model.router import Routing


def turbo_experts(x: jax.Array, routing: Routing, weights: ExpertWeights) -> tuple[jax.Array, ExpertStats]:
    """x (B, S, D) compute dtype -> (y (B, S, D), stats); no token is dropped."""
    from turbo_moe import ops  # imported here so the model works (other paths) without the FFI library

    b, s, d = x.shape
    k = routing.expert_ids.shape[-1]
    n_experts = weights.n_experts
    w = weights.astype(x.dtype)
    tokens = x.reshape(b * s, d)  # (T, D)
    expert_ids = routing.expert_ids.reshape(b * s, k)  # (T, k)

    with jax.named_scope("permute"):
        x_sorted, group_sizes, handle = ops.permute(tokens, expert_ids, n_experts)  # (T*k, D), (E,)
    with jax.named_scope("grouped_gemm"):
        h = ops.grouped_gemm(x_sorted, w.w_gate_up, group_sizes)  # (T*k, 2F)
    with jax.named_scope("swiglu"):
        act = swiglu_fused(h)
    with jax.named_scope("grouped_gemm"):
        out_sorted = ops.grouped_gemm(act, w.w_down, group_sizes)  # (T*k, D)
    with jax.named_scope("unpermute"):
        y = ops.unpermute(out_sorted, handle, routing.weights.reshape(b * s, k).astype(jnp.float32))  # (T, D)
    stats = ExpertStats(group_sizes.astype(jnp.float32), jnp.zeros((), jnp.float32))
    return y.reshape(b, s, d), stats
