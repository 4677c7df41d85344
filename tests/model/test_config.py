"""ModelConfig: presets, dict/YAML round trips, MaxText aliases, removed fields, and errors that name the field."""

import re

import pytest

from turbo_moe.model import PRESET_NAMES, ModelConfig, get_config
from turbo_moe.model.config import EP_LAYOUTS, REMOVED_FIELDS


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_validate_and_round_trip(name):
    cfg = get_config(name)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.replace(moe_path="dense_cf").moe_path == "dense_cf"


def test_671b_preset_is_the_public_architecture():
    c = get_config("deepseek_v3_671b")
    assert (c.vocab_size, c.d_model, c.n_layers, c.n_dense_layers, c.dense_ffn_dim) == (129280, 7168, 61, 3, 18432)
    assert (c.n_experts, c.moe_ffn_dim, c.n_shared_experts, c.top_k) == (256, 2048, 1, 8)
    assert (c.n_groups, c.topk_groups, c.routed_scaling_factor, c.n_heads) == (8, 4, 2.5, 128)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert c.mtp_depth == 1


def test_maxtext_aliases_and_overrides():
    cfg = get_config("tiny", num_experts=16, num_experts_per_tok=4, emb_dim=32, moe_path="turbo")
    assert (cfg.n_experts, cfg.top_k, cfg.d_model, cfg.moe_path) == (16, 4, 32, "turbo")
    assert cfg.replace(num_experts=4, top_k=2).n_experts == 4


