"""benchmarks/regimes_figure.py on fake train_once.py records: windows, table and figure."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "regimes_figure.py"
_spec = importlib.util.spec_from_file_location("regimes_figure", _PATH)
regimes = importlib.util.module_from_spec(_spec)
sys.modules["regimes_figure"] = regimes
_spec.loader.exec_module(regimes)


def _record(path, step_ms, overrides):
    history = [{"step": s, "step_time_s": step_ms(s) / 1e3, "tgs": 16384 / (step_ms(s) / 1e3),
                "load_max_over_mean": 8.0 - s / 20, "load_max_over_mean_worst_layer": 10.0 - s / 20,
                "dropped_fraction": 0.5 - s / 300} for s in range(110)]
    path.write_text(json.dumps({"config": {"model_overrides": overrides}, "history": history,
                                "provenance": {"device_kind": "fake", "git_commit": "abc", "date": "2026-11-23"}}))


def test_windows_and_figure(tmp_path):
    _record(tmp_path / "0_turbo.json", lambda s: 200.0 + (s >= 50) * 20, {"moe_path": "turbo"})
    _record(tmp_path / "1_dense_cf.json", lambda s: 400.0, {"moe_path": "dense_cf", "capacity_factor": 1.25})
    runs = regimes.load_runs(tmp_path)
    assert [r["label"] for r in runs] == ["turbo", "dense_cf cf 1.25"]
    turbo = regimes.window_table(runs[0])
    assert [w["steps"] for w in turbo] == ["3-22", "23-49", "50-79", "80-109"]
    assert turbo[0]["ms"] == pytest.approx(200.0) and turbo[-1]["ms"] == pytest.approx(220.0)
    assert turbo[0]["tgs"] == pytest.approx(16384 / 0.2)
    assert turbo[0]["load"] > turbo[-1]["load"]
    figure = tmp_path / "fig.png"
    regimes.draw(runs, figure)
    assert figure.stat().st_size > 10_000


def test_records_without_step_history_are_refused(tmp_path):
    (tmp_path / "0_turbo.json").write_text(json.dumps({"config": {}, "history": [{"step": 0}]}))
    with pytest.raises(SystemExit, match="log_every"):
        regimes.load_runs(tmp_path)
    with pytest.raises(SystemExit, match="no train_once"):
        regimes.load_runs(tmp_path / "empty")
