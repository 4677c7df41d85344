"""The sweep engine end to end on a throwaway notebook: isolation, resume, atomic rows, dry-run, CLI."""

import json

import pandas as pd
import pytest

from turbo_moe import cli
from turbo_moe.experiments.store import results
from turbo_moe.experiments.sweep import runner
from turbo_moe.experiments.sweep.runner import SweepLayout, classify_error, plan_sweep, run_sweep
from turbo_moe.experiments.sweep.spec import spec_from_dict


def _spec(toy_notebook, kernel, points):
    return spec_from_dict({"name": "toy", "notebook": str(toy_notebook), "kernel": kernel,
                           "base": {"mode": "ok"}, "points": points})


@pytest.fixture
def layout(tmp_path):
    return SweepLayout(results_dir=tmp_path / "results", runs_dir=tmp_path / "runs", sweep="toy")


def test_failing_point_is_isolated_and_resume_skips_finished(toy_notebook, test_kernel, layout):
    points = [{"x": 1}, {"x": 2, "mode": "fail"}, {"x": 3, "mode": "oom"}, {"x": 4, "mode": "nan"}]
    rows = run_sweep(_spec(toy_notebook, test_kernel, points), layout=layout, progress=False)
    assert [r["status"] for r in rows] == ["ok", "error", "oom", "nan"]
    table = results.read_table(layout.table)
    assert list(table["status"]) == ["ok", "error", "oom", "nan"]
    ok = table.iloc[0]
    assert ok["tgs"] == 10.0 and ok["device_kind"] == "toy" and ok["x"] == 1
    assert ok["record"] == "toy/x-1.json" and (layout.results_dir / ok["record"]).exists()
    assert "point failed on purpose, x=2" in table.iloc[1]["error"]
    assert "RESOURCE_EXHAUSTED" in table.iloc[2]["error"]
    assert layout.notebook_out(_spec(toy_notebook, test_kernel, points).expand()[0]).exists()

    # Re-run: only the errored point runs again; the error is fixed now, so it ends ok.
    fixed = [{"x": 1}, {"x": 2, "mode": "ok"}, {"x": 3, "mode": "oom"}, {"x": 4, "mode": "nan"}]
    fixed_spec = _spec(toy_notebook, test_kernel, fixed)
    assert [p.action for p in plan_sweep(fixed_spec, layout)] == ["skip", "run", "skip", "skip"]
    rows = run_sweep(fixed_spec, layout=layout, progress=False)
    assert [(r["point"], r["status"]) for r in rows] == [("x-2__mode-ok", "ok")]
    latest = results.latest_rows(results.read_table(layout.table))
    assert len(latest) == 5  # "x-2" was renamed by its new mode, the old error row stays as history
    assert run_sweep(fixed_spec, layout=layout, progress=False) == []


def test_notebook_without_record_is_an_error(toy_notebook, test_kernel, layout, monkeypatch):
    spec = _spec(toy_notebook, test_kernel, [{"x": 1}])
    monkeypatch.setattr(runner, "execute_notebook", lambda *a, **k: ("ok", None))
    (row,) = run_sweep(spec, layout=layout, progress=False)
    assert row["status"] == "error" and "wrote no record" in row["error"]


