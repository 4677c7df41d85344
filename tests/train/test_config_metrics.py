"""TrainConfig validation, metric formulas, OOM parsing, RunResult persistence (no compilation)."""

import math

import pytest

from turbo_moe.model import get_config
from turbo_moe.train import RunResult, TrainConfig, learning_rate_schedule, peak_flops
from turbo_moe.train import metrics as M


def test_config_roundtrip_and_resolution():
    tc = TrainConfig(model="tiny", model_overrides={"moe_path": "dense_cf", "num_experts": 8}, steps=5,
                     warmup_steps=1, remat_policy="full")
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
    (dict(seq_len=4096), "max_seq_len"),
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


def test_unknown_field_in_dict():
    with pytest.raises(ValueError, match="unknown TrainConfig field"):
        TrainConfig.from_dict({"stepz": 3})


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
