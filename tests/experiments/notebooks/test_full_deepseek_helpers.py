"""The helpers 03_full_deepseek calls (its cells hold parameters, calls and plots only)."""
import math

import matplotlib
import pytest

from turbo_moe.experiments import accounting
from turbo_moe.experiments.notebooks import full_deepseek

matplotlib.use("Agg")
MESH = dict(mesh_data=32, mesh_expert=8, mesh_tensor=1, mesh_pipeline=1, fsdp=True)
GOOD = dict(MESH, paths=["dense_cf", "ragged", "turbo"], max_step_tflop=None, capacity_factor=1.25)


def test_check_parameters_returns_the_exact_config_and_mesh():
    cfg, mesh = full_deepseek.check_parameters(**GOOD)
    assert cfg.n_layers == 61 and cfg.d_model == 7168 and cfg.capacity_factor == 1.25
    assert mesh.devices == 256
    assert full_deepseek.mesh_text(mesh) == (
        "mesh: 256 devices = data 32 x expert 8 x tensor 1 x pipeline 1 (fsdp=True)")


@pytest.mark.parametrize("bad, match", [
    (dict(paths=["dense", "ragged"]), "parameter paths"),
    (dict(paths=[]), "parameter paths"),
    (dict(paths="turbo"), "parameter paths"),
    (dict(max_step_tflop=0), "parameter max_step_tflop"),
    (dict(max_step_tflop="1"), "parameter max_step_tflop"),
    (dict(max_step_tflop=True), "parameter max_step_tflop"),
])
def test_check_parameters_names_the_bad_one(bad, match):
    with pytest.raises(ValueError, match=match):
        full_deepseek.check_parameters(**(GOOD | bad))


def test_param_table_in_billions():
    cfg, _ = full_deepseek.check_parameters(**GOOD)
    table = full_deepseek.param_table(cfg)
    budget = accounting.param_budget(cfg)
    assert list(table.index) == list(budget) and table.columns.tolist() == ["billions"]
    assert all(math.isclose(table.loc[k, "billions"], round(v / 1e9, 2)) for k, v in budget.items())


def test_plot_memory_per_path_draws_one_bar_pair_per_path():
    cfg, mesh = full_deepseek.check_parameters(**GOOD)
    per_path = accounting.full_model_table(cfg, mesh, 1, 256)
    fig = full_deepseek.plot_memory_per_path(per_path, mesh, 1, 256)
    ax = fig.axes[0]
    assert "256 devices" in ax.get_title() and ax.get_ylabel() == "memory per device (GiB)"
    assert len([p for p in ax.patches if p.get_height() > 0]) == 2 * len(per_path)


def test_plan_on_this_device_uses_the_platform_default(monkeypatch):
    seen = {}
    monkeypatch.setattr(full_deepseek, "plan_slice", lambda **kw: seen.update(kw) or "plan")
    args = dict(n_layers=2, n_dense_layers=1, n_experts=None, width_divisor=None, model_overrides={}, paths=None,
                per_device_batch=1, seq_len=128, capacity_factor=1.25)
    assert full_deepseek.plan_on_this_device(max_step_tflop=None, **args) == "plan"
    assert seen["max_step_tflop"] == full_deepseek.SHRUNK_MAX_STEP_TFLOP  # the tests run on a CPU
    devices = seen["devices"]
    assert devices.memory_bytes > 0 and devices.memory_source and devices.platform == "cpu"
    assert devices.expert_parallel == 1 and not devices.fp8  # a CPU's host devices stay data-parallel
    full_deepseek.plan_on_this_device(max_step_tflop=0.5, **args)
    assert seen["max_step_tflop"] == 0.5


def test_plan_and_device_text():
    plan = full_deepseek.SlicePlan(overrides={}, seq_len=64, shrink=4, expert_parallel=1, paths=("turbo", "ragged"),
                                   label="shrunk slice", need_bytes=2**30, memory_bytes=2**31, memory_source="host",
                                   ladder=None, notes=["widths / 4"])
    assert full_deepseek.device_text(plan).endswith("2.0 GiB (host)")
    assert full_deepseek.plan_text(plan, "x/full_deepseek.csv").splitlines() == [
        "note: widths / 4", "runs: shrunk slice; predicted peak 1.0 of 2.0 GiB a device", "paths: turbo, ragged",
        "rows and records go to x/full_deepseek.csv"]


def _row(path, losses, status="ok", mfu=math.nan):
    history = [{"step": i, "loss": v} for i, v in enumerate(losses)]
    return {"path": path, "status": status, "history": history, "first_loss": (losses or [None])[0], "final_loss": (losses or [None])[-1],
            "tgs": 1234.0, "mfu": mfu}


def test_loss_agreement_holds_each_path_to_its_tolerance():
    tight, loose = full_deepseek.DROPLESS_TOLERANCE, full_deepseek.DENSE_CF_TOLERANCE
    rows = [_row("turbo", [12.0, 11.0, 10.0]), _row("ragged", [12.0, 11.0 + tight / 2, 10.0]),
            _row("turbo_fp8", [12.0, 11.0, 10.0 + 2 * tight]), _row("dense_cf", [12.0, 11.0 + loose / 2, 10.0]),
            _row("pallas", [12.0, 12.5, 12.5]), _row("ragged_failed", [], status="oom")]
    table = full_deepseek.loss_agreement(rows)
    assert list(table.index) == ["turbo", "ragged", "turbo_fp8", "dense_cf", "pallas"]
    assert table["within"].tolist() == [True, True, False, True, False]
    assert table["loss fell"].tolist() == [True, True, True, True, False]  # pallas ends above its first step
    assert table.loc["dense_cf", "tolerance"] == loose and table.loc["ragged", "tolerance"] == tight
    assert table.loc["ragged", "max |loss - turbo|"] == pytest.approx(tight / 2)
    assert full_deepseek.loss_agreement([]).empty


def test_loss_lines_say_the_first_and_last_loss():
    lines = full_deepseek.loss_lines([_row("turbo", [12.0, 9.5], mfu=0.5), _row("ragged", [], status="oom")])
    assert lines == ["turbo: train loss 12.000 at the first step -> 9.500 at the last; 1,234 tokens/device/s, "
                     "MFU 50.0%"]
