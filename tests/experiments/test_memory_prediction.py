"""accounting.memory_prediction: the terms behave as the remat policies and batch say (the GPU check of
the absolute numbers is benchmarks/memory_check.py, campaign memory_check_nvidia_h100_80gb_hbm3 of the store)."""
from __future__ import annotations

import pytest

from turbo_moe.experiments import accounting
from turbo_moe.model import get_config

UNCHUNKED = dict(loss_chunk_tokens=0, logits_dtype="float32")  # the loss over whole-batch float32 logits


def _total(cfg, batch, seq=2048):
    return sum(accounting.memory_prediction(cfg, batch, seq).values())


def test_remat_policies_order_saved_values():
    saved = {policy: accounting.memory_prediction(get_config("reduced", remat_policy=policy), 8, 2048)["saved layers"]
             for policy in ("full", "dots_no_batch", "dots_experts_attention", "none")}
    assert saved["full"] < saved["dots_no_batch"] < saved["dots_experts_attention"] < saved["none"]
    # full keeps exactly each block's bf16 input: blocks x tokens x d_model x 2 bytes
    cfg = get_config("reduced", remat_policy="full")
    assert saved["full"] == pytest.approx((cfg.n_layers + cfg.mtp_depth) * 8 * 2048 * cfg.d_model * 2)


def test_activations_scale_with_batch_states_do_not():
    cfg = get_config("reduced", moe_path="turbo", **UNCHUNKED)
    two, eight = (accounting.memory_prediction(cfg, b, 2048) for b in (2, 8))
    assert two["states"] == eight["states"]
    for term in ("saved layers", "live layer", "logits"):
        assert eight[term] == pytest.approx(4 * two[term])


def test_dense_cf_needs_more_than_dropless_and_sharding_divides_states():
    turbo = get_config("reduced", moe_path="turbo")
    dense = get_config("reduced", moe_path="dense_cf", capacity_factor=1.25)
    assert _total(dense, 8) > _total(turbo, 8)
    mesh = accounting.MeshShape(data=4, expert=2)
    sharded = accounting.memory_prediction(turbo, 8, 2048, mesh)["states"]
    assert sharded == pytest.approx(accounting.memory_prediction(turbo, 8, 2048)["states"] / 8)


def test_unknown_path_is_refused():
    with pytest.raises(ValueError, match="path"):
        accounting.activation_bytes_per_device(get_config("reduced"), "nope", accounting.MeshShape(), 8, 2048)


def test_issue14_switches_move_their_terms():
    cfg = get_config("reduced", moe_path="turbo", **UNCHUNKED)
    base = accounting.memory_prediction(cfg, 8, 2048)
    # bf16 first moment: 2 bytes less per parameter, only in the states
    bf16_mu = accounting.memory_prediction(cfg, 8, 2048, adam_mu_dtype="bfloat16")
    params = accounting.param_budget(cfg)["allocated (with MTP)"]
    assert base["states"] - bf16_mu["states"] == pytest.approx(2 * params)
    assert accounting.memory_prediction(cfg, 8, 2048, adam_mu_dtype="float32") == base
    with pytest.raises(ValueError, match="adam_mu_dtype"):
        accounting.memory_prediction(cfg, 8, 2048, adam_mu_dtype="float16")
    # bf16 second moment (adam_nu_dtype): 2 bytes less per parameter again, only in the states; both: 4 less
    bf16_nu = accounting.memory_prediction(cfg, 8, 2048, adam_nu_dtype="bfloat16")
    assert base["states"] - bf16_nu["states"] == pytest.approx(2 * params)
    assert {k: bf16_nu[k] for k in base if k != "states"} == {k: base[k] for k in base if k != "states"}
    both = accounting.memory_prediction(cfg, 8, 2048, adam_mu_dtype="bfloat16", adam_nu_dtype="bfloat16")
    assert base["states"] - both["states"] == pytest.approx(4 * params)
    assert accounting.memory_prediction(cfg, 8, 2048, adam_nu_dtype="float32") == base
    with pytest.raises(ValueError, match="adam_nu_dtype"):
        accounting.memory_prediction(cfg, 8, 2048, adam_nu_dtype="float16")
    # chunked loss: one chunk of 4096 tokens (8 x 512 positions) instead of every head's 16k x V logits
    chunked = accounting.memory_prediction(cfg.replace(loss_chunk_tokens=4096), 8, 2048)
    v, d, heads = cfg.vocab_size, cfg.d_model, 1 + cfg.mtp_depth
    expected = 4096 * v * (4 + 4 + 2) + heads * (8 * 2048 * d + d * v) * 4
    assert chunked["logits"] == pytest.approx(expected) and chunked["logits"] < base["logits"] / 3
    assert {k: chunked[k] for k in base if k != "logits"} == {k: base[k] for k in base if k != "logits"}
    # bf16 logits (ModelConfig.logits_dtype): the chunk's logits as the head GEMM writes them, 2 B instead of 4
    bf16_logits = accounting.memory_prediction(cfg.replace(loss_chunk_tokens=4096, logits_dtype="bfloat16"), 8, 2048)
    assert chunked["logits"] - bf16_logits["logits"] == pytest.approx(4096 * v * 2)
    assert accounting.memory_prediction(get_config("reduced", moe_path="turbo"), 8, 2048) == bf16_logits  # the preset


