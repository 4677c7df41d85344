"""Parameter counts via eval_shape (no allocation) against closed-form counts, and FLOPs per token."""

import pytest

from turbo_moe.model import count_params, flops_per_token, get_config
from turbo_moe.model.accounting import count_params_from_shapes, mtp_active_params


def closed_form_counts(c):
    """Counts written directly from the architecture (independent of the module code)."""
    d, h = c.d_model, c.n_heads
    q = (d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * h * c.qk_head_dim) if c.q_lora_rank else d * h * c.qk_head_dim
    attention = (q + d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank
                 + c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim) + h * c.v_head_dim * d)
    norms = 2 * d
    dense_ffn = 3 * d * c.dense_ffn_dim
    expert = 3 * d * c.moe_ffn_dim
    moe_ffn = (c.n_experts + c.n_shared_experts) * expert + d * c.n_experts  # + router
    moe_active = (c.top_k + c.n_shared_experts) * expert + d * c.n_experts
    embedding = c.vocab_size * d
    head = c.vocab_size * d + (c.vocab_size if c.router.head_bias != "none" else 0)
    n_moe = c.n_layers - c.n_dense_layers
    base = embedding + head + d + c.n_layers * (attention + norms) + c.n_dense_layers * dense_ffn
    mtp_own = c.mtp_depth * (2 * d + 2 * d * d + attention + norms + d + moe_ffn)
    return {"total": base + n_moe * moe_ffn, "active": base + n_moe * moe_active,
            "mtp": mtp_own + embedding + head, "mtp_own": mtp_own}


@pytest.mark.parametrize("name, overrides", [
    ("tiny", {}), ("tiny", dict(q_lora_rank=0, mtp_depth=2, n_shared_experts=2)),
    ("tiny", dict(n_shared_experts=0, mtp_depth=0, n_dense_layers=0)), ("small", {}), ("reduced", {}),
    ("reduced", dict(router_recipe="deepseek_v3")), ("deepseek_v3_671b", {})])
def test_counts_match_closed_form_and_the_models_shapes(name, overrides):
    cfg = get_config(name, **overrides)
    counts = count_params(cfg)
    for key, value in closed_form_counts(cfg).items():
        assert counts[key] == value, key
    assert count_params_from_shapes(cfg) == counts  # the library's arithmetic is the model's (eval_shape)
    assert counts["total_with_mtp"] == counts["total"] + counts["mtp_own"]
    expert = 3 * cfg.d_model * cfg.moe_ffn_dim
    assert mtp_active_params(cfg) == counts["mtp_own"] - cfg.mtp_depth * (cfg.n_experts - cfg.top_k) * expert


def test_reduced_is_sized_for_one_gpu():
    counts = count_params(get_config("reduced"))
    assert 1e9 <= counts["total"] <= 3e9
    assert counts["active"] < counts["total"] / 4


def test_small_is_a_cpu_model():
    cfg = get_config("small")
    counts = count_params(cfg)
    assert 8e6 <= counts["total"] and counts["total_with_mtp"] <= 20e6
    assert flops_per_token(cfg, 128) * 8 * 128 < 25e9  # a training step at batch 8 stays small on 2 cores


def test_deepseek_v3_671b_counts_without_allocating():
    # 671e9 float32 parameters would be 2.7 TB: this only works because eval_shape allocates nothing.
    cfg = get_config("deepseek_v3_671b")
    counts = count_params(cfg)
    exact = closed_form_counts(cfg)
    for key in ("total", "active", "mtp"):
        assert abs(counts[key] / exact[key] - 1) < 0.01, key
    # Published headline figures: 671B total, 37B activated, 685B - 671B = 14B MTP (checkpoint convention).
    # The exact counts are 671.03B, 37.55B (embedding and head included) and 13.46B: the last two
    # headlines are rounded, hence the wider tolerances there.
    assert abs(counts["total"] / 671e9 - 1) < 0.01
    assert abs(counts["active"] / 37e9 - 1) < 0.02
    assert abs(counts["mtp"] / 14e9 - 1) < 0.05
    assert abs((counts["total"] + counts["mtp"]) / 685e9 - 1) < 0.01


def test_flops_per_token_is_six_times_matmul_params_plus_attention():
    cfg = get_config("tiny")
    counts = count_params(cfg)
    exact = closed_form_counts(cfg)
    expert = 3 * cfg.d_model * cfg.moe_ffn_dim
    mtp_active = exact["mtp_own"] - cfg.mtp_depth * (cfg.n_experts - cfg.top_k) * expert
    matmul = counts["active"] - counts["embedding"] + mtp_active + cfg.mtp_depth * counts["head"]
    seq = 32
    attention = 3 * (cfg.n_layers + cfg.mtp_depth) * seq * cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    assert flops_per_token(cfg, seq) == pytest.approx(6 * matmul + attention)
    assert flops_per_token(cfg, 2 * seq) > flops_per_token(cfg, seq)
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(cfg, 0)
