"""Run a sweep: each point through papermill, resume, failure isolation, one results row per point.

Files a sweep ``<s>`` writes (``experiments/`` defaults, see ``SweepLayout``)::

    runs/<s>/<point>.ipynb        the executed notebook (git-ignored)
    results/<s>/<point>.json      the point's record, written by the notebook at parameter ``result_json``
    results/<s>.csv               one row per point run, appended atomically

A point that fails (exception, dead kernel, timeout) becomes a row with status ``error`` (``oom`` when the
message says the device ran out of memory) and the sweep goes on. Points whose latest row is final
(ok/oom/nan) with the same parameters are skipped on re-run; ``error`` points are retried. With the spec's
``oom_frontier`` (say ``per_device_batch``), points larger than one that ran out of memory are not run but
recorded with status ``skipped`` and the reason (and retried on a later run, like ``error`` points).

One sweep at a time writes a table (``lock.SweepLock``): a second one refuses, or waits with ``wait_s``.
Damaged rows of the table (see ``results.scan_table``) are reported with file and line and their points
run again; so is a finished point whose record is missing or damaged. A record that is not a usable JSON
object makes its point an ``error`` (the file is kept as ``<point>.json.rejected``); an error longer than
``results.ERROR_CHARS`` is kept whole in ``<point>.json.error.txt`` and cut in the table. Nothing a point
does stops the sweep; only a table that cannot be written does (its message names the file).

Each point prints a line when it starts, a heartbeat every ``sweep_output.HEARTBEAT_S`` seconds while it
runs, and a result line (TGS, loss, dropped fraction); the sweep ends with a summary table.
"""

from __future__ import annotations

import dataclasses
import errno
import fnmatch
import glob
import json
import os
import platform
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from turbo_moe.experiments.store import results
from turbo_moe.experiments.sweep import output as sweep_output
from turbo_moe.experiments.sweep.kernel_check import check_kernel
from turbo_moe.experiments.sweep.lock import SweepLock
from turbo_moe.experiments.sweep.spec import SweepPoint, SweepSpec, params_key
from turbo_moe.provenance import collect as collect_provenance
from turbo_moe.provenance import table_columns
from turbo_moe.status import is_oom

# RunResult.summary keys copied into each row (any other summary keys are copied too, after these).
SUMMARY_FIELDS = (
    "tgs", "mfu", "peak_memory_bytes", "memory_source", "compiled_temp_bytes", "final_loss",
    "final_eval_loss", "dropped_fraction_mean", "params_total", "params_active", "flops_per_token",
    "steps_done", "compile_time_s", "peak_flops_source",
)


@dataclasses.dataclass(frozen=True)
class SweepLayout:
    """Where one sweep's files go."""

    results_dir: Path
    runs_dir: Path
    sweep: str

    @property
    def table(self) -> Path:
        return self.results_dir / f"{self.sweep}.csv"

    def record(self, point: SweepPoint) -> Path:
        return self.results_dir / self.sweep / f"{point.name}.json"

    def notebook_out(self, point: SweepPoint) -> Path:
        return self.runs_dir / self.sweep / f"{point.name}.ipynb"


TRIALS_DIR = Path("experiments") / "runs" / "trials"


def default_experiments_dir(spec: SweepSpec) -> Path:
    """``<repo>/experiments`` for a spec under ``experiments/sweeps/``; any other spec is a trial, kept
    out of the report's ``experiments/results/``: ``./experiments/runs/trials`` (pass --experiments-dir
    to choose)."""
    if spec.source is not None and spec.source.resolve().parent.name == "sweeps" \
            and spec.source.resolve().parent.parent.name == "experiments":
        return spec.source.resolve().parent.parent
    return Path.cwd() / TRIALS_DIR


@dataclasses.dataclass(frozen=True)
class PlannedPoint:
    point: SweepPoint
    action: str  # "run" | "skip"
    reason: str