def test_from_yaml_text_and_file(tmp_path):
    text = "preset: tiny\nnum_experts: 16\ncapacity_factor: '2.0'\nmoe_path: dense_cf\n"
    cfg = ModelConfig.from_yaml(text)
    assert (cfg.n_experts, cfg.capacity_factor, cfg.moe_path) == (16, 2.0, "dense_cf")
    path = tmp_path / "model.yaml"
    path.write_text("vocab_size: 100\nd_model: 32\n")
    assert ModelConfig.from_yaml(str(path)).vocab_size == 100


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(top_k=9), "top_k"),  # k > experts
        (dict(n_groups=3), "n_groups"),  # groups do not divide experts
        (dict(topk_groups=5), "topk_groups"),
        (dict(top_k=5, topk_groups=2), "top_k"),  # more than the selected groups hold
        (dict(moe_path="megablox"), "moe_path"),
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),  # RoPE needs pairs
        (dict(n_dense_layers=4), "n_dense_layers"),
        (dict(d_model=0), "d_model"),
        (dict(dtype="int8"), "dtype"),
        (dict(remat_policy="everything"), "remat_policy"),
        (dict(capacity_factor=float("nan")), "capacity_factor"),
        (dict(router_bias_rate=-1.0), "router_bias_rate"),
        (dict(ep_layout="sparse"), "ep_layout"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        get_config("tiny", **overrides)


def test_moe_path_auto_resolves_where_a_path_is_named(tmp_path):
    """"auto" is the device's fastest dropless path, in a preset override, a YAML file and the path table alike; an
    unknown name is one ConfigError for field moe_path, from the config and from the table."""
    import jax

    from turbo_moe.model.config import resolve_moe_path
    from turbo_moe.model.paths import path_row
    from turbo_moe.validation import ConfigError

    fastest = resolve_moe_path("auto")
    assert fastest == ("turbo" if jax.default_backend() == "cpu" else fastest)  # the CPU library is always built
    assert resolve_moe_path("dense_cf") == "dense_cf"
    (tmp_path / "m.yaml").write_text("moe_path: auto\n")
    assert get_config("tiny", moe_path="auto").moe_path == fastest
    assert ModelConfig.from_yaml(str(tmp_path / "m.yaml")).moe_path == fastest
    assert get_config("tiny", moe_path="ragged").replace(moe_path="auto").moe_path == fastest
    assert path_row("auto") == path_row(fastest)
    for build in (lambda: get_config("tiny", moe_path="raged"), lambda: path_row("raged")):
        with pytest.raises(ConfigError, match="unknown MoE path 'raged'; expected one of .* or 'auto'") as err:
            build()
        assert (err.value.field, err.value.value) == ("moe_path", "raged")


def test_unknown_field_and_wrong_type():
    with pytest.raises(ValueError, match="n_expertz"):
        ModelConfig.from_dict({"n_expertz": 4})
    with pytest.raises(TypeError, match="n_experts"):
        get_config("tiny", n_experts="many")
    with pytest.raises(TypeError, match="top_k"):
        get_config("tiny", top_k=2.5)
    with pytest.raises(ValueError, match="preset"):
        get_config("deepseek_v4")


def test_defaults_are_the_decided_ones():
    """The fast path by default: turbo, deepep's own layout choice; the GPU presets chunk the loss in bf16 logits."""
    cfg = ModelConfig()
    assert (cfg.moe_path, cfg.ep_layout) == ("turbo", "auto")
    reduced, full = get_config("reduced"), get_config("deepseek_v3_671b")
    assert (reduced.remat_policy, reduced.loss_chunk_tokens, reduced.logits_dtype) == (
        "dots_experts_attention", 4096, "bfloat16")
    assert (full.loss_chunk_tokens, full.logits_dtype) == (4096, "bfloat16")
    assert set(EP_LAYOUTS) == {"auto", "dense", "packed", "ragged"}
    for layout in EP_LAYOUTS:
        assert get_config("tiny", ep_layout=layout).ep_layout == layout


# A value each removed field had as an alternative to the one kept.
OTHER_VALUES = {"cast_params_before_scan": False, "router_topk_impl": "cuda", "embedding_grad": "matmul",
                "expert_backward": "autodiff", "swiglu_impl": "cutlass", "router_center_ema": 0.3,
                "router_bias_rate_start": 1e-2, "router_bias_rate_decay_steps": 100, "embedding_init_std": 0.006,
                "router_init_std": 256 ** -0.5, "scan_layers": False, "rms_norm_eps": 1e-5, "rope_theta": 5e5,
                "attention_impl": "cudnn", "tie_embeddings": True, "ep_micro_batches": 2,
                "block_micro_batches": 2}


def test_every_removed_field_is_covered():
    assert set(OTHER_VALUES) == set(REMOVED_FIELDS)


@pytest.mark.parametrize("name", sorted(REMOVED_FIELDS))
def test_removed_field_accepted_at_its_kept_value_only(name):
    """Old records and specs name fields that measured A/Bs removed: at the kept behaviour they load (and change
    nothing), any other value is refused with the reason, naming the field."""
    kept, why = REMOVED_FIELDS[name]
    base = get_config("tiny")
    assert name not in base.to_dict()
    assert ModelConfig.from_dict({**base.to_dict(), name: kept}) == base
    assert get_config("tiny", **{name: kept}) == base == base.replace(**{name: kept})
    with pytest.raises(ValueError, match=re.escape(f"ModelConfig field {name!r} was removed ({why}); got "
                                                   f"{OTHER_VALUES[name]!r}")):
        ModelConfig.from_dict({**base.to_dict(), name: OTHER_VALUES[name]})


def test_removed_fields_old_spellings():
    """The old explicit values that name what now runs on some device load too; a number where a bool was kept,
    does not."""
    base = get_config("tiny")
    for name in ("swiglu_impl", "router_topk_impl"):
        for value in ("xla", "kernel"):
            assert get_config("tiny", **{name: value}) == base
    for value in ("xla", "cudnn_unpadded"):  # what attention "auto" runs on the CPU and on a GPU
        assert get_config("tiny", attention_impl=value) == base
    # MaxText's key for tied embeddings, at DeepSeek-V3's (untied) value
    assert get_config("tiny", logits_via_embedding=False) == base
    with pytest.raises(ValueError, match="'tie_embeddings' was removed.*got True"):
        get_config("tiny", logits_via_embedding=True)
    with pytest.raises(ValueError, match="ModelConfig field 'cast_params_before_scan' was removed.*got 1"):
        get_config("tiny", cast_params_before_scan=1)
    with pytest.raises(TypeError):  # the constructor has no such field
        ModelConfig(expert_backward="block")
    # MaxText's key for the norm epsilon, and YAML's reading of 1e-6 (a str: no dot), at DeepSeek-V3's value
    assert ModelConfig.from_yaml("preset: tiny\nnormalization_layer_epsilon: 1e-6\n") == base
    with pytest.raises(ValueError, match="'rms_norm_eps' was removed.*got 1e-05"):
        get_config("tiny", normalization_layer_epsilon=1e-5)


def test_the_init_and_norm_constants_the_removed_fields_fixed():
    cfg = get_config("tiny", d_model=256, init_std=0.006)
    assert (cfg.embedding_std, cfg.router_std, cfg.rms_norm_eps, cfg.rope_theta) == (256 ** -0.5, 0.006, 1e-6, 1e4)
    assert cfg.balance_loss_weight == cfg.router.balance_loss_weight == 1e-4


def test_from_record_reads_an_older_runs_config_with_removed_fields():
    """History stays readable: a record written before a field was removed loads, the field dropped, whatever
    value it held; a config to run (`from_dict`) still refuses the losing value."""
    from turbo_moe.model.config import ModelConfig, get_config

    old = {**get_config("tiny").to_dict(), "cast_params_before_scan": False, "embedding_grad": "scatter"}
    assert ModelConfig.from_record(old) == get_config("tiny")
    with pytest.raises(ValueError, match="cast_params_before_scan"):
        ModelConfig.from_dict(old)
