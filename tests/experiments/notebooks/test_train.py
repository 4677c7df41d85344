"""The helpers 02_train calls, without a kernel: parameter validation and the run plots."""

import math

import matplotlib
import pytest

matplotlib.use("Agg")

from turbo_moe.experiments.notebooks import train as nb  # noqa: E402

BASE = dict(model="tiny", moe_path="ragged", per_device_batch=2, steps=3, warmup_steps=1, seq_len=32)


def test_train_config_routes_path_and_capacity_into_model():
    tc = nb.train_config(**{**BASE, "moe_path": "dense_cf"}, capacity_factor=2.0,
                         model_overrides={"n_layers": 2}, train_overrides={"eval_every": 0})
    cfg = tc.model_config()
    assert (cfg.moe_path, cfg.capacity_factor, cfg.n_layers, tc.eval_every) == ("dense_cf", 2.0, 2, 0)
    assert nb.train_config(**BASE, capacity_factor=None).model_config().capacity_factor == 1.25
    table = nb.describe(tc)
    assert table.loc["tokens per device per step", "value"] == "64"


def test_auto_path_is_the_model_configs_resolution():
    """The notebook's "auto" is ModelConfig's: the config (and so the record) holds the path it names here."""
    from turbo_moe.model.config import resolve_moe_path

    tc = nb.train_config(**{**BASE, "moe_path": "auto"})
    expected = resolve_moe_path("auto")
    assert expected in ("turbo", "ragged") and tc.model_overrides["moe_path"] == expected
    assert tc.model_config().moe_path == expected and nb.describe(tc).loc["moe_path", "value"] == expected


@pytest.mark.parametrize(
    "bad, message",
    [({"moe_path": "turbo2"}, "parameter moe_path: unknown path 'turbo2'; expected one of ("),
     ({"moe_path": "turbo2"}, "or 'auto'"),
     ({"per_device_batch": 0}, "parameter per_device_batch: must be a positive int, got 0"),
     ({"per_device_batch": 2.5}, "parameter per_device_batch: must be a positive int, got 2.5"),
     ({"steps": -1}, "TrainConfig.steps: must be a positive int, got -1"),
     ({"model": "huge"}, "unknown model preset 'huge'"),
     ({"model_overrides": {"n_experts": 0}}, "ModelConfig.n_experts"),
     ({"seq_len": 0}, "TrainConfig.seq_len: must be a positive int"),
     ({"model_overrides": {"max_seq_len": 64}}, "TrainConfig.seq_len: 32 here and max_seq_len=64")],
)
def test_bad_parameters_name_themselves(bad, message):
    with pytest.raises(ValueError) as err:
        nb.train_config(**{**BASE, **bad})
    assert message in str(err.value)


def test_plots_and_record(tmp_path):
    from turbo_moe.train import RunResult

    history = [{"step": s, "loss": 5.0 - s, "eval_loss": math.nan if s < 2 else 3.5, "tgs": 100.0,
                "dropped_fraction": 0.1} for s in range(3)]
    result = RunResult(status="ok", history=history, summary={"tgs": 100.0}, expert_load=[[1, 2], [3, 4]],
                       provenance={"device_kind": "cpu", "date": "2026-11-21T00:00:00", "git_commit": "abc"})
    assert nb.plot_run(result) is not None and nb.plot_expert_load(result) is not None
    tc = nb.train_config(**BASE)
    path = nb.save_record(result, None, tmp_path, tc)
    assert path.parent == tmp_path and path.name.startswith("ragged_")
    assert nb.save_record(result, tmp_path / "x.json", tmp_path, tc) == tmp_path / "x.json"
    assert nb.plot_run(RunResult(status="oom", error="too big")) is None
    table = nb.summary_table(result)
    assert table.loc["TGS (tokens/device/s)", "value"] == "100" and list(table.index[:2]) == ["status", "steps"]
