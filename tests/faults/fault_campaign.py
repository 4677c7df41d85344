"""Fault campaign: inject every fault of tests/FAULTS.md into a scratch experiments folder and count
what breaks. Run it alone (``python tests/faults/fault_campaign.py``) for the table, or through
``tests/faults/test_fault_campaign.py`` (CI), which asserts rows lost 0, duplicates 0, hangs 0,
tracebacks 0 and each fault's own outcome.

A case is a function taking a fresh scratch folder and returning what happened ("now" column); it
raises AssertionError when the outcome is not the one FAULTS.md claims. The sweep runs a three-cell
notebook whose execution is replaced by an in-process stand-in (``_Sweep``) except where papermill
itself is under test; checkpoints save a small dict of arrays; the dry runs use the real 02 notebook.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path


from turbo_moe.experiments.store import results
from turbo_moe.experiments.sweep.lock import lock_path

from harness import (CASE_TIMEOUT_S, REPO, TOY_PARAMETERS, TRACEBACK, TRAIN_NOTEBOOK, Outcome, _checkpointer,  # noqa: F401
                     _save, _Sweep, can_mount_tmpfs, child, cli_run, count_rows, refused_restore, spec_file,
                     toy_notebook)
from held_faults import (held_checkpoint_fallback, held_damaged_rows, held_full_disk_table, held_int64_ids,
                         held_lock, held_long_names, held_resume_mismatch, held_sigkill_and_resume, held_typo,
                         held_umask, held_yaml)
from run_faults import RUN_FAULTS
from store_faults import CASES as STORE_FAULTS


def long_error(root: Path, o: Outcome) -> str:
    sweep = _Sweep(root, n=3)
    sweep.records = {2: lambda p: {"status": "error", "error": "E" * 200_000}}
    sweep.run()
    table = sweep.table()
    cell = table.loc[table["point"] == "x-2", "error"].item()
    full = sweep.layout.results_dir / "toy" / "x-2.json.error.txt"
    assert len(cell) <= results.ERROR_CHARS and "x-2.json.error.txt" in cell and len(full.read_text()) == 200_000
    rc, out, _ = cli_run(["sweep", str(spec_file(root, f"name: toy\nnotebook: {sweep.spec.notebook}\n"
                                                       "grid: {x: [1, 2, 3]}\n")), "--dry-run",
                          "--experiments-dir", str(root)], o)
    assert rc == 0 and "[run ] x-2" in out, out
    count_rows(sweep, ["x-1", "x-3"], o)
    return f"error cut to {results.ERROR_CHARS} characters in the table, full text beside the record; table reads"


def record_not_an_object(root: Path, o: Outcome) -> str:
    sweep = _Sweep(root, n=3)
    sweep.records = {2: lambda p: "[1, 2, 3]"}
    rows = sweep.run()
    assert [r["status"] for r in rows] == ["ok", "error", "ok"] and "JSON list, not an object" in rows[1]["error"]
    assert not (sweep.layout.results_dir / "toy" / "x-2.json").exists()
    assert (sweep.layout.results_dir / "toy" / "x-2.json.rejected").exists()
    count_rows(sweep, ["x-1", "x-3"], o)
    return "the point is an error row naming the record; kept as .rejected; the sweep goes on"


def _drop_column(table: Path, column: str) -> None:
    import pandas as pd

    frame = pd.read_csv(table, keep_default_na=False)
    frame.drop(columns=[column]).to_csv(table, index=False)


def table_without_status(root: Path, o: Outcome) -> str:
    sweep = _Sweep(root, n=2)
    sweep.run()
    _drop_column(sweep.layout.table, "status")
    spec = spec_file(root, f"name: toy\nnotebook: {sweep.spec.notebook}\ngrid: {{x: [1, 2]}}\n")
    rc, _, err = cli_run(["sweep", str(spec), "--dry-run", "--experiments-dir", str(root)], o)
    assert rc == 2 and "no column 'status'" in err and "toy.csv" in err and len(err.strip().splitlines()) == 1, err
    problems = results.scan_results(sweep.layout.results_dir)
    assert any("no column 'status'" in p and "left out of the report" in p for p in problems), problems
    return "sweep (dry run too) rc 2 naming the file and column; the report says it leaves the table out"


def table_without_point_key(root: Path, o: Outcome) -> str:
    sweep = _Sweep(root, n=2)
    sweep.run()
    _drop_column(sweep.layout.table, "point_key")
    try:
        sweep.run(only="x-1")
        raise AssertionError("planned the finished points again")
    except ValueError as exc:
        assert "no column 'point_key'" in str(exc), exc
    assert len(sweep.table()) == 2
    return "refused naming the column (nothing planned twice)"


def damaged_records(root: Path, o: Outcome) -> str:
    sweep = _Sweep(root, n=3)
    sweep.run()
    records = sweep.layout.results_dir / "toy"
    (records / "x-1.json").write_text('{"status": "ok", "summ')
    (records / "x-2.json").write_bytes(b'{"status": "ok", "summary": {"tgs": "\xff\xfe"}}')
    problems = results.scan_results(sweep.layout.results_dir)
    assert any("x-1.json" in p and "not valid JSON" in p for p in problems), problems
    assert any("x-2.json" in p and "not UTF-8" in p for p in problems), problems
    rows = sweep.run()
    assert [r["point"] for r in rows] == ["x-1", "x-2"]
    count_rows(sweep, ["x-1", "x-2", "x-3"], o, rerun=("x-1", "x-2"))
    return "truncated and non-UTF-8 records named with the reason; their points run again"


def non_numeric_cell(root: Path, o: Outcome) -> str:
    from turbo_moe.experiments.report import report

    sweep = _Sweep(root, n=3)
    sweep.run()
    text = sweep.layout.table.read_text().splitlines(keepends=True)
    header = text[0].rstrip("\n").split(",")
    fields = text[2].rstrip("\n").split(",")
    fields[header.index("tgs")] = "abc"
    text[2] = ",".join(fields) + "\n"
    sweep.layout.table.write_text("".join(text))
    problems = results.scan_results(sweep.layout.results_dir)
    assert any("line 3 column 'tgs'" in p and "'abc' is not a number" in p for p in problems), problems
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        summary = report.build_report(sweep.layout.results_dir, root / "figures")
    assert summary.entries["results_table"] == "results.md"
    return "'abc' in tgs: warning naming file, line 3, column tgs; read as empty; the report builds"


def two_checkpoint_writers(root: Path, o: Outcome) -> str:
    from turbo_moe.train.checkpoint import CheckpointBusy

    first = _checkpointer(root / "ckpt")
    try:
        _checkpointer(root / "ckpt")
        raise AssertionError("a second writer was let in")
    except CheckpointBusy as exc:
        assert f"pid {os.getpid()}" in str(exc) and "another checkpoint_dir" in str(exc), exc
    _save(first, 1)
    first.finish()
    _checkpointer(root / "ckpt").finish()  # released on finish
    return "second writer refused naming the holder; released when the first finishes"


def report_wrong_dir(root: Path, o: Outcome) -> str:
    rc, _, err = cli_run(["report", "--experiments-dir", str(root / "expriments"), "--no-notebook"], o)
    assert rc == 2 and "is not a folder" in err and len(err.strip().splitlines()) == 1, err
    (root / "empty" / "results").mkdir(parents=True)
    rc, _, err = cli_run(["report", "--experiments-dir", str(root / "empty"), "--no-notebook"], o)
    assert rc == 2 and "holds no results tables" in err, err
    return "rc 2, one line: not a folder / holds no results tables"


FULL_DISK_SWEEP = """
    import json, shutil, sys
    from pathlib import Path
    sys.path.insert(0, %r)
    from harness import _Sweep
    root = Path(sys.argv[1])
    sweep = _Sweep(root, n=4)
    big = "x" * 30_000  # a record this large fills the 64 KiB disk by the third point
    sweep.records = {x: (lambda p: {"status": "ok", "summary": {"tgs": 1.0}, "blob": big}) for x in range(1, 5)}
    try:
        sweep.run()
        print("FIRST finished")
    except OSError as exc:
        print("FIRST", exc)
    for f in (root / "results" / "toy").glob("*.json"):
        f.write_text(json.dumps({"status": "ok", "summary": {"tgs": 1.0}}))  # free the space again
    sweep.records = {}
    sweep.run()
    print("ROWS", json.dumps(list(sweep.table()["point"])))
    print("STATUSES", json.dumps(list(sweep.table()["status"])))