def plan_sweep(
    spec: SweepSpec, layout: SweepLayout, *, force: bool = False, only: str | None = None
) -> list[PlannedPoint]:
    """Decide for every point whether it runs or is skipped (already finished with these parameters, and
    its record, when the spec keeps records, is sound). ValueError when ``only`` matches no point, or the
    table lacks a column it needs (``results.latest_status``)."""
    with warnings.catch_warnings():  # damaged rows are reported by damaged_rows(), once
        warnings.simplefilter("ignore", results.DamagedTableWarning)
        done = {} if force else results.finished_points(layout.table)
        records = {} if force or not spec.record or not done else _latest_records(layout)
    planned = []
    points = spec.expand()
    for point in points:
        if only is not None and not fnmatch.fnmatch(point.name, only):
            continue
        damaged = _record_problem(layout, records.get(point.name)) if done.get(point.name) == point.key else None
        if done.get(point.name) == point.key and damaged is None:
            planned.append(PlannedPoint(point, "skip", "finished"))
        elif damaged is not None:
            planned.append(PlannedPoint(point, "run", damaged))
        else:
            planned.append(PlannedPoint(point, "run", "new" if point.name not in done else "params changed"))
    if only is not None and not planned:
        names = ", ".join(p.name for p in points[:5]) + (", ..." if len(points) > 5 else "")
        raise ValueError(f"--only {only!r} matches none of the {len(points)} points of sweep {spec.name} "
                         f"({names}); it is a glob on point names, e.g. --only '{points[0].name[:12]}*'")
    return planned


def _latest_records(layout: SweepLayout) -> dict[str, Any]:
    table = results.latest_rows(results.read_table(layout.table))
    return dict(zip(table["point"], table["record"])) if "record" in table else {}


def _record_problem(layout: SweepLayout, record: Any) -> str | None:
    """Why a finished point's record cannot be used (its point runs again), or None. A row without a
    record (an out-of-memory crash before the notebook wrote one) has nothing to check."""
    if not isinstance(record, str) or not record:
        return None
    path = layout.results_dir / record
    problem = results.read_record(path)[1]
    return None if problem is None else f"finished, but its record {path} is unusable: {problem}"


def damaged_rows(layout: SweepLayout) -> list[results.DamagedRow]:
    """Rows of the sweep's table that were left out as damaged (their points run again)."""
    return results.scan_table(layout.table)[1] if layout.table.exists() else []


def run_sweep(
    spec: SweepSpec,
    *,
    layout: SweepLayout,
    force: bool = False,
    only: str | None = None,
    kernel: str | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    budget_s: float | None = None,
    wait_s: float = 0.0,
) -> list[dict[str, Any]]:
    """Run every pending point of ``spec``; returns the rows appended (one per point run).

    ``budget_s``: start no new point once this many seconds have passed; the points not started stay
    pending (no row), so the next run picks them up. ``wait_s``: how long to wait for another sweep of
    the same table to finish before refusing (``lock.SweepBusy``).
    """
    start = time.monotonic()
    check_kernel(kernel or spec.kernel)
    # Nothing to run needs no lock (a read-only results folder can still answer "all done").
    if not any(p.action == "run" for p in plan_sweep(spec, layout, force=force, only=only)):
        for row in damaged_rows(layout):
            log(f"warning: {row}")
        log(f"sweep {spec.name}: every point has finished; nothing to run (table {layout.table}; --force runs "
            "them again)")
        return []
    with SweepLock(layout.table, wait_s=wait_s):  # plan only once we own the table: the other may have finished points
        for row in damaged_rows(layout):
            log(f"warning: {row}")
        return _run_locked(spec, layout, force, only, kernel, progress, log, budget_s, start)


