"""Parameter counts and training FLOPs per token, from the config's arithmetic (instant for any size).

`count_params_from_shapes` counts the same from the model's abstract shapes (jax.eval_shape: nothing is allocated,
but it builds the model, ~0.2-1 CPU s a config); the tests hold the two equal, so the arithmetic follows the model."""

from __future__ import annotations

import functools
import math

from flax import nnx

from turbo_moe.model.config import ModelConfig
from turbo_moe.model.model import DeepSeekModel


@functools.lru_cache(maxsize=16)
def _param_sizes(cfg: ModelConfig) -> tuple[tuple[tuple[str, ...], int], ...]:
    """(path, element count) of every nnx.Param of DeepSeekModel(cfg), from abstract shapes only."""
    abstract = nnx.eval_shape(lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(nnx.state(abstract, nnx.Param))
    return tuple((tuple(str(p) for p in path), math.prod(var.shape)) for path, var in flat)


def _counts(total: int, inactive: float, mtp_own: int, embedding: int, head: int) -> dict[str, int]:
    return {"total": total, "active": int(round(total - inactive)), "mtp": mtp_own + embedding + head,
            "mtp_own": mtp_own, "total_with_mtp": total + mtp_own, "embedding": embedding, "head": head}


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of `cfg` (nnx.Param only; the router bias is not a parameter), from its arithmetic.

    total:          main model (embedding, blocks, final norm, output head), MTP excluded — the
                    convention of DeepSeek-V3's "671B".
    active:         main-model parameters one token uses: total minus the (E - k) / E unused share of
                    every MoE layer's routed experts (embedding and head included) — "37B".
    mtp:            MTP modules plus the embedding and output head they share, as the released checkpoint
                    stores them ("14B").
    mtp_own:        parameters only the MTP modules hold.
    total_with_mtp: every distinct parameter (what training allocates): total + mtp_own.
    embedding:      input embedding table; head: output projection (0 when tied) and its bias.
    """
    if not isinstance(cfg, ModelConfig):
        raise TypeError(f"cfg must be a ModelConfig, got {type(cfg).__name__}")
    d, h = cfg.d_model, cfg.n_heads
    if cfg.q_lora_rank:  # down-projection, its norm, up-projection
        query = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
    else:
        query = d * h * cfg.qk_head_dim
    attention = (query + d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
                 + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * d)
    norms = 2 * d  # before attention and before the FFN
    expert = 3 * d * cfg.moe_ffn_dim  # gate, up, down
    moe_ffn = (cfg.n_experts + cfg.n_shared_experts) * expert + d * cfg.n_experts  # + the router's gate
    embedding = cfg.vocab_size * d
    head = embedding + (cfg.vocab_size if cfg.router.head_bias != "none" else 0)
    n_moe = cfg.n_layers - cfg.n_dense_layers
    total = (embedding + head + d + cfg.n_layers * (attention + norms) + cfg.n_dense_layers * 3 * d * cfg.dense_ffn_dim
             + n_moe * moe_ffn)
    # An MTP module: two input norms, the projection of [h; emb], a MoE block, its final norm.
    mtp_own = cfg.mtp_depth * (2 * d + 2 * d * d + attention + norms + moe_ffn + d)
    inactive = n_moe * cfg.n_experts * expert * (1.0 - cfg.top_k / cfg.n_experts)
    return _counts(total, inactive, mtp_own, embedding, head)


def count_params_from_shapes(cfg: ModelConfig) -> dict[str, int]:
    """`count_params` counted from the model's abstract parameter shapes (the check of its arithmetic)."""
    unused_expert_share = 1.0 - cfg.top_k / cfg.n_experts
    total = mtp_own = embedding = head = 0
    inactive = 0.0
    for path, size in _param_sizes(cfg):
        top = path[0]
        if top == "mtp":
            mtp_own += size
            continue
        total += size
        embedding += size if top == "embed" else 0
        head += size if top in ("head", "head_bias") else 0
        inactive += size * unused_expert_share if "experts" in path else 0.0
    return _counts(total, inactive, mtp_own, embedding, head)


def mtp_active_params(cfg: ModelConfig) -> int:
    """Parameters one token uses in the MTP modules (their own, routed experts at k / E)."""
    unused = cfg.mtp_depth * cfg.n_experts * 3 * cfg.d_model * cfg.moe_ffn_dim * (1.0 - cfg.top_k / cfg.n_experts)
    return int(round(count_params(cfg)["mtp_own"] - unused))


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
    head_size = counts["head"]
    # The input lookup is free; the head matmul counts.
    matmul_params = counts["active"] - counts["embedding"]
    matmul_params += mtp_active_params(cfg) + cfg.mtp_depth * head_size
    return 6.0 * matmul_params + attention_flops_per_token(cfg, seq_len)
