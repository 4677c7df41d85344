"""benchmarks/runs_table.py: train_once records -> tidy rows (regime, measured vs predicted memory)."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runs_table():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("runs_table", ROOT / "benchmarks" / "runs_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(loads, status="ok", measured=40 * 2**30):
    config = {"model": "reduced", "dataset": "synthetic", "seq_len": 2048, "per_device_batch": 8, "steps": len(loads),
              "warmup_steps": 1, "adam_mu_dtype": "bfloat16", "model_overrides": {"moe_path": "turbo"}}
    return {"config": config, "status": status, "error": None,
            "summary": {"tgs": 9e4, "mfu": 0.24, "step_time_s": 0.175, "compiled_total_bytes": measured},
            "provenance": {"device_kind": "NVIDIA H200", "jax_version": "0.11.2", "git_commit": "abc"},
            "history": [{"step": i, "loss": 1.0, "load_max_over_mean": x} for i, x in enumerate(loads)]}


def test_regime_is_read_from_the_timed_steps_only(runs_table):
    # steps 0-2 are skipped (the run's skip_steps_for_tgs, 3): their 10.7 must not make the run "collapsed"
    load, regime = runs_table._regime(_record([10.7, 10.7, 10.7, 1.5, 1.8, 1.6])["history"], 3)
    assert load == pytest.approx(1.6) and regime == "balanced (<= 2)"
    assert runs_table._regime(_record([1.0, 1.0, 1.0, 9.0, 8.0, 7.5])["history"], 3)[1] == "collapsed (> 5)"
    assert runs_table._regime([], 3)[1] == "unknown"


def test_row_resolves_defaults_and_compares_memory(runs_table, tmp_path):
    from turbo_moe.experiments import accounting
    from turbo_moe.experiments.accounting import memory_prediction
    from turbo_moe.model import get_config

    path = tmp_path / "cuts" / "0_turbo.json"
    path.parent.mkdir()
    record = _record([1.5] * 8)
    path.write_text(json.dumps(record))
    row = runs_table.row(record, path)
    assert row["run"] == "cuts/0_turbo" and row["moe_path"] == "turbo"
    # no resolved configs in this record's provenance: what its config set, the rest not recorded (not today's defaults)
    assert row["remat_policy"] is None and "remat_policy" in row["switches_not_recorded"].split()
    assert row["adam_mu_dtype"] == "bfloat16" and row["step_ms"] == pytest.approx(175.0)
    expected = sum(memory_prediction(get_config("reduced", moe_path="turbo"), 8, 2048, adam_mu_dtype="bfloat16").values())
    assert row["predicted_gib"] == pytest.approx(expected / 2**30)
    assert row["predicted_over_measured"] == pytest.approx(row["predicted_gib"] / 40)
    # a bf16 second moment: listed as a switch, 2 bytes a parameter less predicted
    nu_record = {**record, "config": {**record["config"], "adam_nu_dtype": "bfloat16"}}
    nu_row = runs_table.row(nu_record, path)
    assert row["adam_nu_dtype"] is None and nu_row["adam_nu_dtype"] == "bfloat16"
    params = accounting.param_budget(get_config("reduced", moe_path="turbo"))["allocated (with MTP)"]
    assert row["predicted_gib"] - nu_row["predicted_gib"] == pytest.approx(2 * params / 2**30)
    assert runs_table._switch_label("adam_nu_dtype", "bfloat16") == " nu=bfloat16"
    failed = {**_record([1.0] * 4, status="oom", measured=None), "history": []}
    oom = runs_table.row(failed, path)
    assert oom["measured_gib"] is None and math.isnan(oom["load_max_over_mean_timed"])


def test_switches_are_the_runs_own_not_todays_defaults(runs_table, tmp_path):
    from turbo_moe.model import get_config
    from turbo_moe.train import TrainConfig

    path = tmp_path / "old" / "0_turbo.json"
    path.parent.mkdir()
    record = _record([1.5] * 8)
    # as an older run recorded them: swiglu_impl "xla" (a field since decided and removed); no logits_dtype field then
    model = {**{k: v for k, v in vars(get_config("reduced", moe_path="turbo")).items() if k != "logits_dtype"},
             "swiglu_impl": "xla", "cast_params_before_scan": True, "router_topk_impl": "kernel",
             "expert_backward": "block", "embedding_grad": "segment", "router_center_causal": True,
             "router_seq_load_penalty": 0.1, "attention_impl": "auto"}
    train = {**TrainConfig.from_dict({"progress": False, **record["config"]}).to_dict(),
             "cast_params_in_update": False, "scan_outputs_uninitialized": True, "adam_nu_rounding": "stochastic"}
    record["provenance"] = {**record["provenance"], "model_config": model, "config": train}
    row = runs_table.row(record, path)
    assert row["swiglu_impl"] == "xla" and row["remat_policy"] == get_config("reduced").remat_policy
    assert row["adam_mu_dtype"] == "bfloat16" and row["adam_nu_rounding"] == "stochastic"
    assert (row["router_center_causal"], row["router_seq_load_penalty"]) == (True, 0.1)
    assert row["logits_dtype"] is None and row["switches_not_recorded"] == "logits_dtype"
