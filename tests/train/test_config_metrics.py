"""TrainConfig validation, removed fields, "auto" resolved per platform, what the device chose, metric formulas, OOM
parsing, RunResult persistence (no compilation)."""

import math
import re

import pytest

from turbo_moe.model import get_config
from turbo_moe.train import RunResult, TrainConfig, learning_rate_schedule, peak_flops
from turbo_moe.train import metrics as M
from turbo_moe.train.config import (REMOVED_FIELDS, CheckpointConfig, DataConfig, OptimizerConfig,
                                    ParallelConfig)
from turbo_moe.train.step import device_choices


def test_config_roundtrip_and_resolution():
    tc = TrainConfig(model="tiny", model_overrides={"moe_path": "dense_cf", "num_experts": 8, "remat_policy": "full"},
                     steps=5, warmup_steps=1)
    again = TrainConfig.from_dict(tc.to_dict())
    assert again == tc
    cfg = tc.model_config()
    assert cfg.moe_path == "dense_cf" and cfg.remat_policy == "full" and tc.resolved_seq_len == cfg.max_seq_len
    explicit = TrainConfig(model=get_config("tiny"), steps=5, warmup_steps=1)
    assert TrainConfig.from_dict(explicit.to_dict()).model_config() == get_config("tiny")


@pytest.mark.parametrize("kwargs,match", [
    (dict(steps=0), "TrainConfig.steps"),
    (dict(per_device_batch=2.5), "TrainConfig.per_device_batch"),
    (dict(learning_rate=float("nan")), "TrainConfig.learning_rate"),
    (dict(warmup_steps=100, steps=10), "TrainConfig.warmup_steps"),
    (dict(lr_schedule_steps=3, steps=10, warmup_steps=1), "TrainConfig.lr_schedule_steps"),
    (dict(seq_len=0), "TrainConfig.seq_len: must be a positive int"),
    (dict(seq_len=32, model_overrides={"max_target_length": 64}), "TrainConfig.seq_len: 32 here and max_target_length"),
    (dict(optimizer=OptimizerConfig(), learning_rate=1e-3), "TrainConfig.learning_rate: given both flat and in "
                                                            "optimizer"),
    (dict(adam_mu_dtype="bfloat16", adam_nu_dtype=None), "TrainConfig.moments_dtype: the two AdamW moments"),
    (dict(keep_checkpoints=0), "TrainConfig.keep_checkpoints"),
    (dict(resume=True), "checkpoint_dir"),
    (dict(model="gigantic"), "unknown model preset"),
    (dict(model_overrides={"moe_path": "magic"}), "ModelConfig.moe_path"),
    (dict(model_overrides={"nonsense": 1}), "unknown ModelConfig field"),
    (dict(dataset=""), "TrainConfig.dataset"),
    (dict(progress="yes"), "TrainConfig.progress"),
])
def test_bad_configs_fail_clearly(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_sub_configs_flat_and_nested_alike():
    """The fields live in four sub-configs; flat keywords, reads, replace, from_dict and YAML-style sections reach the
    same config, and to_dict stays flat (the records read flat keys)."""
    flat = TrainConfig(model="tiny", steps=16, learning_rate=1e-3, moments_dtype="bfloat16", per_device_batch=4,
                       dataset="synthetic", expert_parallel=2, checkpoint_dir="/tmp/ckpt", keep_checkpoints=1)
    nested = TrainConfig(model="tiny", steps=16,
                         optimizer=OptimizerConfig(learning_rate=1e-3, moments_dtype="bfloat16"),
                         data=DataConfig(per_device_batch=4, dataset="synthetic"), parallel=ParallelConfig(2),
                         checkpoint=CheckpointConfig(dir="/tmp/ckpt", keep=1))
    assert flat == nested and flat.learning_rate == flat.optimizer.learning_rate == 1e-3
    assert (flat.checkpoint_dir, flat.keep_checkpoints, flat.expert_parallel) == ("/tmp/ckpt", 1, 2)
    record = flat.to_dict()
    assert "optimizer" not in record and record["learning_rate"] == 1e-3 and record["checkpoint_dir"] == "/tmp/ckpt"
    assert TrainConfig.from_dict(record) == flat
    sections = {"model": "tiny", "steps": 16, "optimizer": {"learning_rate": 1e-3, "moments_dtype": "bfloat16"},
                "data": {"per_device_batch": 4, "dataset": "synthetic"}, "parallel": {"expert_parallel": 2},
                "checkpoint": {"dir": "/tmp/ckpt", "keep": 1}}
    assert TrainConfig.from_dict(sections) == flat
    moved = flat.replace(learning_rate=2e-3, steps=18, per_device_batch=2)
    assert (moved.learning_rate, moved.steps, moved.per_device_batch, moved.dataset) == (2e-3, 18, 2, "synthetic")
    assert flat.replace(optimizer=OptimizerConfig()).learning_rate == 3e-3
    with pytest.raises(ValueError, match="TrainConfig.learning_rate: given both flat and in the optimizer section"):
        TrainConfig.from_dict({**sections, "learning_rate": 1e-3})
    with pytest.raises(ValueError, match="TrainConfig.learning_rate: given both flat and in optimizer"):
        flat.replace(optimizer=OptimizerConfig(), learning_rate=1e-3)
    with pytest.raises(ValueError, match=r"unknown TrainConfig.optimizer field 'lr'"):
        TrainConfig.from_dict({"optimizer": {"lr": 1e-3}})


def test_older_spellings_fold_into_todays_fields():
    """seq_len is the model's max_seq_len; the two moment dtypes are one field (agreeing values load)."""
    tc = TrainConfig(model="tiny", seq_len=32, adam_mu_dtype="bfloat16", adam_nu_dtype="bfloat16")
    assert tc.model_overrides == {"max_seq_len": 32} and tc.seq_len == tc.resolved_seq_len == 32
    assert tc.moments_dtype == tc.adam_mu_dtype == "bfloat16" and "seq_len" not in tc.to_dict()
    assert tc.replace(seq_len=48).model_config().max_seq_len == 48
    # new model overrides keep the sequence length, as they did while it was a field of its own
    assert tc.replace(model_overrides={"moe_path": "ragged"}).model_overrides == {"moe_path": "ragged",
                                                                                 "max_seq_len": 32}
    assert tc.replace(model_overrides={"max_target_length": 16}).seq_len == 16
    assert TrainConfig(model="tiny", seq_len=4096).model_config().max_seq_len == 4096  # a longer context: valid
    assert TrainConfig(seq_len=None) == TrainConfig()
    # an older record: mu and nu stored differently reads with the default moments (the record keeps what ran)
    old = {"model": "tiny", "seq_len": 32, "adam_mu_dtype": "bfloat16", "adam_nu_dtype": None}
    assert TrainConfig.from_record(old) == TrainConfig(model="tiny", seq_len=32)


def test_unknown_field_in_dict():
    with pytest.raises(ValueError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({"stepz": 3})


def test_top_level_remat_policy_is_the_models():
    """MaxText's top-level remat_policy: `from_dict` moves it into model_overrides (over one given there); the
    constructor has no such field, and None means the model's own."""
    tc = TrainConfig.from_dict({"model": "tiny", "remat_policy": "full",
                                "model_overrides": {"moe_path": "dense_cf", "remat_policy": "dots"}})
    assert tc.model_overrides == {"moe_path": "dense_cf", "remat_policy": "full"}
    assert tc.model_config().remat_policy == "full" and "remat_policy" not in tc.to_dict()
    assert TrainConfig.from_dict(tc.to_dict()) == tc
    assert TrainConfig.from_dict({"model": "tiny", "remat_policy": None}) == TrainConfig(model="tiny")
    with pytest.raises(ValueError, match="ModelConfig.remat_policy"):
        TrainConfig.from_dict({"model": "tiny", "remat_policy": "everything"})
    with pytest.raises(TypeError, match="remat_policy"):
        TrainConfig(model="tiny", remat_policy="full")


@pytest.mark.parametrize("name", sorted(REMOVED_FIELDS))
def test_removed_field_accepted_at_its_kept_value_only(name):
    """Old records and specs name fields that measured A/Bs removed: at the kept behaviour they load (and change
    nothing), any other value is refused with the reason, naming the field."""
    kept, why = REMOVED_FIELDS[name]
    base = {"model": "tiny", "steps": 5, "warmup_steps": 1}
    assert TrainConfig.from_dict({**base, name: kept}) == TrainConfig.from_dict(base)
    assert name not in TrainConfig.from_dict(base).to_dict()
    with pytest.raises(ValueError, match=re.escape(f"TrainConfig field {name!r} was removed ({why})")):
        TrainConfig.from_dict({**base, name: not kept})
    with pytest.raises(TypeError, match=name):
        TrainConfig(**{name: kept})


def test_old_nu_rounding_loads_where_it_names_what_runs():
    """adam_nu_rounding (removed: a bfloat16 nu is rounded stochastically): an older resolved record's "nearest" for a
    float32 nu, or "stochastic", loads; "nearest" for a bfloat16 nu is refused."""
    base = {"model": "tiny", "steps": 5, "warmup_steps": 1}
    for nu, rounding in ((None, "nearest"), ("float32", "nearest"), ("bfloat16", "stochastic"), ("auto", "auto")):
        assert TrainConfig.from_dict({**base, "adam_nu_dtype": nu, "adam_nu_rounding": rounding}) == \
            TrainConfig.from_dict({**base, "adam_nu_dtype": nu})
    for nu in ("bfloat16", "auto"):
        with pytest.raises(ValueError, match=r"TrainConfig field 'adam_nu_rounding' was removed \(a bfloat16 nu is "
                                             r"always rounded stochastically.*got 'nearest'"):
            TrainConfig.from_dict({**base, "adam_nu_dtype": nu, "adam_nu_rounding": "nearest"})
    old = {**base, "adam_nu_dtype": "bfloat16", "adam_nu_rounding": "nearest"}
    assert TrainConfig.from_record(old) == TrainConfig.from_dict({**base, "adam_nu_dtype": "bfloat16"})


def test_from_record_reads_an_older_runs_config_with_removed_fields():
    """A record written before fields were removed loads for reading history, whatever values it held."""
    old = {"model": "tiny", "steps": 5, "warmup_steps": 1, "xla_gpu_autotune_level": 0,
           "model_overrides": {"scan_layers": False, "router_init_std": 0.0625, "moe_path": "dense_cf"}}
    assert TrainConfig.from_record(old) == TrainConfig(model="tiny", steps=5, warmup_steps=1,
                                                       model_overrides={"moe_path": "dense_cf"})
    nested = {"model": {**get_config("tiny").to_dict(), "embedding_init_std": 1.0}, "steps": 5, "warmup_steps": 1}
    assert TrainConfig.from_record(nested).model_config() == get_config("tiny")
    with pytest.raises(ValueError, match="xla_gpu_autotune_level"):
        TrainConfig.from_dict(old)


def test_old_router_fields_in_a_train_config():
    """The router fields router_recipe replaced, in a run spec's model_overrides: a recipe's values (over the preset's
    recipe) name it; other values are refused to run and read as the preset's recipe from a record."""
    reduced = TrainConfig(model="reduced", model_overrides={"router_lr_scale": 0.1})
    assert reduced.model_config() == get_config("reduced")
    assert TrainConfig(model="reduced", model_overrides={"router_lr_scale": 1.0, "head_bias": "none",
                                                         "zero_init_out_proj": False, "router_bias_update": "sign",
                                                         "router_center_causal": False,
                                                         "router_seq_load_penalty": 0.0}
                       ).model_config().router_recipe == "deepseek_v3"
    old = {"model": "reduced", "steps": 5, "warmup_steps": 1, "model_overrides": {"router_center_causal": False}}
    with pytest.raises(ValueError, match=r"\['router_center_causal'\] were replaced by router_recipe.*"
                                         r"on top of router_recipe 'short_run'"):
        TrainConfig.from_dict(old)
    assert TrainConfig.from_record(old).model_config() == get_config("reduced")


def test_removed_model_fields_in_a_train_config():
    """A run spec's model part takes the same rule (ModelConfig.from_dict), as overrides or as a whole model dict."""
    model = {**get_config("tiny").to_dict(), "cast_params_before_scan": True, "expert_backward": "block"}
    assert TrainConfig.from_dict({"model": model}).model_config() == get_config("tiny")
    assert TrainConfig(model="tiny", model_overrides={"embedding_grad": "segment"}).model_config() == get_config("tiny")
    with pytest.raises(ValueError, match="ModelConfig field 'expert_backward' was removed"):
        TrainConfig(model="tiny", model_overrides={"expert_backward": "autodiff"})


AUTO_FIELDS = ("master_weights", "adam_mu_dtype", "adam_nu_dtype")


def test_auto_fields_resolve_per_platform():
    tc = TrainConfig(model="tiny", steps=5, warmup_steps=1, learning_rate=3e-3)  # no recipe value left to resolve
    assert tuple(getattr(tc, f) for f in AUTO_FIELDS) == ("auto",) * 3
    cpu, gpu = tc.resolved("cpu"), tc.resolved("gpu")
    assert tuple(getattr(cpu, f) for f in AUTO_FIELDS) == ("float32", None, None)
    assert tuple(getattr(gpu, f) for f in AUTO_FIELDS) == ("split", "bfloat16", "bfloat16")
    for resolved in (cpu, gpu):
        assert resolved.replace(master_weights="auto", moments_dtype="auto") == tc  # nothing else changes
        assert resolved.resolved("gpu") == resolved.resolved("cpu") == resolved  # nothing left to resolve
    assert tc.resolved() == cpu  # JAX's backend: the CPU here
    # explicit choices stay; split masters need a bf16 model with float32 params
    explicit = tc.replace(master_weights="float32", moments_dtype=None)
    assert explicit.resolved("gpu") == explicit
    assert tc.replace(model_overrides={"dtype": "float32"}).resolved("gpu").master_weights == "float32"


def test_device_choices_say_what_the_defaults_run():
    """A run records these (provenance["device_choices"]): the device-dependent choices that no field names."""
    cpu = {"platform": "cpu", "attention": "xla", "swiglu_kernels": False, "router_topk_kernel": False,
           "scan_outputs_uninitialized": False}
    assert device_choices(get_config("tiny"), "cpu") == cpu == device_choices(get_config("tiny"))
    gpu = device_choices(get_config("tiny"), "gpu")
    assert gpu["platform"] == "gpu" and gpu["attention"] in ("cudnn_unpadded", "cudnn")  # cudnn: JAX without the entry
    assert gpu["swiglu_kernels"] and gpu["router_topk_kernel"]
    assert not device_choices(get_config("tiny", moe_path="ragged"), "gpu")["swiglu_kernels"]  # turbo's GEMM only
    assert device_choices(get_config("tiny", dtype="float32"), "gpu")["attention"] == "xla"  # cuDNN: bf16/f16 only
    # Several devices: XLA would partition the uninitialised buffer as a global one cut per device (a copy)
    assert not device_choices(get_config("tiny"), "gpu", devices=2)["scan_outputs_uninitialized"]


def test_schedule_warms_up_then_decays():
    schedule = learning_rate_schedule(TrainConfig(learning_rate=1.0, warmup_steps=4, steps=20, min_lr_ratio=0.1))
    values = [float(schedule(s)) for s in range(21)]
    assert values[0] == 0.0 and values[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[4:], values[5:])) and values[20] == pytest.approx(0.1)


def test_peak_flops_table_names_its_source():
    assert peak_flops("NVIDIA H100 80GB HBM3", "gpu")[0] == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "gpu")[0] == 756e12
    value, source = peak_flops("NVIDIA H200", "gpu")
    assert value == 989e12 and "dense bf16" in source
    assert peak_flops("NVIDIA A100-SXM4-80GB", "gpu")[0] == 312e12
    value, source = peak_flops("cpu", "cpu")
    assert math.isnan(value) and source.startswith("unknown (cpu")


