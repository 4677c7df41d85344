"""Convergence analysis (turbo_moe.experiments.convergence) on fake run records, and the benchmark's
record/summary writing and resume bookkeeping (benchmarks/convergence_gpu.py) without training."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from turbo_moe.experiments import convergence as C

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "convergence_gpu.py"
_spec = importlib.util.spec_from_file_location("convergence_gpu", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["convergence_gpu"] = bench
_spec.loader.exec_module(bench)

FINALS = {("turbo", None): [4.50, 4.52, 4.49], ("dense_cf", 1.0): [4.56, 4.60, 4.55],
          ("dense_cf", 1.25): [4.51, 4.53]}


def fake_record(path, cf, seed, final, status="ok", n_evals=4, tokens_per_step=1000):
    evals = [{"step": 25 * (i + 1), "tokens": 25 * (i + 1) * tokens_per_step,
              "eval_loss": final + 0.5 * (n_evals - 1 - i)} for i in range(n_evals)]
    return {"label": bench.run_tag(path, cf or 0.0, seed), "path": path, "capacity_factor": cf, "seed": seed,
            "status": status, "evals": evals, "train_config": {"dataset": "fake"},
            "provenance": {"device_kind": "cpu", "jax_version": "x", "git_commit": "abc", "date": "today"}}


def fake_records():
    return [fake_record(p, cf, s, v) for (p, cf), values in FINALS.items() for s, v in enumerate(values)]


def test_summary_means_and_intervals():
    summary = C.summarize(fake_records() + [fake_record("turbo", None, 7, 9.9, status="nan")])
    turbo = summary["paths"]["turbo"]
    assert turbo["n"] == 3 and turbo["seeds"] == [0, 1, 2]  # the failed run is left out
    assert turbo["mean"] == pytest.approx(np.mean(FINALS["turbo", None]))
    half = stats.t.ppf(0.975, 2) * np.std(FINALS["turbo", None], ddof=1) / math.sqrt(3)
    assert turbo["hi"] - turbo["mean"] == pytest.approx(half)

    pen = summary["penalties"]["dense_cf (cf=1)"]
    w = pen["welch"]
    assert w["diff"] == pytest.approx(np.mean(FINALS["dense_cf", 1.0]) - np.mean(FINALS["turbo", None]))
    ref = stats.ttest_ind(FINALS["dense_cf", 1.0], FINALS["turbo", None], equal_var=False)
    assert w["df"] == pytest.approx(ref.df)
    lo, hi = ref.confidence_interval(0.95)
    assert (w["lo"], w["hi"]) == (pytest.approx(lo), pytest.approx(hi))
    assert pen["separates"] and w["lo"] > 0
    paired = pen["paired"]
    assert paired["n"] == 3 and paired["df"] == 2
    assert paired["mean"] == pytest.approx(np.mean(np.subtract(FINALS["dense_cf", 1.0], FINALS["turbo", None])))

    cf125 = summary["penalties"]["dense_cf (cf=1.25)"]
    assert cf125["welch"]["n_a"] == 2 and cf125["paired"]["seeds"] == [0, 1]
    assert not cf125["separates"]  # +0.02 with 2 seeds: the interval spans 0
    table = C.format_summary(summary)
    assert "| dense_cf (cf=1.25) |" in table and "separates" in table


def test_single_seed_gives_nan_bounds_not_errors():
    summary = C.summarize([fake_record("turbo", None, 0, 4.5), fake_record("dense_cf", 1.0, 0, 4.6)])
    w = summary["penalties"]["dense_cf (cf=1)"]["welch"]
    assert w["diff"] == pytest.approx(0.1) and math.isnan(w["lo"]) and not summary["penalties"]["dense_cf (cf=1)"]["separates"]
    assert C.format_summary(summary)


def test_figure_and_outputs_from_records(tmp_path):
    out = tmp_path / "conv"
    (out / "runs").mkdir(parents=True)
    for r in fake_records():
        (out / "runs" / f"{r['label']}.json").write_text(json.dumps(r))
    text = bench.write_outputs(out, tmp_path / "figures" / "convergence.png")
    assert "dense_cf (cf=1.25)" in text
    assert (tmp_path / "figures" / "convergence.png").stat().st_size > 10_000
    rows = (out / "evals.csv").read_text().splitlines()
    assert len(rows) == 1 + 8 * 4 and rows[0].startswith("label,path,seed,step,tokens,eval_loss")
    assert json.loads((out / "summary.json").read_text())["baseline"] == "turbo"


def test_budget_estimate_and_helpers():
    assert bench.estimate_seconds(("turbo", 0.0), {}) == 0.0  # the first run always starts
    walls = {("turbo", 0.0): (100.0, 40.0)}
    assert bench.estimate_seconds(("turbo", 0.0), walls) == 60.0  # compiled programs come from the cache
    assert bench.estimate_seconds(("dense_cf", 1.0), walls) == pytest.approx(160.0)
    assert bench.parse_paths("turbo,dense_cf:1.25") == [("turbo", 0.0), ("dense_cf", 1.25)]
    history = [{"step": 0, "eval_loss": math.nan, "loss": 9.0, "ce_loss": 8.0, "dropped_fraction": 0.1,
                "load_max_over_mean": 2.0},
               {"step": 9, "eval_loss": 5.0, "loss": 6.0, "ce_loss": 5.5, "dropped_fraction": 0.1,
                "load_max_over_mean": 2.0}]
    assert bench.eval_points(history, 64) == [{"step": 10, "tokens": 640, "eval_loss": 5.0, "loss": 6.0,
                                               "ce_loss": 5.5, "dropped_fraction": 0.1, "load_max_over_mean": 2.0}]
