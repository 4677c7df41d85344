"""Convergence analysis (turbo_moe.experiments.report.convergence) on fake run records; the drop-penalty driver
(benchmarks/convergence_gpu.py): its run plan, chunk planning and outputs without training, and (slow) the whole
pipeline on the CPU: two worker processes, a call killed at its deadline, chunks resumed, the same curves."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from turbo_moe.experiments.report import convergence as C

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "convergence_gpu.py"
_spec = importlib.util.spec_from_file_location("convergence_gpu", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules["convergence_gpu"] = bench
_spec.loader.exec_module(bench)

FINALS = {("turbo", None): [4.50, 4.52, 4.49], ("dense_cf", 1.0): [4.56, 4.60, 4.55],
          ("dense_cf", 1.25): [4.51, 4.53]}


def fake_record(path, cf, seed, final, status="ok", n_evals=4, tokens_per_step=1000, on_turbo=True):
    evals = [{"step": 25 * (i + 1), "tokens": 25 * (i + 1) * tokens_per_step,
              "eval_loss": final + 0.5 * (n_evals - 1 - i)} for i in range(n_evals)]
    steps = 25 * n_evals
    label = f"{path}_seed{seed}" if cf is None else f"turbo_dropcf{cf:g}_seed{seed}"
    return {"label": label, "path": "turbo" if on_turbo else path, "analysis_path": path, "capacity_factor": cf,
            "seed": seed, "status": status, "evals": evals, "steps_done": steps, "steps_total": steps,
            "tokens_per_step": tokens_per_step, "regime": "dropless" if cf is None else f"drops as dense_cf at cf={cf}",
            "steps": {"step": list(range(steps)), "dropped_fraction": [0.0 if cf is None else 0.1 / cf] * steps,
                      "load_max_over_mean": [1.5 + 0.01 * (i % 7) for i in range(steps)]},
            "train_config": {"dataset": "fake"},
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

    pen = summary["penalties"]["dense_cf (cf=1)"]  # dense_cf's drops run on turbo are still dense_cf's
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
    assert C.run_label({"path": "dense_cf", "capacity_factor": 1.25}) == "dense_cf (cf=1.25)"  # older records


def test_single_seed_gives_nan_bounds_not_errors():
    summary = C.summarize([fake_record("turbo", None, 0, 4.5), fake_record("dense_cf", 1.0, 0, 4.6)])
    w = summary["penalties"]["dense_cf (cf=1)"]["welch"]
    assert w["diff"] == pytest.approx(0.1) and math.isnan(w["lo"]) and not summary["penalties"]["dense_cf (cf=1)"]["separates"]
    assert C.format_summary(summary)


def test_analysis_writes_runs_csv_summary_and_figure(tmp_path):
    out = tmp_path / "dp"
    out.mkdir()
    records = fake_records() + [dict(fake_record("turbo", None, 9, 4.4), status="failed", evals=[])]
    (out / bench.RUNS_FILE).write_text(json.dumps(records))
    text = bench.analyze(out, tmp_path / "figures" / "drop_penalty.png")
    assert "dense_cf (cf=1.25)" in text and "| turbo_seed9 | dropless | failed |" in text
    assert (tmp_path / "figures" / "drop_penalty.png").stat().st_size > 20_000
    rows = (out / "evals.csv").read_text().splitlines()
    assert len(rows) == 1 + 8 * 4 and rows[0].startswith("label,path,seed,step,tokens,eval_loss")
    assert len(list((out / "runs").glob("*.json"))) == 9
    assert json.loads((out / "summary.json").read_text())["baseline"] == "turbo"
    series = C.step_series(fake_records(), "dropped_fraction", window=10)
    tokens, mean = series["dense_cf (cf=1.25)"]
    assert tokens[0] == 10 * 1000 and mean == pytest.approx(0.08)
    with pytest.raises(FileNotFoundError, match=bench.RUNS_FILE):
        bench.analyze(tmp_path / "empty", None)


def test_plan_labels_and_eval_points():
    runs = bench.plan(bench.parse_paths("turbo,dense_cf:1.0,dense_cf:1.25"), [0, 1], "turbo")
    assert [r.label for r in runs[:3]] == ["turbo_seed0", "turbo_dropcf1_seed0", "turbo_dropcf1.25_seed0"]
    assert runs[1].path == "turbo" and runs[1].capacity_factor == 1.0 and runs[1].drops_as == 1.0
    assert runs[0].capacity_factor is None and runs[3].seed == 1 and len(runs) == 6
    real = bench.plan([("dense_cf", 1.25)], [0], "dense_cf")[0]
    assert (real.label, real.path, real.capacity_factor) == ("dense_cf_cf1.25_seed0", "dense_cf", 1.25)
    history = [{"step": s, "eval_loss": 5.0 if s in (9, 14, 19) else math.nan, "loss": 6.0, "ce_loss": 5.5,
                "dropped_fraction": 0.1, "load_max_over_mean": 2.0} for s in range(20)]
    # step 15 (a chunk's end) is left out: a run cut into chunks has the points of one that was not
    assert [p["step"] for p in bench.eval_points(history, 64, eval_every=10, total=20)] == [10, 20]


def test_chunk_planning_from_priors_and_measurements(tmp_path):
    args = bench.argparse.Namespace(max_seconds=530.0, batch=8, seq=2048, tokens=50e6, prior_step_s=0.0,
                                    prior_overhead_s=200.0, min_chunk_steps=50, max_chunk_steps=0, gpus=4)
    runs = bench.plan([("turbo", 0.0), ("dense_cf", 1.0)], [0], "turbo")
    orch = bench.Orchestrator(args, runs, tmp_path, tmp_path / "out", [])
    orch.kind = "H100"
    step_s, overhead, measured = orch.step_estimate(runs[0])
    assert step_s == pytest.approx(16384 / bench.PRIOR_TGS["H100"]) and overhead == 200.0 and not measured
    spec, until = orch.next_chunk(set())
    left = 530 - bench.MARGIN_S
    assert spec == runs[0] and until == pytest.approx((left - 1.1 * 200) / (1.1 * step_s), abs=2)
    assert until < orch.total == 3052
    # the other run's measurement is used before the prior; a run further along goes later
    bench._write_json(tmp_path / runs[0].label / "state.json", {"status": "partial", "steps_done": 1000, "chunks": [
        {"kind": "H100", "steps": 1000, "train_s": 150.0, "overhead_s": 100.0}]})
    assert orch.step_estimate(runs[1]) == (0.15, 100.0, True)
    assert orch.next_chunk(set())[0] == runs[1]
    orch.deadline = bench.time.time() + bench.MARGIN_S + 400  # 400 s left for a chunk
    spec, until = orch.next_chunk({runs[1].label})
    assert spec == runs[0] and until == pytest.approx(1000 + (400 - 110) / 0.165, abs=2)  # padded: 1758 of 2052
    bench._write_json(tmp_path / runs[0].label / "state.json", {"status": "partial", "steps_done": 1100, "chunks": [
        {"kind": "H100", "steps": 1000, "train_s": 150.0, "overhead_s": 100.0}]})
    # 1952 steps left: more than the padded estimate allows, fewer than fit unpadded (2000): the run finishes
    assert orch.next_chunk({runs[1].label}) == (runs[0], orch.total)
    orch.deadline = orch.start + 100  # too little time left for any chunk
    assert orch.next_chunk(set()) is None


# The workers see one CPU device each (as a GPU worker sees its one GPU; not the 8 this test session fakes), compile
# with XLA's CPU optimisations off and share one compilation cache that keeps every program (the init's small ones
# too): later chunks load what the first compiled. The same for the whole run and the cut one, so curves compare.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _smoke(out, state, *extra):
    cmd = [sys.executable, str(_PATH), "--smoke", "--model", "tiny", "--dataset", "synthetic", "--seeds", "0",
           "--paths", "turbo,dense_cf:1.0", "--out", str(out), "--state", str(state), *extra]
    env = {**os.environ, "XLA_FLAGS": FAST_COMPILE, "JAX_PLATFORMS": "cpu",
           "JAX_COMPILATION_CACHE_DIR": str(state.parent / "jax_cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False, env=env)
    return proc, {r["label"]: r for r in json.loads((out / bench.RUNS_FILE).read_text())}


@pytest.mark.slow
def test_pipeline_killed_and_resumed_gives_the_same_curves(tmp_path):
    proc, whole = _smoke(tmp_path / "whole", tmp_path / "whole_state")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {r["status"] for r in whole.values()} == {"ok"} and len(whole) == 2
    dropped = whole["turbo_dropcf1_seed0"]["steps"]["dropped_fraction"]
    assert min(dropped) > 0 and max(whole["turbo_seed0"]["steps"]["dropped_fraction"]) <= 1e-6

    state = tmp_path / "cut_state"
    # a call whose deadline comes before its workers finish: both killed, nothing recorded, nothing lost (a 3-step
    # chunk cut at the first check, 2 s in: a worker with warm caches is still starting then)
    proc, cut = _smoke(tmp_path / "cut", state, "--max-seconds", "2", "--prior-overhead-s", "0",
                       "--min-chunk-steps", "1")
    assert "cut at the deadline" in proc.stdout and {r["steps_done"] for r in cut.values()} == {0}, proc.stdout
    proc, cut = _smoke(tmp_path / "cut", state, "--max-chunk-steps", "10")  # chunks to step 10, then 20, then 24
    assert proc.returncode == 0 and {r["status"] for r in cut.values()} == {"ok"}, proc.stdout + proc.stderr
    assert len(cut["turbo_seed0"]["run_state"]["chunks"]) >= 3
    for label, record in whole.items():
        ref = [(e["step"], e["eval_loss"]) for e in record["evals"]]
        got = [(e["step"], e["eval_loss"]) for e in cut[label]["evals"]]
        assert [s for s, _ in got] == [s for s, _ in ref] == [6, 12, 18, 24]
        np.testing.assert_allclose([v for _, v in got], [v for _, v in ref], rtol=1e-6, err_msg=label)
        np.testing.assert_allclose(cut[label]["steps"]["loss"], record["steps"]["loss"], rtol=1e-6)



def test_analysis_merges_calls_and_refuses_a_run_twice(tmp_path):
    records = fake_records()
    first, second = tmp_path / "call1.json", tmp_path / "call2.json"
    first.write_text(json.dumps(records[:3]))
    second.write_text(json.dumps([dict(r, provenance=dict(r["provenance"], git_commit="def")) for r in records[3:]]))
    out = tmp_path / "dp"
    bench.analyze(out, None, [first, second])
    assert len(list((out / "runs").glob("*.json"))) == 8
    assert "commit abc, def" in (out / "summary.md").read_text().splitlines()[0]
    with pytest.raises(ValueError, match="already in an earlier --from file"):
        bench.analyze(tmp_path / "again", None, [first, first])


def test_only_runs_the_named_labels(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--out", str(tmp_path), "--seeds", "0,1", "--only", "turbo_seed7"])
    assert "turbo_seed7" in capsys.readouterr().err

def test_report_draws_the_drop_penalty_from_the_store(tmp_path):
    from turbo_moe.experiments.report import report

    results = tmp_path / "results"
    campaign = results / "drop_penalty_fake"
    campaign.mkdir(parents=True)
    source = tmp_path / bench.RUNS_FILE
    source.write_text(json.dumps(fake_records()))
    bench.analyze(campaign, None, [source])
    report.ingest_live_tables(results, tmp_path / "store")
    data = report.load_report_data(tmp_path / "store")
    by_label = {r["label"]: r for r in data.drop_penalty}
    assert len(by_label) == 8 and by_label["turbo_dropcf1_seed0"]["status"] == "ok"
    assert [e["eval_loss"] for e in by_label["turbo_dropcf1_seed0"]["evals"]] == pytest.approx([6.06, 5.56, 5.06, 4.56])
    assert C.summarize(data.drop_penalty)["penalties"]["dense_cf (cf=1)"]["welch"]["diff"] == pytest.approx(
        np.mean(FINALS["dense_cf", 1.0]) - np.mean(FINALS["turbo", None]))
    summary = report.ReportSummary(tmp_path / "figures")
    assert report.draw("drop_penalty", report.figure_builders(data)["drop_penalty"], tmp_path / "figures", summary)
    assert (tmp_path / "figures" / "drop_penalty.png").stat().st_size > 20_000


def test_a_whole_run_in_one_chunk_saves_no_checkpoint(tmp_path):
    args = bench.argparse.Namespace(vocab=256, smoke=True, override=[], model="tiny", dataset="synthetic", batch=2,
                                    seq=64, tokens=64 * 2 * 10, lr=1e-3, warmup=2, eval_every=5, eval_batches=1)
    spec = bench.plan([("turbo", 0.0)], [0], "turbo")[0]
    whole = bench.train_config(args, spec, until=10, state_dir=tmp_path)
    assert whole.checkpoint.dir is None and not whole.checkpoint.resume
    part = bench.train_config(args, spec, until=6, state_dir=tmp_path)  # a later chunk restores from it
    assert part.checkpoint.dir == str(tmp_path / spec.label / "ckpt") and part.checkpoint.resume
    (tmp_path / spec.label / "ckpt").mkdir(parents=True)  # the last chunk of a resumed run restores, then saves
    last = bench.train_config(args, spec, until=10, state_dir=tmp_path)
    assert last.checkpoint.dir == str(tmp_path / spec.label / "ckpt") and last.checkpoint.resume
