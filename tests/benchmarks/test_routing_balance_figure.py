"""benchmarks/routing_balance_figure.py on a fake routing_balance_gpu.py folder: worst layer, labels, errors."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "routing_balance_figure.py"
_spec = importlib.util.spec_from_file_location("routing_balance_figure", _PATH)
figure = importlib.util.module_from_spec(_spec)
sys.modules["routing_balance_figure"] = figure
_spec.loader.exec_module(figure)


def _folder(tmp_path, lr=1e-3):
    rows = ["run,path,cf,step,loss,ce,dropped,load_L0,load_L1"]
    for s in range(12):
        rows.append(f"a/dense_cf_cf1.25,dense_cf,1.25,{s},5,5,{0.3 - s / 100},{1.5 + s / 10},{3.0 - s / 10}")
        rows.append(f"b/turbo,turbo,0,{s},5,5,0,1.2,1.4")
    (tmp_path / "steps.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "runs.json").write_text(json.dumps(
        {"parameters": {"lr": lr}, "device_kind": "NVIDIA H200", "git_commit": "abc1234", "date": "2026-11-23T20:00:00"}))
    return tmp_path


def test_worst_layer_labels_and_figure(tmp_path):
    (tmp_path / "runs").mkdir()
    folder = _folder(tmp_path / "runs", lr=3e-4)
    steps, provenance = figure.load_source(f"{folder}:a/dense_cf_cf1.25=old recipe")
    assert set(steps["run"]) == {"a/dense_cf_cf1.25"}
    assert steps["worst"].tolist() == [max(1.5 + s / 10, 3.0 - s / 10) for s in range(12)]
    assert set(steps["label"]) == {"old recipe (lr 0.0003)"} and provenance["git_commit"] == "abc1234"
    out = tmp_path / "fig" / "routing.png"
    figure.main([str(folder), "--figure", str(out)])
    assert out.stat().st_size > 10_000


def test_bad_sources_name_what_is_missing(tmp_path):
    folder = _folder(tmp_path)
    with pytest.raises(SystemExit, match=r"no run \['c/turbo'\]"):
        figure.load_source(f"{folder}:c/turbo")
    with pytest.raises(SystemExit, match="no steps.csv"):
        figure.load_source(str(tmp_path / "nowhere"))