def _run_locked(spec, layout, force, only, kernel, progress, log, budget_s, start) -> list[dict[str, Any]]:
    planned = plan_sweep(spec, layout, force=force, only=only)
    pending = [p for p in planned if p.action == "run"]
    skipped = len(planned) - len(pending)
    log(f"sweep {spec.name}: {len(planned)} points, {skipped} already finished, {len(pending)} to run "
        f"(on {host_description()})")
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", results.DamagedTableWarning)
        frontier = OomFrontier(spec, {} if force else results.latest_status(layout.table))
    for i, plan in enumerate(pending):
        point, label = plan.point, f"[{i + 1}/{len(pending)}] {plan.point.name}"
        if budget_s is not None and time.monotonic() - start > budget_s:
            log(f"sweep {spec.name}: time budget of {budget_s:.0f} s spent; {len(pending) - i} points left "
                "pending for the next run")
            break
        reason = frontier.blocks(point)
        if reason is not None:
            row = build_row(spec.name, point, "skipped", reason, 0.0, None, layout, layout.record(point), None)
        else:
            log(f"{label}: started" + (f" ({plan.reason})" if plan.reason not in ("new", "params changed") else ""))
            with sweep_output.Heartbeat(label, layout.notebook_out(point), log, enabled=progress):
                row = _run_point_isolated(spec, point, layout, kernel or spec.kernel)
            frontier.note(point, row["status"])
        _append(layout, row, log)
        rows.append(row)
        log(f"{label}: {sweep_output.result_line(row)}")
    counts = {s: sum(r["status"] == s for r in rows) for s in results.STATUSES}
    log(f"sweep {spec.name}: done; this run " + ", ".join(f"{k}={v}" for k, v in counts.items() if v))
    for line in sweep_output.summary_table(rows):
        log(line)
    experiments = layout.results_dir.parent
    log(f"table {layout.table}; records in {layout.results_dir / spec.name}")
    log(f"report: turbo-moe report --experiments-dir {experiments} (figures in {experiments / 'runs' / 'report'})")
    return rows


def _run_point_isolated(spec: SweepSpec, point: SweepPoint, layout: SweepLayout, kernel: str) -> dict[str, Any]:
    """``run_point``, and if the runner itself fails on this point's outcome, an error row saying so."""
    start = time.perf_counter()
    try:
        check_kernel(kernel)  # the kernel as installed now (another install may have replaced it mid-sweep)
        return run_point(spec, point, layout=layout, kernel=kernel)
    except Exception as exc:  # isolation: one odd point never stops the sweep
        return build_row(spec.name, point, "error", f"the sweep runner failed on this point: "
                         f"{type(exc).__name__}: {exc}", time.perf_counter() - start, None, layout,
                         layout.record(point), None)


def _append(layout: SweepLayout, row: dict[str, Any], log: Callable[[str], None]) -> None:
    """Append the row; a table that cannot be written (a full disk) stops the sweep with an OSError that
    names the table and the point (which has no row, so it runs again next time)."""
    for attempt in range(2):
        try:
            results.append_row(layout.table, row)
            return
        except OSError as exc:
            if attempt == 0:
                log(f"warning: cannot write {layout.table} ({exc.strerror or exc}); trying once more")
                time.sleep(1.0)
                continue
            free = _free_bytes(layout.table.parent)
            raise OSError(exc.errno, f"cannot write the results table {layout.table}: {exc.strerror or exc}"
                          f"{free}; point {row['point']} ended {row['status']} but has no row, so it runs again "
                          "on the next sweep; earlier rows are intact") from None


def _free_bytes(folder: Path) -> str:
    try:
        return f" ({shutil.disk_usage(folder).free} bytes free there)"
    except OSError:
        return ""


