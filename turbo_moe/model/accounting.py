"""Parameter counts (via jax.eval_shape: nothing is allocated) and training FLOPs per token."""

from __future__ import annotations

import functools
import math

from flax import nnx

from turbo_moe.model.config import ModelConfig


@functools.lru_cache(maxsize=16)
def _param_sizes(cfg: ModelConfig) -> tuple[tuple[tuple[str, ...], int], ...]:
    """(path, element count) of every nnx.Param of DeepSeekModel(cfg), from abstract shapes only."""
    from turbo_moe.model.model import DeepSeekModel

    abstract = nnx.eval_shape(lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(abstract, nnx.Param))
    return tuple((tuple(str(p) for p in path), math.prod(var.shape)) for path, var in flat)


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of `cfg` (nnx.Param only; the router bias is not a parameter).

    total:          main model (embedding, blocks, final norm, output head), MTP excluded — the
                    convention of DeepSeek-V3's "671B".
    active:         main-model parameters one token uses: total minus the (E - k) / E unused share of
                    every MoE layer's routed experts (embedding and head included) — "37B".
    mtp:            MTP modules plus the embedding and output head they share, as the released checkpoint
                    stores them ("14B").
    mtp_own:        parameters only the MTP modules hold.
    total_with_mtp: every distinct parameter (what training allocates): total + mtp_own.
    embedding:      input embedding table; head: output projection (0 when tied).
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    unused_expert_share = 1.0 - cfg.top_k / cfg.n_experts
    total = mtp_own = embedding = head = 0
    inactive = 0.0
    for path, size in _param_sizes(cfg):
        top = path[0]
        is_routed = "experts" in path
        if top == "mtp":
            mtp_own += size
            continue
        total += size
        embedding += size if top == "embed" else 0
        head += size if top in ("head", "head_bias") else 0
        inactive += size * unused_expert_share if is_routed else 0.0
    return {
        "total": total,
        "active": int(round(total - inactive)),
        "mtp": mtp_own + embedding + head,
        "mtp_own": mtp_own,
        "total_with_mtp": total + mtp_own,
        "embedding": embedding,
        "head": head,
    }


def mtp_active_params(cfg: ModelConfig) -> int:
    """Parameters one token uses in the MTP modules (their own, routed experts at k / E)."""
    unused_expert_share = 1.0 - cfg.top_k / cfg.n_experts
    used = 0.0
    for path, size in _param_sizes(cfg):
        if path[0] == "mtp":
            used += size * (1.0 - unused_expert_share) if "experts" in path else size
    return int(round(used))


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the score and value matmuls of every attention layer (causal: half).

    Forward per token and layer: 2 * S * H * (d_qk + d_v) multiply-adds-as-2-FLOPs, halved for the causal
    mask; training = 3x forward.
    """
    n_attention_layers = cfg.n_layers + cfg.mtp_depth
    forward = 2.0 * seq_len * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim) / 2.0
    return 3.0 * forward * n_attention_layers


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (for MFU): 6 x matmul parameters a token uses + attention.

    Matmul parameters: active parameters minus the input embedding (a gather, no FLOPs), plus the MTP
    modules' active parameters and one pass through the shared output head per MTP depth. Router,
    norms and elementwise work are counted as matmul params or ignored (they are < 0.1%).
    """
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    counts = count_params(cfg)
    head_size = counts["embedding"] if cfg.tie_embeddings else counts["head"]
    # The input lookup is free; the head matmul counts (tied: the embedding table is the head).
    matmul_params = counts["active"] - counts["embedding"] + (head_size if cfg.tie_embeddings else 0)
    matmul_params += mtp_active_params(cfg) + cfg.mtp_depth * head_size
    return 6.0 * matmul_params + attention_flops_per_token(cfg, seq_len)