def test_interrupt_keeps_finished_rows(toy_notebook, test_kernel, layout, monkeypatch):
    """A kill during point 2 leaves point 1's row; the re-run does point 2 only."""
    spec = _spec(toy_notebook, test_kernel, [{"x": 1}, {"x": 2}])
    calls = []

    def fake_execute(spec_, params, notebook_out, kernel):
        calls.append(params["x"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        json.dump({"status": "ok", "summary": {"tgs": 1.0}}, open(params["result_json"], "w"))
        return "ok", None

    monkeypatch.setattr(runner, "execute_notebook", fake_execute)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, layout=layout, progress=False)
    assert list(results.read_table(layout.table)["point"]) == ["x-1"]
    rows = run_sweep(spec, layout=layout, progress=False)
    assert [r["point"] for r in rows] == ["x-2"] and calls == [1, 2, 2]


def test_append_is_atomic_and_unions_columns(tmp_path, monkeypatch):
    table = tmp_path / "t.csv"
    results.append_row(table, {"sweep": "s", "point": "a", "status": "ok", "tgs": 1.5, "overrides": {"n": 2}})
    results.append_row(table, {"sweep": "s", "point": "b", "status": "error", "error": "boom"})
    before = table.read_text()

    def broken_to_csv(self, f, **kwargs):
        f.write("sweep,point\ns,half-writ")
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_csv", broken_to_csv)
    with pytest.raises(OSError, match="disk full"):
        results.append_row(table, {"sweep": "s", "point": "c", "status": "ok"})
    assert table.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["t.csv"]  # no temporary file left behind
    monkeypatch.undo()
    frame = results.read_table(table)
    assert list(frame.columns[:5]) == ["sweep", "point", "status", "error", "tgs"]
    assert json.loads(frame.loc[0, "overrides"]) == {"n": 2} and frame.loc[1, "error"] == "boom"


def test_append_rejects_unknown_status(tmp_path):
    with pytest.raises(ValueError, match="status must be one of"):
        results.append_row(tmp_path / "t.csv", {"sweep": "s", "point": "a", "status": "fine"})


@pytest.mark.parametrize(
    "message, status",
    [("RESOURCE_EXHAUSTED: Out of memory allocating 1GiB", "oom"), ("CUDA error: out of memory", "oom"),
     ("ValueError: moe_path must be one of", "error")],
)
def test_classify_error(message, status):
    assert classify_error(RuntimeError(message))[0] == status


def test_cli_dry_run_lists_points_without_running(tmp_path, toy_notebook, capsys):
    sweeps = tmp_path / "experiments" / "sweeps"
    sweeps.mkdir(parents=True)
    (sweeps / "toy.yaml").write_text(
        f"notebook: {toy_notebook}\nbase: {{mode: ok}}\ngrid: {{x: [1, 2, 3]}}\n")
    assert cli.main(["sweep", str(sweeps / "toy.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("[run ]") == 3 and "x-2" in out
    assert not (tmp_path / "experiments" / "results").exists()


def test_cli_reports_bad_spec_and_missing_kernel(tmp_path, toy_notebook, capsys):
    spec_file = tmp_path / "bad.yaml"
    spec_file.write_text(f"notebook: {toy_notebook}\ngrid: {{x: []}}\n")
    assert cli.main(["sweep", str(spec_file)]) == 2
    assert "grid axis 'x' must be a non-empty list" in capsys.readouterr().err
    spec_file.write_text(f"notebook: {toy_notebook}\nkernel: no-such-kernel-xyz\n")
    assert cli.main(["sweep", str(spec_file), "--experiments-dir", str(tmp_path / "e")]) == 2
    assert "ipykernel install --prefix .venv --name no-such-kernel-xyz" in capsys.readouterr().err


def test_only_glob_and_record_false(toy_notebook, test_kernel, layout, monkeypatch):
    spec = spec_from_dict({"name": "toy", "notebook": str(toy_notebook), "kernel": test_kernel,
                           "record": False, "grid": {"x": [1, 2, 3]}})
    ran = []
    monkeypatch.setattr(runner, "execute_notebook", lambda s, params, out, k: ran.append(params["x"]) or ("ok", None))
    rows = run_sweep(spec, layout=layout, only="x-[23]", progress=False)
    assert ran == [2, 3] and [r["status"] for r in rows] == ["ok", "ok"]  # no record needed
    assert rows[0]["record"] is None and rows[0]["notebook_out"] == "runs/toy/x-2.ipynb"
    assert rows[0]["git_commit"] is None or isinstance(rows[0]["git_commit"], str)


def test_oom_frontier_skips_larger_batches_of_the_same_config(toy_notebook, layout, monkeypatch):
    """Once batch 4 of config "a" runs out of memory, batch 8 of "a" is not run; "b" is unaffected.
    The skipped point is recorded with its reason, and a later run (after the OOM is gone) runs it."""
    spec = spec_from_dict({"name": "toy", "notebook": str(toy_notebook), "oom_frontier": "batch",
                           "grid": {"cfg": ["a", "b"], "batch": [2, 4, 8]}})
    ran, too_big = [], {"a": 4}

    def fake_execute(spec_, params, notebook_out, kernel):
        ran.append((params["cfg"], params["batch"]))
        if params["batch"] >= too_big.get(params["cfg"], 10**9):
            return "oom", "RESOURCE_EXHAUSTED: out of memory"
        json.dump({"status": "ok", "summary": {"tgs": 1.0}}, open(params["result_json"], "w"))
        return "ok", None

    monkeypatch.setattr(runner, "execute_notebook", fake_execute)
    monkeypatch.setattr(runner, "check_kernel", lambda name: None)
    rows = run_sweep(spec, layout=layout, progress=False)
    assert [(r["cfg"], r["batch"], r["status"]) for r in rows] == [
        ("a", 2, "ok"), ("a", 4, "oom"), ("a", 8, "skipped"), ("b", 2, "ok"), ("b", 4, "ok"), ("b", 8, "ok")]
    assert ran == [("a", 2), ("a", 4), ("b", 2), ("b", 4), ("b", 8)]
    assert "batch=4 of the same configuration ran out of memory" in rows[2]["error"]
    assert results.read_table(layout.table)["status"].tolist()[2] == "skipped"

    # Re-run: the OOM row is final and still blocks batch 8 (read back from the table, not memory).
    ran.clear()
    assert [r["status"] for r in run_sweep(spec, layout=layout, progress=False)] == ["skipped"] and ran == []
    # With --force nothing is known: everything runs, and now batch 4 fits, so batch 8 runs too.
    too_big.clear()
    rows = run_sweep(spec, layout=layout, progress=False, force=True)
    assert all(r["status"] == "ok" for r in rows) and len(ran) == 6


@pytest.mark.parametrize("frontier, message", [
    ("nope", "must name a parameter that the grid or points vary"),
    ("cfg", "must take numbers"),
    (["batch"], "must be a parameter name"),
])
def test_oom_frontier_must_name_a_numeric_varying_parameter(toy_notebook, frontier, message):
    with pytest.raises(ValueError, match=message):
        spec_from_dict({"name": "toy", "notebook": str(toy_notebook), "oom_frontier": frontier,
                        "grid": {"cfg": ["a", "b"], "batch": [2, 4]}})


def test_budget_leaves_unstarted_points_pending(toy_notebook, layout, monkeypatch):
    """With a spent time budget no new point starts; those points have no row and run next time."""
    spec = spec_from_dict({"name": "toy", "notebook": str(toy_notebook), "points": [{"x": 1}, {"x": 2}]})

    def slow_execute(spec_, params, notebook_out, kernel):
        clock[0] += 10.0  # each point "takes" 10 s of the fake clock
        json.dump({"status": "ok", "summary": {"tgs": 1.0}}, open(params["result_json"], "w"))
        return "ok", None

    clock = [0.0]
    monkeypatch.setattr(runner, "execute_notebook", slow_execute)
    monkeypatch.setattr(runner, "check_kernel", lambda name: None)
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])
    rows = run_sweep(spec, layout=layout, progress=False, budget_s=5.0)
    assert [r["point"] for r in rows] == ["x-1"]
    assert list(results.read_table(layout.table)["point"]) == ["x-1"]
    assert [r["point"] for r in run_sweep(spec, layout=layout, progress=False)] == ["x-2"]