class OomFrontier:
    """The points of ``spec.oom_frontier`` known to run out of memory (from the table and this run).

    A point is blocked when a point with the same other parameters and a smaller or equal frontier value
    ran out of memory: a larger per-device batch of the same config cannot fit either.
    """

    def __init__(self, spec: SweepSpec, latest: dict[str, tuple[str, str]]):
        self.param = spec.oom_frontier
        self.ooms: dict[str, list[tuple[float, str]]] = {}
        if self.param is not None:
            for point in spec.expand():
                if latest.get(point.name) == (point.key, "oom"):
                    self.note(point, "oom")

    def _others(self, point: SweepPoint) -> str | None:
        if self.param is None or not isinstance(point.params.get(self.param), (int, float)):
            return None
        return params_key({k: v for k, v in point.params.items() if k != self.param})

    def note(self, point: SweepPoint, status: str) -> None:
        """Record a finished point: an OOM joins the frontier; any other outcome replaces an older OOM."""
        others = self._others(point)
        if others is None:
            return
        known = [entry for entry in self.ooms.get(others, []) if entry[1] != point.name]
        if status == "oom":
            known.append((point.params[self.param], point.name))
        self.ooms[others] = known

    def blocks(self, point: SweepPoint) -> str | None:
        """Why ``point`` is not run, or None to run it."""
        others = self._others(point)
        for value, name in self.ooms.get(others, []) if others is not None else []:
            if point.params[self.param] >= value:
                return (f"not run: {self.param}={value} of the same configuration ran out of memory "
                        f"(point {name}); oom_frontier={self.param}")
        return None


def run_point(spec: SweepSpec, point: SweepPoint, *, layout: SweepLayout, kernel: str) -> dict[str, Any]:
    """Execute one point's notebook and turn the outcome into a results row. Never raises on failure."""
    record_path, notebook_out = layout.record(point), layout.notebook_out(point)
    # The notebook writes next to the final record; it replaces the old one only once the point is
    # done, so a kill mid-point never leaves an earlier row pointing at a missing record. The name is
    # this process's own, so no other process can take it.
    partial = record_path.with_name(f"{record_path.name}.{os.getpid()}.partial")
    start = time.perf_counter()
    try:
        # Under the sweep lock, any partial record of this point is a dead sweep's leftover.
        for stale in (*record_path.parent.glob(f"{glob.escape(record_path.name)}*.partial"), notebook_out):
            stale.unlink(missing_ok=True)  # a stale record must never pass for this run's result
        record_path.parent.mkdir(parents=True, exist_ok=True)
        notebook_out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # this point's files cannot be made: its row says why, the sweep goes on
        return build_row(spec.name, point, "error", f"cannot prepare the point's files: {exc}", 0.0, None,
                         layout, record_path, None)
    params = {**point.params, "result_json": str(partial.resolve()), "run_name": f"{spec.name}/{point.name}"}
    status, error = execute_notebook(spec, params, notebook_out, kernel)
    elapsed = time.perf_counter() - start
    record, problem = results.read_record(partial) if partial.exists() else (None, None)
    if record is not None and record.get("status", "ok") not in results.STATUSES:
        record, problem = None, f"its status {record.get('status')!r} is not one of {results.STATUSES}"
    if record is not None:
        os.replace(partial, record_path)
        # The notebook's own verdict wins for oom/nan; a crash after an ok record stays an error.
        rec_status = record.get("status", "ok")
        if rec_status != "ok" or status == "ok":
            status, error = rec_status, record.get("error") or error
    elif problem is not None:
        # Never moved over the final record: an earlier finished run's record stays where its row points.
        kept = record_path.with_name(record_path.name + ".rejected")
        try:
            os.replace(partial, kept)
        except OSError:
            partial.unlink(missing_ok=True)
            kept = None
        status, error = "error", (f"the notebook's record is unusable: {problem}"
                                  + (f"; kept as {kept}" if kept else "") + (f"; the run said: {error}" if error else ""))
    else:
        # This run has no record: its row says so (record None). An older finished run's record stays at
        # record_path, where that run's row (still in the table) points: a failed --force re-run loses nothing.
        partial.unlink(missing_ok=True)
        if status == "ok" and spec.record:
            status, error = "error", f"the notebook finished but wrote no record at result_json={partial}"
    if status != "ok":
        error = _with_disk_context(error, notebook_out, layout)
        if not _is_whole_notebook(notebook_out):  # cut short by the failure (a full disk): not a notebook
            notebook_out.unlink(missing_ok=True)
            notebook_out = None
    error = results.keep_full_error(record_path, error)
    return build_row(spec.name, point, status, error, elapsed, record, layout, record_path, notebook_out)


