"""Fault cases of the results store and the report (run by tests/faults/fault_campaign.py): a report that
mixes an earlier run's row with a fresh run's history, a make main that dirties the committed tree, one-byte
flips in store files, non-finite metrics, a Jupyter kernel of another clone, the report run from elsewhere."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pandas as pd

from turbo_moe.experiments.store import migrate, results, store
from turbo_moe.experiments.report import report

from harness import Outcome, cli_run, spec_file, toy_notebook

SWEEP = "cpu_toy"
PATHS = {"a": ("dense_cf", 1.0), "b": ("turbo", None)}  # point -> (moe_path, capacity_factor)


def _runs(results_dir: Path, runs: list[tuple[str, str, float, float]]) -> None:
    """Sweep rows as the runner appends them, one per (point, date, tgs, dropped), each point's latest run
    with its JSON record (24 steps of history at that dropped fraction, an expert load)."""
    for point, date, tgs, dropped in runs:
        moe_path, cf = PATHS[point]
        record = f"{SWEEP}/{point}.json"
        document = {"status": "ok", "summary": {"tgs": tgs, "final_loss": 5.0},
                    "provenance": {"device_kind": "cpu", "date": date, "git_commit": "abc1234567"},
                    "history": [{"step": s, "loss": 6.0 - s / 24, "dropped_fraction": dropped,
                                 "load_max_over_mean": 1.5} for s in range(24)],
                    "expert_load": [[1.0, 2.0, 1.0, 0.5]]}
        (results_dir / SWEEP).mkdir(parents=True, exist_ok=True)
        (results_dir / record).write_text(json.dumps(document))
        results.append_row(results_dir / f"{SWEEP}.csv", {
            "sweep": SWEEP, "point": point, "point_key": point, "status": "ok", "moe_path": moe_path,
            "capacity_factor": cf, "tgs": tgs, "final_loss": 5.0, "dropped_fraction_mean": dropped,
            "device_kind": "cpu", "date": date, "git_commit": "abc1234567", "record": record})


OLD = [("a", "2026-11-20T01:00:00+00:00", 100.0, 0.5), ("b", "2026-11-20T02:00:00+00:00", 200.0, 0.0),
       ("a", "2026-11-21T01:00:00+00:00", 110.0, 0.4), ("b", "2026-11-21T02:00:00+00:00", 210.0, 0.0)]
FRESH = [("a", "2026-11-29T01:00:00+00:00", 900.0, 0.125), ("b", "2026-11-29T02:00:00+00:00", 950.0, 0.0)]


def _table_rows(markdown: str, sweep: str = SWEEP) -> list[dict[str, str]]:
    lines = [line.strip().strip("|").split("|") for line in markdown.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0]]
    return [dict(zip(header, (c.strip() for c in cells))) for cells in lines[2:] if cells[0].strip() == sweep]


def _check_fresh_rows(rows: list[dict[str, str]], where: str) -> None:
    """Every row is one fresh run: its TGS, its history's late dropped fraction and its run date agree."""
    fresh = {PATHS[p][0] if PATHS[p][1] is None else f"dense_cf (cf={PATHS[p][1]:g})": (tgs, dropped, date[:10])
             for p, date, tgs, dropped in FRESH}
    assert len(rows) == len(fresh), (where, rows)
    for row in rows:
        tgs, dropped, day = fresh[row["path"]]
        seen = (float(row["TGS (tok/dev/s)"]), float(row["dropped, last 25%"] or 0), row["run date"])
        assert seen == (tgs, dropped, day), f"{where}: row {row['path']} mixes runs: {seen} != {(tgs, dropped, day)}"


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo), *args],
                         capture_output=True, text=True, check=True)
    return out.stdout