""" % str(Path(__file__).parent)


def full_disk_sweep(root: Path, o: Outcome) -> str:
    disk = root / "disk"
    disk.mkdir()
    if not can_mount_tmpfs(disk):
        return "skipped: cannot mount a tmpfs here (unshare)"
    script = root / "full.py"
    script.write_text(textwrap.dedent(FULL_DISK_SWEEP))
    out = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                          f"mount -t tmpfs -o size=64k tmpfs {disk} && exec {sys.executable} {script} {disk}"],
                         capture_output=True, text=True, timeout=90)
    o.tracebacks += (out.stdout + out.stderr).count(TRACEBACK)
    assert out.returncode == 0, out.stderr[-1500:]
    rows = json.loads(out.stdout.split("ROWS ")[1].splitlines()[0])
    statuses = json.loads(out.stdout.split("STATUSES ")[1].splitlines()[0])
    final = [p for p, s in zip(rows, statuses) if s == "ok"]
    o.rows_lost += len({"x-1", "x-2", "x-3", "x-4"} - set(final))
    o.duplicates += len(final) - len(set(final))
    assert "No space left on device" in out.stdout, out.stdout
    return "full disk: the failing point is an error row naming the paths, or the sweep stops naming the table; " \
           "after freeing space every point has one ok row"


FULL_DISK_CHECKPOINT = """
    import os, sys, jax
    from turbo_moe.train.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1])
    state = {f"w{i}": jax.random.normal(jax.random.key(i), (64, 256)) for i in range(40)}
    try:
        ckpt.save(1, state, {"step": 1})
    except Exception as exc:
        print("SAVE", type(exc).__name__, exc)
    print("FINISH", ckpt.finish())
    print("LEFT", sorted(os.listdir(sys.argv[1])))