def _is_whole_notebook(path: Path) -> bool:
    try:
        json.loads(path.read_text())
        return True
    except (OSError, ValueError):
        return False


def _with_disk_context(error: str | None, notebook_out: Path, layout: SweepLayout) -> str | None:
    """A full-disk error often names no file: add where the point was writing and the free space."""
    if not error or not ("No space left on device" in error or f"Errno {errno.ENOSPC}" in error):
        return error
    return (f"{error} (this point writes {notebook_out} and its record under {layout.results_dir / layout.sweep}"
            f"{_free_bytes(layout.results_dir) or ''}; free some space and run the sweep again)")


def execute_notebook(spec: SweepSpec, params: dict[str, Any], notebook_out: Path, kernel: str) -> tuple[str, str | None]:
    """Run the notebook through papermill; returns (status, error message or None)."""
    import papermill  # deferred: its import is slow and dry runs do not need it

    try:
        papermill.execute_notebook(
            str(spec.notebook),
            str(notebook_out),
            parameters=params,
            kernel_name=kernel,
            cwd=str(spec.notebook.parent),
            execution_timeout=spec.cell_timeout_s,
            progress_bar=False,
            autosave_cell_every=sweep_output.AUTOSAVE_S,  # what the heartbeat reads
            # The kernel logs a transport warning at start-up; its output reaches the notebook, not its log.
            extra_arguments=["--IPKernelApp.log_level=ERROR"],
        )
    except Exception as exc:  # isolation: any failure of one point becomes its row, the sweep goes on
        return classify_error(exc)
    return "ok", None


def classify_error(exc: BaseException) -> tuple[str, str]:
    """(status, message) for a failed point: ``oom`` when the device ran out of memory, else ``error``."""
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None) or str(exc)
    message = f"{ename}: {evalue}".strip()
    if type(exc).__name__ == "DeadKernelError":
        message += " (the kernel died; a host out-of-memory kill is a common cause)"
    status = "oom" if is_oom(message) else "error"
    return status, message  # cut for the table by results.keep_full_error, kept whole beside the record


def build_row(
    sweep: str,
    point: SweepPoint,
    status: str,
    error: str | None,
    elapsed: float,
    record: dict[str, Any] | None,
    layout: SweepLayout,
    record_path: Path,
    notebook_out: Path | None,
) -> dict[str, Any]:
    """One results row: point parameters, status, summary fields, provenance and file paths."""
    row: dict[str, Any] = {
        "sweep": sweep, "point": point.name, "point_key": point.key, "status": status, "error": error,
    }
    row.update({k: v for k, v in point.params.items() if k not in row})
    summary = (record or {}).get("summary") or {}
    for key in (*SUMMARY_FIELDS, *summary):
        if key not in row:
            row[key] = summary.get(key)
    row.update(provenance((record or {}).get("provenance") or {}))
    row["elapsed_s"] = round(elapsed, 3)
    row["record"] = str(record_path.relative_to(layout.results_dir)) if record is not None else None
    # Relative to experiments/ so that committed tables do not carry one machine's absolute paths.
    row["notebook_out"] = os.path.relpath(notebook_out, layout.results_dir.parent) if notebook_out else None
    return row


def provenance(from_record: dict[str, Any]) -> dict[str, Any]:
    """Provenance columns: the record's when present, else what the sweep process can tell.

    The sweep process never initialises a JAX backend itself (on a GPU that would take the memory the
    notebook kernel needs), so a point that failed before writing a record has no device kind.
    """
    return table_columns(from_record, collect_provenance(devices=False))


def host_description() -> str:
    """Short text about the machine running the sweep process (for logs)."""
    return f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs)"