def test_states_follow_the_param_dtype_as_optax_keeps_them():
    """optax keeps the second moment (and, without mu_dtype, the first) in the parameters' dtype: bf16
    params -> params + grads + mu + nu = 8 B per parameter; a float32 mu on top -> 10 B."""
    cfg = get_config("reduced", moe_path="turbo", param_dtype="bfloat16")
    params = accounting.param_budget(cfg)["allocated (with MTP)"]
    assert accounting.memory_prediction(cfg, 8, 2048)["states"] == pytest.approx(8 * params)
    assert accounting.memory_prediction(cfg, 8, 2048, adam_mu_dtype="float32")["states"] == pytest.approx(10 * params)
    both = accounting.memory_prediction(cfg, 8, 2048, adam_mu_dtype="float32", adam_nu_dtype="float32")
    assert both["states"] == pytest.approx(12 * params)
    f32 = get_config("reduced", moe_path="turbo")
    assert accounting.memory_prediction(f32, 8, 2048)["states"] == pytest.approx(16 * params)


def test_expert_block_keeps_less_than_autodiff_by_its_residuals():
    """The expert block (the paths with the permute exchange: turbo, pallas) keeps per copy only the gate/up output,
    plus the tokens: the permuted rows (d), SwiGLU output (F) and down output (d) of every copy less than the ops' own
    VJPs keep (ragged, through ragged_dot); on any mesh (under EP it wraps each rank's experts)."""
    def saved(path, mesh=None):
        cfg = get_config("reduced", moe_path=path, remat_policy="dots_experts_attention", dtype="bfloat16")
        return cfg, accounting.memory_prediction(cfg, 8, 2048, mesh)["saved layers"]

    cfg, autodiff = saved("ragged")
    _, block = saved("turbo")
    assert saved("pallas")[1] == block
    per_token = cfg.top_k * (2 * cfg.d_model + cfg.moe_ffn_dim) - cfg.d_model  # bf16 values a token no longer keeps
    moe_blocks = cfg.n_layers - cfg.n_dense_layers + cfg.mtp_depth
    assert autodiff - block == pytest.approx(moe_blocks * 8 * 2048 * per_token * 2)
    for mesh in (accounting.MeshShape(expert=2), accounting.MeshShape(data=2)):
        assert saved("turbo", mesh)[1] == block and saved("ragged", mesh)[1] == autodiff


def test_split_master_weights_need_no_term_and_auto_is_refused():
    """master_weights="split" stores each stacked float32 master as bf16 + 16 low bits: the states' 4 bytes, no term of
    its own. The moments' dtypes are the resolved TrainConfig fields: "auto" means nothing until resolved."""
    cfg = get_config("reduced", moe_path="turbo")
    assert set(accounting.memory_prediction(cfg, 8, 2048)) == {"states", "saved layers", "live layer", "logits"}
    for name in ("adam_mu_dtype", "adam_nu_dtype"):
        with pytest.raises(ValueError, match=f"{name} must be None, 'bfloat16' or 'float32' .*TrainConfig.resolved"):
            accounting.memory_prediction(cfg, 8, 2048, **{name: "auto"})


def test_the_live_block_rebuilds_only_what_it_did_not_save():
    """The block whose backward runs holds its saved values (counted in "saved layers") and rebuilds the rest of its
    working set: nothing under "none", all but its input under "full", less than the whole set in between."""
    def live(policy):
        cfg = get_config("reduced", moe_path="turbo", remat_policy=policy)
        working = (accounting.moe_working_set_bytes(cfg, "turbo", 8, 2048)
                   + accounting.attention_working_set_bytes(cfg, 8, 2048))
        return accounting.memory_prediction(cfg, 8, 2048)["live layer"], working, cfg

    assert live("none")[0] == 0
    got, working, cfg = live("full")
    assert got == pytest.approx(working - 8 * 2048 * cfg.d_model * 2)
    got, working, _ = live("dots_experts_attention")
    assert 0 <= got < 0.5 * working