"""


def full_disk_checkpoint(root: Path, o: Outcome) -> str:
    disk = root / "disk"
    disk.mkdir()
    if not can_mount_tmpfs(disk):
        return "skipped: cannot mount a tmpfs here (unshare)"
    script = root / "ckpt.py"
    script.write_text(textwrap.dedent(FULL_DISK_CHECKPOINT))
    out = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                          f"mount -t tmpfs -o size=256k tmpfs {disk} && exec {sys.executable} {script} {disk}/ckpt"],
                         capture_output=True, text=True, timeout=90)
    # tensorstore may still call into orbax's closed event loop after the save returned, from C++ (printed
    # past any Python hook): at most a late echo or two of the error already reported, counted apart.
    echoes = out.stderr.count("RuntimeError: Event loop is closed")
    o.tracebacks += (out.stdout + out.stderr).count(TRACEBACK) - echoes
    assert out.returncode == 0 and "SAVE CheckpointError" in out.stdout and "No space left" in out.stdout, out
    assert "LEFT []" in out.stdout and echoes <= 2, out.stdout + out.stderr[-1500:]
    return ("CheckpointError naming the folder and the step, no .orbax-checkpoint-tmp left, orbax's thread "
            f"tracebacks held back (late tensorstore echoes this run: {echoes})")


def dry_run_values(root: Path, o: Outcome) -> str:
    base = "notebook: %s\nbase: {model: tiny, seq_len: 64, steps: 3, warmup_steps: 0, dataset: synthetic, %s}\n"
    cases = [("seed: 9223372036854775808", "TrainConfig.seed: must be below 2**63"),
             ("seed: 18446744073709551616", "TrainConfig.seed"),
             ("moe_path: raged", "parameter moe_path: unknown path 'raged'"),
             ("learning_rate: '1e-3'", "TrainConfig.learning_rate: must be a positive finite number or None, got '1e-3'"),
             ("dataset: /dev/null", "'/dev/null' is neither a file nor a directory"),
             ("dataset: %s" % root, "dataset directory")]
    for value, expect in cases:
        rc, _, err = cli_run(["sweep", str(spec_file(root, base % (TRAIN_NOTEBOOK, value))), "--dry-run"], o)
        assert rc == 2 and expect in err and len(err.strip().splitlines()) == 1, (value, err)
    rc, out, err = cli_run(["sweep", str(spec_file(root, base % (TRAIN_NOTEBOOK, "learning_rate: 1e-3"))),
                            "--dry-run"], o)
    assert rc == 0 and "'learning_rate': 0.001" in out and "runs/trials" in out, out + err
    return "seeds >= 2**63, a moe_path typo, a quoted number, /dev/null: the run's own error in the dry run; " \
           "1e-3 is a float; a trial spec's table is outside results/"


def duplicate_yaml_key(root: Path, o: Outcome) -> str:
    spec = spec_file(root, f"notebook: {toy_notebook(root)}\nbase: {{x: 1}}\nbase: {{x: 2}}\n")
    rc, _, err = cli_run(["sweep", str(spec), "--dry-run"], o)
    assert rc == 2 and "key 'base' is given twice (first on line 2)" in err, err
    return "rc 2 naming the key and both lines"


def small_ones(root: Path, o: Outcome) -> str:

    rc, _, err = cli_run(["sweep", str(root), "--dry-run"], o)
    assert rc == 2 and "is a folder" in err, err
    sweep = _Sweep(root, n=2)
    spec = spec_file(root, f"name: toy\nnotebook: {sweep.spec.notebook}\ngrid: {{x: [1, 2]}}\n")
    rc, _, err = cli_run(["sweep", str(spec), "--dry-run", "--only", "nope*", "--experiments-dir", str(root)], o)
    assert rc == 2 and "matches none of the 2 points" in err, err
    sweep.run()
    lock_path(sweep.layout.table).unlink()
    assert sweep.run() == [] and not lock_path(sweep.layout.table).exists()  # no lock needed: nothing to write
    ckpt = _checkpointer(root / "ckpt")
    _save(ckpt, 8)
    refused_restore(ckpt, {"seed": 0, "steps": 5}, "at step 8, past this run's steps=5",
                    "resumed past its steps in silence")
    return "spec folder, --only matching nothing, nothing to run without a lock, steps below the saved step"


HELD = [
    ("1 two sweeps of one table", held_lock), ("1b/6 SIGKILL mid-sweep, resume", held_sigkill_and_resume),
    ("3 full disk writing the table", held_full_disk_table), ("4 misspelled parameter", held_typo),
    ("5 over-long point names", held_long_names), ("6 table cut mid-row", held_damaged_rows),
    ("7 int64 expert ids", held_int64_ids), ("8 umask", held_umask), ("9a/9b bad and hostile YAML", held_yaml),
    ("9d resume with another seed", held_resume_mismatch), ("9e damaged latest checkpoint", held_checkpoint_fallback),
]
NEW = [
    ("37.1 a 200,000-character error", long_error), ("37.2 a record that is a JSON list", record_not_an_object),
    ("37.3 table without status", table_without_status), ("37.3 table without point_key", table_without_point_key),
    ("37.4 truncated / non-UTF-8 records", damaged_records), ("37.5 'abc' in a numeric column", non_numeric_cell),
    ("37.6 two writers of one checkpoint_dir", two_checkpoint_writers),
    ("37.7 mistyped report --experiments-dir", report_wrong_dir),
    ("37.8 full disk during a sweep (tmpfs)", full_disk_sweep),
    ("37.8 full disk during a checkpoint save (tmpfs)", full_disk_checkpoint),
    ("37.9 values that pass the checks and fail later", dry_run_values),
    ("37.9 duplicate YAML keys", duplicate_yaml_key), ("37.10 the smaller ones", small_ones),
]
CASES = HELD + NEW + RUN_FAULTS + STORE_FAULTS


def _alarm(signum, frame):
    raise TimeoutError(f"case did not finish within {CASE_TIMEOUT_S} s")


def run_case(fault: str, case, scratch: Path) -> Outcome:
    outcome = Outcome(fault)
    folder = scratch / case.__name__
    folder.mkdir(parents=True)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_TIMEOUT_S)
    cwd = os.getcwd()
    try:
        os.chdir(folder)  # trial specs write under ./experiments/runs/trials: keep them in the scratch folder
        outcome.now = case(folder, outcome)
    except TimeoutError as exc:
        outcome.hang, outcome.passed, outcome.problem = True, False, str(exc)
    except Exception as exc:  # noqa: BLE001 — the campaign reports every failure in its table
        outcome.passed, outcome.problem = False, f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        os.chdir(cwd)
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return outcome


def run_all(scratch: Path, cases=CASES) -> list[Outcome]:
    return [run_case(fault, case, scratch) for fault, case in cases]


def table(outcomes: list[Outcome]) -> str:
    lines = ["| fault | now | rows lost | duplicates | hang | tracebacks | held |", "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        lines.append(f"| {o.fault} | {o.now or o.problem} | {o.rows_lost} | {o.duplicates} | "
                     f"{'yes' if o.hang else 'no'} | {o.tracebacks} | {'yes' if o.passed else 'NO'} |")
    totals = (sum(o.rows_lost for o in outcomes), sum(o.duplicates for o in outcomes),
              sum(o.hang for o in outcomes), sum(o.tracebacks for o in outcomes))
    lines.append(f"\n{len(outcomes)} faults: rows lost {totals[0]}, duplicates {totals[1]}, hangs {totals[2]}, "
                 f"tracebacks {totals[3]}, claims held {sum(o.passed for o in outcomes)}/{len(outcomes)}")
    return "\n".join(lines)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fault_campaign_") as scratch:
        outcomes = run_all(Path(scratch))
    print(table(outcomes))
    sys.exit(0 if all(o.passed for o in outcomes) else 1)
