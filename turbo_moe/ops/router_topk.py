"""The router's expert choice in one kernel: DeepSeek-V3 group-limited top-k with the causal sequence load
penalty fused in (the ids of `model.router.group_limited_topk` on `model.router.seq_load_penalized_selection`)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call

# Pseudo-tokens at the fair share that every sequence's counts start with; the model's
# router.SEQ_LOAD_PRIOR_TOKENS imports it from here (one owner).
SEQ_LOAD_PRIOR_TOKENS = 64
# What the CUDA kernel holds per thread and per block (kernels/cuda/router_topk.cu); the CPU kernel has no
# limit but takes the same, so that a program runs on either.
MAX_EXPERTS, MAX_GROUPS, MAX_TOP_K = 4096, 64, 32


def router_topk(selection, bias, *, top_k: int, n_groups: int, topk_groups: int, penalty: float = 0.0,
                chunk: int = 128):
    """Expert ids int32 (B, S, top_k) of each token, best first (ties toward the lower expert id).

    Args:
      selection: float32 (B, S, E) selection scores (stop-gradient is applied here).
      bias: float32 (E,) selection bias (stop-gradient).
      top_k, n_groups, topk_groups: DeepSeek-V3 group-limited top-k: keep the `topk_groups` groups (of E /
        n_groups consecutive experts) with the largest sum of their two best `selection + bias`, then the
        top_k experts of the kept groups.
      penalty: the causal sequence load penalty's weight (the router recipe's seq_load_penalty); 0: none.
      chunk: tokens per chunk of a sequence for the penalty (the router recipe's seq_load_chunk).
    Picks what `group_limited_topk(seq_load_penalized_selection(...), bias)` picks, in the same order, with
    the same float32 arithmetic as XLA:CPU; elsewhere an ulp of difference can move a near-tie.
    """
    _checks.check_rank("selection", selection, 3, "(B, S, E)")
    _checks.check_rank("bias", bias, 1, "(E,)")
    for name, x in (("selection", selection), ("bias", bias)):
        if jnp.dtype(x.dtype) != jnp.float32:
            raise TypeError(f"{name} must be float32, got {jnp.dtype(x.dtype)}")
    n_experts = selection.shape[-1]
    if bias.shape != (n_experts,):
        raise ValueError(f"bias must have shape (E,) = ({n_experts},) like selection (B, S, E), got {bias.shape}")
    if not 1 <= n_experts <= MAX_EXPERTS:
        raise ValueError(f"selection (B, S, E) must have 1 <= E <= {MAX_EXPERTS} experts, got E={n_experts}")
    n_groups = _checks.static_int("n_groups", n_groups, maximum=MAX_GROUPS)
    if n_experts % n_groups:
        raise ValueError(f"n_groups={n_groups} must divide the number of experts E={n_experts}")
    topk_groups = _checks.static_int("topk_groups", topk_groups, maximum=n_groups)
    selectable = topk_groups * (n_experts // n_groups)
    top_k = _checks.static_int("top_k", top_k, maximum=min(MAX_TOP_K, selectable))
    chunk = _checks.static_int("chunk", chunk)
    if isinstance(penalty, (bool, np.bool_)) or not isinstance(penalty, (int, float, np.floating)) or not (
            math.isfinite(penalty) and penalty >= 0):
        raise ValueError(f"penalty must be a finite Python number >= 0 (0: no penalty), got {penalty!r}")
    selection, bias = jax.lax.stop_gradient(selection), jax.lax.stop_gradient(bias)
    out = jax.ShapeDtypeStruct(selection.shape[:-1] + (top_k,), jnp.int32)
    return ffi_call("turbo_moe_router_topk", out, selection, bias, top_k=top_k, n_groups=n_groups,
                    topk_groups=topk_groups, penalty=np.float32(penalty), chunk=chunk,
                    prior_tokens=SEQ_LOAD_PRIOR_TOKENS)