def report_mixes_runs(root: Path, o: Outcome) -> str:
    # The store as it was: the committed campaign's table ingested again after a fresh run (its rows numbered
    # from 0 again, with newer dates); each row must be joined to its own record and history.
    _runs(root / "results", OLD)
    migrate.ingest(root / "results", root / "store", quiet=True)
    (root / "results" / f"{SWEEP}.csv").unlink()
    _runs(root / "results", FRESH)
    migrate.ingest(root / "results", root / "store", quiet=True)
    data = report.load_report_data(root / "store")
    _check_fresh_rows(_table_rows(report.results_markdown(data.results)), "one store, two ingests")

    # A fresh clone: committed store and figures; `make main` runs a sweep and `turbo-moe report`.
    repo = root / "repo"
    exp = repo / "experiments"
    _runs(exp / "results", OLD)
    (repo / ".gitignore").write_text("experiments/results/*\nexperiments/runs/\n")
    migrate.ingest(exp / "results", exp / "store", quiet=True)  # what `turbo-moe report --publish` ingests
    (repo / "docs").mkdir()
    (repo / "docs" / "results.md").write_text("# Results\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "committed results")
    for stale in (exp / "results").rglob("*"):
        if stale.is_file():
            stale.unlink()  # a fresh clone has no results/
    _runs(exp / "results", FRESH)
    rc, out, err = cli_run(["report", "--no-notebook", "--experiments-dir", str(exp)], o)
    assert rc == 0, err
    dirty = _git(repo, "status", "--porcelain")
    assert dirty == "", f"the report changed the committed tree:\n{dirty}"
    table = (exp / "runs" / "report" / "results.md").read_text()
    rows = _table_rows(table)
    _check_fresh_rows(rows, "fresh clone")
    assert {r["campaign"] for r in rows} == {f"{SWEEP} (local)"}, rows
    return ("every row joined to its own record and history by (campaign, record id); the fresh runs reported "
            "as fresh, 'cpu_toy (local)'; committed store and figures untouched (git status clean)")


def _flip(path: Path, data: bytes, rng: random.Random) -> None:
    position = rng.randrange(len(data))
    damaged = bytearray(data)
    damaged[position] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(damaged))


def store_byte_flips(root: Path, o: Outcome) -> str:
    _runs(root / "results", OLD)
    kernels = pd.DataFrame({"shape": ["s"], "impl": ["grouped"], "op": ["fwd"], "tflops": [7.0]})
    kernels.to_csv(root / "results" / "kernels_toy.csv", index=False)
    migrate.ingest(root / "results", root / "store", quiet=True)
    rng = random.Random(0)
    caught, silent, raw = 0, 0, []
    for dataset, read in (("history", lambda: store.read_history(root / "store", [SWEEP], wide=False)),
                          ("records", lambda: store.read_records(root / "store", [SWEEP]))):
        path = root / "store" / dataset / f"campaign={SWEEP}" / "part-0.parquet"
        data, before = path.read_bytes(), read()
        for _ in range(200):
            _flip(path, data, rng)
            try:
                after = read()
                silent += not after.equals(before)
            except store.StoreError as exc:
                caught += str(exc).count("\n") == 0 and str(path) in str(exc)
            except Exception as exc:  # noqa: BLE001 — any other error is the fault this case looks for
                raw.append(f"{type(exc).__name__}: {exc}"[:200])
        path.write_bytes(data)
    assert silent == 0 and not raw and caught == 400, (silent, raw[:3], caught)

    path = root / "store" / "history" / f"campaign={SWEEP}" / "part-0.parquet"
    _flip(path, path.read_bytes(), rng)
    data = report.load_report_data(root / "store")
    assert list(data.left_out) == [SWEEP] and "is damaged" in data.left_out[SWEEP], data.left_out
    assert any(f"campaign {SWEEP} is left out" in p and str(path) in p for p in data.problems), data.problems
    assert SWEEP not in set(data.results.get("sweep", [])) and not data.kernels.empty  # the others drawn
    summary = report.ReportSummary(root / "figures")
    (root / "figures").mkdir()
    report.note_problems(data, summary)
    text = report.write_results_table(data, root / "figures", summary).read_text()
    assert f"campaign {SWEEP}: history/campaign={SWEEP}/part-0.parquet is damaged" in text, text
    assert summary.entries[f"campaign {SWEEP}"].startswith("skipped: ")
    return ("400 one-byte flips (history, records): 400 one-line StoreErrors naming the file, 0 silent, 0 other "
            "errors; the report leaves the damaged campaign out, names it, draws the others")


