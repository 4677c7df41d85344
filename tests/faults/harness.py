"""The fault campaign's harness: scratch sweeps over a toy notebook, child processes, checkpoints, and the
Outcome each case fills in (tests/faults/fault_campaign.py runs the cases)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import nbformat

from turbo_moe import cli
from turbo_moe.experiments.store import results
from turbo_moe.experiments.sweep import runner
from turbo_moe.experiments.sweep.runner import SweepLayout, run_sweep
from turbo_moe.experiments.sweep.spec import spec_from_dict

REPO = Path(__file__).resolve().parents[2]
TRAIN_NOTEBOOK = REPO / "notebooks" / "02_train.ipynb"
CASE_TIMEOUT_S = 300  # a hang, not a slow case: CI runs two test workers on two cores
TRACEBACK = "Traceback (most recent call last)"
TOY_PARAMETERS = "x = 1\nmode = 'ok'\nresult_json = None\nrun_name = None"


@dataclasses.dataclass
class Outcome:
    fault: str
    now: str = ""
    rows_lost: int = 0
    duplicates: int = 0
    hang: bool = False
    tracebacks: int = 0
    passed: bool = True
    problem: str = ""


# ---------------------------------------------------------------------------------------------- helpers

def toy_notebook(folder: Path, cells: tuple[str, ...] = ()) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in (TOY_PARAMETERS, *cells)]
    nb.cells[0].metadata["tags"] = ["parameters"]
    path = folder / "toy.ipynb"
    nbformat.write(nb, path)
    return path


class _Sweep:
    """A toy sweep in ``root``: points x-1..x-n; ``records[x]`` (a callable of params) replaces the notebook."""

    def __init__(self, root: Path, n: int = 3, **spec):
        self.root = root
        self.spec = spec_from_dict({"name": "toy", "notebook": str(toy_notebook(root)), "grid": {"x": list(range(1, n + 1))},
                                    **spec})
        self.layout = SweepLayout(results_dir=root / "results", runs_dir=root / "runs", sweep="toy")
        self.records: dict[int, Callable[[dict], object]] = {}
        self.log: list[str] = []

    def execute(self, spec, params, notebook_out, kernel):
        make = self.records.get(params["x"], lambda p: {"status": "ok", "summary": {"tgs": float(p["x"])}})
        record = make(params)
        if isinstance(record, tuple):  # (status, error): the notebook failed
            return record
        with open(params["result_json"], "w") as f:
            f.write(record if isinstance(record, str) else json.dumps(record))
        return "ok", None

    def run(self, **kwargs) -> list[dict]:
        saved = runner.execute_notebook, runner.check_kernel
        runner.execute_notebook, runner.check_kernel = self.execute, lambda name: None
        try:
            return run_sweep(self.spec, layout=self.layout, progress=False, log=self.log.append, **kwargs)
        finally:
            runner.execute_notebook, runner.check_kernel = saved

    def table(self):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return results.read_table(self.layout.table)


def count_rows(sweep: _Sweep, expected_ok: list[str], outcome: Outcome, rerun: tuple[str, ...] = ()) -> None:
    """Rows lost: expected finished points without a final row; duplicates: a point finished twice with the
    same parameters, except those the fault rightly sends round again (``rerun``: a damaged record)."""
    table = sweep.table()
    final = table[table["status"].isin(results.FINAL_STATUSES)]
    outcome.rows_lost += sum(1 for p in expected_ok if p not in set(final["point"]))
    again = final[~final["point"].isin(rerun)]
    outcome.duplicates += int(again.duplicated(subset=["point", "point_key"]).sum())


def cli_run(argv: list[str], outcome: Outcome) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    outcome.tracebacks += (out.getvalue() + err.getvalue()).count(TRACEBACK)
    return rc, out.getvalue(), err.getvalue()


def child(code: str, *args: str, timeout: float = 90, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    script = Path(args[0]) / f"child_{time.monotonic_ns()}.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([*prefix, sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout)


def spec_file(folder: Path, text: str, name: str = "spec.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def can_mount_tmpfs(folder: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=64k tmpfs {folder}"], capture_output=True)
    return probe.returncode == 0


# ------------------------------------------------------------------------------ the 11 held (FAULTS 1-9f)


def _checkpointer(path: Path):
    from turbo_moe.train.checkpoint import Checkpointer

    return Checkpointer(path, keep=5)


def _save(ckpt, step: int, seed: int = 0, steps: int = 10) -> None:
    import jax.numpy as jnp

    ckpt.save(step, {"w": jnp.full((4,), float(step))}, {"step": step, "config": {"seed": seed, "steps": steps}})




def refused_restore(ckpt, config: dict, expected: str, what: str) -> None:
    """Restoring `ckpt` with `config` must raise a ValueError containing `expected`; `what` names the failure."""
    import jax.numpy as jnp

    try:
        ckpt.restore({"w": jnp.zeros((4,))}, config=config)
        raise AssertionError(what)
    except ValueError as exc:
        assert expected in str(exc), exc
    finally:
        ckpt.finish()