def test_tgs_leaves_out_the_first_steps_or_half_a_short_run():
    assert M.timed_steps(list(range(40))) == list(range(M.TGS_SKIP_STEPS, 40))
    assert M.timed_steps([9.0, 1.0, 1.0]) == [1.0, 1.0] and M.timed_steps([2.0]) == [2.0] and M.timed_steps([]) == []


def test_tgs_and_mfu_formulas():
    assert M.tokens_per_device_per_second(1000, [0.5, 1.5]) == pytest.approx(1000.0)  # 2000 tokens in 2 s
    assert math.isnan(M.tokens_per_device_per_second(1000, []))
    assert M.model_flops_utilization(6e9, 1000.0, 1e13) == pytest.approx(0.6)
    assert math.isnan(M.model_flops_utilization(6e9, 1000.0, math.nan))


def test_load_imbalance():
    mean_ratio, worst, per_layer = M.load_imbalance([[1, 1, 1, 1], [4, 0, 0, 0]])
    assert per_layer == [1.0, 4.0] and mean_ratio == 2.5 and worst == 4.0
    assert math.isnan(M.load_imbalance([])[0])


@pytest.mark.parametrize("message,expected", [
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes.", 17179869184),
    ("RESOURCE_EXHAUSTED: Failed to allocate request for 4.00GiB (4294967296B) on device ordinal 0",
     4294967296),
    ("XlaRuntimeError: something else", None),
])
def test_oom_message_parsing(message, expected):
    assert M.requested_bytes(message) == expected
    assert M.is_oom(RuntimeError(message)) == (expected is not None)


def test_run_result_roundtrip(tmp_path):
    result = RunResult(status="nan", error="non-finite loss (nan) at step 3",
                       history=[{"step": 0, "loss": 1.5, "eval_loss": math.nan}], summary={"tgs": 10.0},
                       expert_load=[[1.0, 2.0]], provenance={"jax_version": "x"})
    loaded = RunResult.load(result.save(tmp_path / "r.json"))
    assert loaded.status == "nan" and math.isnan(loaded.history[0]["eval_loss"])
    assert loaded.history_frame().loc[0, "loss"] == 1.5
    with pytest.raises(ValueError, match="status"):
        RunResult(status="fine")


def test_paths_are_stored_as_str(tmp_path):
    tc = TrainConfig(dataset=tmp_path / "corpus.jsonl", checkpoint_dir=tmp_path / "ckpt", steps=5, warmup_steps=1)
    assert tc.dataset == str(tmp_path / "corpus.jsonl") and isinstance(tc.checkpoint_dir, str)
    import json

    json.dumps(tc.to_dict())