def non_finite_metrics(root: Path, o: Outcome) -> str:
    import contextlib
    import io

    res = root / "results"
    values = {"a": float("inf"), "b": float("-inf"), "c": -5.0, "d": float("nan")}
    for point, tgs in values.items():
        record = f"{SWEEP}/{point}.json"
        (res / SWEEP).mkdir(parents=True, exist_ok=True)
        (res / record).write_text(json.dumps({"status": "ok", "summary": {"tgs": tgs, "final_loss": 5.0},
                                              "provenance": {"date": f"2026-11-29T0{len(point)}:00:00+00:00"}}))
        results.append_row(res / f"{SWEEP}.csv", {"sweep": SWEEP, "point": point, "point_key": point, "status": "ok",
                                                  "moe_path": "turbo", "tgs": tgs, "record": record})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        migrate.ingest(res, root / "store", quiet=True)
    for text in ("inf", "-inf", "-5", "NaN"):
        assert f"tgs = {text} is not a valid measurement" in err.getvalue(), err.getvalue()
    data = report.load_report_data(root / "store")
    table = report.results_markdown(data.results)
    for text in ("inf", "-inf", "-5", "NaN"):
        assert f"| invalid ({text}) |" in table, table
    assert "| inf |" not in table and "| -5 |" not in table and data.results["tgs"].isna().all()
    assert sum("not a valid measurement" in p for p in data.problems) == 4, data.problems
    return "inf, -inf, -5 and NaN TGS: a warning at ingest, flagged in the store, 'invalid (...)' in the table, not drawn"


def kernel_of_another_clone(root: Path, o: Outcome) -> str:
    import os

    from jupyter_core.paths import jupyter_path

    # Another clone's turbo_moe, and a kernel spec whose interpreter imports it.
    other = root / "other_clone"
    (other / "turbo_moe").mkdir(parents=True)
    (other / "turbo_moe" / "__init__.py").write_text("")
    kernel_dir = root / "jupyter" / "kernels" / "turbo-moe-other"
    kernel_dir.mkdir(parents=True)
    python = getattr(sys, "_base_executable", sys.executable)
    (kernel_dir / "kernel.json").write_text(json.dumps({
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"], "display_name": "other",
        "language": "python", "env": {"PYTHONPATH": str(other)}}))
    spec = spec_file(root, f"name: toy\nnotebook: {toy_notebook(root)}\ngrid: {{x: [1]}}\n")
    saved = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = str(root / "jupyter")
    try:
        rc, _, err = cli_run(["sweep", str(spec), "--kernel", "turbo-moe-other", "--experiments-dir", str(root)], o)
    finally:
        os.environ.pop("JUPYTER_PATH") if saved is None else os.environ.update(JUPYTER_PATH=saved)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"imports turbo_moe from {other / 'turbo_moe'}" in err and "not this clone's" in err, err
    assert not (root / "results" / "toy.csv").exists()  # nothing ran in the other clone's code
    # `make setup` installs the kernel into the venv, which the venv's jupyter searches before the user's folder.
    assert jupyter_path("kernels")[0] == str(Path(sys.prefix) / "share" / "jupyter" / "kernels")
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert "ipykernel install --prefix $(abspath $(VENV)) --name turbo-moe" in makefile
    return "a kernel importing another clone's turbo_moe: rc 2, one line naming both; nothing run; the kernel " \
           "is installed per venv, found before the user's"


def report_from_elsewhere(root: Path, o: Outcome) -> str:
    # run_case runs each case in its scratch folder: not the repository root.
    _runs(root / "exp" / "results", FRESH)
    rc, _, err = cli_run(["report", "--experiments-dir", str(root / "exp"), "--kernel", "no-such-kernel"], o)
    assert rc == 2 and "Jupyter kernel 'no-such-kernel' is not installed" in err, err  # past the notebook
    assert report.REPORT_NOTEBOOK.is_file() and Path.cwd() != report.REPORT_NOTEBOOK.parents[1]
    return "the report notebook resolves from the package (this clone), not the working folder"


CASES = [
    ("store: a fresh run ingested beside an earlier one; make main in a fresh clone", report_mixes_runs),
    ("store: one-byte flips in its Parquet files", store_byte_flips),
    ("store: non-finite and negative TGS", non_finite_metrics),
    ("sweep: a Jupyter kernel that imports another clone", kernel_of_another_clone),
    ("report: run from another folder", report_from_elsewhere),
]
