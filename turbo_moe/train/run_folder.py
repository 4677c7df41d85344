"""A training run's own folder: where `turbo-moe train` and `turbo-moe launch` put everything a run leaves.

    runs/<config stem>-<n>/       (or --out DIR; n: one more than the highest number taken, never reused)
        record.json               the RunResult: status, summary, per-step history, provenance
        history.csv               the per-step curves (the history's columns of one number each)
        events.out.tfevents.*     the same curves for TensorBoard: `tensorboard --logdir runs`
        checkpoint/               orbax checkpoints, unless the config names a `checkpoint_dir` (null: none)

A record is never replaced in silence. `plan_run` decides, before any JAX work, what a run does with its folder,
and refuses in one line (`RunFolderError`, a ValueError) what would lose a record or fail only at the end:
- a folder that already holds a run (its record, curves, events or checkpoints): another `--out`, `--overwrite`
  (clears the folder's run files first), or `resume=true` to continue its checkpoint;
- `resume=true` on a run already at its last step: `finished`, nothing to do (the caller changes nothing);
- `resume=true` without a folder to continue (neither `--out` nor a `checkpoint_dir`);
- a file where a folder must be, a folder where the record file must be, an existing `--record` file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

DEFAULT_ROOT = Path("runs")
RECORD = "record.json"
HISTORY = "history.csv"
CHECKPOINT = "checkpoint"
EVENTS_GLOB = "events.out.tfevents.*"


class RunFolderError(ValueError):
    """The run's output locations would lose a record or cannot hold it (the message says which and why)."""


class FolderTaken(RunFolderError):
    """Another run took this new default folder between the plan and its creation: plan again (the next number)."""


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Where a run writes, and what it continues.

    folder: the run folder; record: the record's path (folder/record.json unless --record);
    fresh_folder: the folder is a new default one (`reserve` creates it); resume_from: the step the checkpoint
    continues from (None: a new run); finished: resume of a run already at its last step (nothing to run).
    """

    folder: Path
    record: Path
    checkpoint_dir: Path | None
    own_checkpoint: bool
    fresh_folder: bool
    resume_from: int | None = None
    finished: bool = False


def names_checkpoint_dir(values: Mapping[str, Any]) -> bool:
    """Whether a config's values (as the file and --set give them) name a checkpoint_dir, null included."""
    section = values.get("checkpoint")
    return "checkpoint_dir" in values or (isinstance(section, Mapping) and "dir" in section)


def with_run_checkpoint(values: Mapping[str, Any], folder: Path) -> dict[str, Any]:
    """`values` with checkpoint_dir = folder/checkpoint where they name none: the run folder holds the checkpoint."""
    out = dict(values)
    if not names_checkpoint_dir(values):
        out["checkpoint_dir"] = str(folder / CHECKPOINT)
    return out


def next_folder(stem: str, root: Path = DEFAULT_ROOT) -> Path:
    """root/<stem>-<n>, n one more than the highest taken (a deleted run's number is not given out again)."""
    pattern = re.compile(rf"{re.escape(stem)}-(\d+)")
    taken = [int(m.group(1)) for p in (root.iterdir() if root.is_dir() else ())
             if (m := pattern.fullmatch(p.name))]
    return root / f"{stem}-{max(taken, default=0) + 1}"


def saved_steps(checkpoint_dir: Path | None) -> list[int]:
    """The steps orbax finished saving in `checkpoint_dir` (its `<step>/` folders), ascending."""
    if checkpoint_dir is None or not checkpoint_dir.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoint_dir.iterdir() if p.name.isdigit() and p.is_dir())


def describe_record(path: Path) -> str:
    """'status ok, 12 steps' for a record file, or why it cannot be read."""
    try:
        data = json.loads(path.read_text())
        summary = data.get("summary") or {}
        return f"status {data.get('status')}, {summary.get('steps_done', '?')} steps"
    except (OSError, ValueError, AttributeError) as exc:
        return f"unreadable: {type(exc).__name__}"


def run_files(folder: Path) -> list[str]:
    """The files of an earlier run in `folder` (checkpoints apart), as one would name them."""
    found = []
    if (folder / RECORD).is_file():
        found.append(f"{RECORD} ({describe_record(folder / RECORD)})")
    if (folder / HISTORY).exists():
        found.append(HISTORY)
    if any(folder.glob(EVENTS_GLOB)):
        found.append("TensorBoard events")
    return found


def _check_file_path(path: Path, what: str) -> None:
    """`path` can become a file: it is not a folder and no existing ancestor of it is a file."""
    if path.is_dir():
        raise RunFolderError(f"{what} {path} is a folder; give a file path (e.g. {path / RECORD})")
    _check_ancestors(path, what)


def _check_ancestors(path: Path, what: str) -> None:
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise RunFolderError(f"{what} {path}: {parent} is a file, not a folder")
            return


def plan_run(config, folder: Path, *, record: Path | None = None, overwrite: bool = False, own_checkpoint: bool,
             fresh_folder: bool) -> RunPlan:
    """What a run of `config` (a TrainConfig whose checkpoint_dir is already resolved) does with `folder`.

    `own_checkpoint`: the checkpoint_dir is folder/checkpoint (the config named none); `fresh_folder`: `folder` is
    a new default folder (`--out` not given). Raises RunFolderError; nothing is written."""
    checkpoint_dir = Path(config.checkpoint_dir).expanduser() if config.checkpoint_dir else None
    record_path = record if record is not None else folder / RECORD
    if overwrite and config.resume:
        raise RunFolderError("--overwrite starts the run folder over and resume=true continues it: choose one")
    if config.resume and fresh_folder and own_checkpoint:
        number = re.fullmatch(r"(.*)-(\d+)", folder.name)
        latest = folder.with_name(f"{number.group(1)}-{max(int(number.group(2)) - 1, 1)}") if number else folder
        raise RunFolderError(f"resume=true continues a run: name its folder with --out (e.g. --out {latest})")
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"--out {folder} is a file, not a folder")
    _check_ancestors(folder, "--out")
    _check_file_path(record_path, "--record" if record is not None else "the record")
    if checkpoint_dir is not None:
        if checkpoint_dir.exists() and not checkpoint_dir.is_dir():
            raise RunFolderError(f"checkpoint_dir {checkpoint_dir} is a file, not a folder")
        _check_ancestors(checkpoint_dir, "checkpoint_dir")
    steps = saved_steps(checkpoint_dir)
    found = run_files(folder) if folder.is_dir() else []
    if config.resume:
        if steps and steps[-1] == config.steps:
            return RunPlan(folder, record_path, checkpoint_dir, own_checkpoint, fresh_folder, steps[-1], True)
        if not steps and found:
            raise RunFolderError(f"resume=true, but {folder} holds a run ({', '.join(found)}) and no checkpoint to "
                                 "continue; --overwrite starts it over, or give another --out")
        if record is not None and record.exists() and record != folder / RECORD and not overwrite:
            raise RunFolderError(f"--record {record} already holds a record ({describe_record(record)}); give another "
                                 "path")
        return RunPlan(folder, record_path, checkpoint_dir, own_checkpoint, fresh_folder, steps[-1] if steps else None)
    if overwrite:
        if steps and not own_checkpoint:
            raise RunFolderError(f"checkpoint_dir {checkpoint_dir} holds checkpoints (steps {_steps_text(steps)}) of "
                                 "an earlier run; --overwrite clears only the run folder's own: remove them, or give "
                                 "another checkpoint_dir")
        return RunPlan(folder, record_path, checkpoint_dir, own_checkpoint, fresh_folder)
    if steps:
        found.append(f"checkpoints at steps {_steps_text(steps)}" + ("" if own_checkpoint else f" in {checkpoint_dir}"))
    if found:
        resume = ", or --set resume=true to continue it" if steps else ""
        raise RunFolderError(f"{folder} already holds a run ({'; '.join(found)}); give another --out, --overwrite to "
                             f"replace it{resume}")
    if record is not None and record.exists():
        raise RunFolderError(f"--record {record} already holds a record ({describe_record(record)}); give another "
                             "path, or --overwrite to replace it")
    return RunPlan(folder, record_path, checkpoint_dir, own_checkpoint, fresh_folder)


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[-3:])) if len(steps) <= 3 else f"{steps[0]} ... {steps[-1]}"


def prepare(plan: RunPlan, *, overwrite: bool = False) -> None:
    """Make the folders the plan writes to; with `overwrite`, remove the earlier run's files first. Raises
    RunFolderError (e.g. no permission) naming the folder."""
    try:
        try:
            plan.folder.mkdir(parents=True, exist_ok=not plan.fresh_folder)
        except FileExistsError:
            if plan.fresh_folder:
                raise FolderTaken(f"{plan.folder} was taken by another run") from None
            raise
        plan.record.parent.mkdir(parents=True, exist_ok=True)
        if overwrite:
            for name in (RECORD, HISTORY):
                (plan.folder / name).unlink(missing_ok=True)
            for events in plan.folder.glob(EVENTS_GLOB):
                events.unlink()
            plan.record.unlink(missing_ok=True)
            if plan.own_checkpoint and plan.checkpoint_dir is not None and plan.checkpoint_dir.exists():
                shutil.rmtree(plan.checkpoint_dir)
    except OSError as exc:
        raise RunFolderError(f"cannot prepare the run folder {plan.folder}: {exc.strerror or exc}"
                             f"{f' ({exc.filename})' if exc.filename else ''}") from None


def write_history(history: list[dict[str, Any]], path: Path) -> Path:
    """The history's columns of one number each as CSV (NaN as empty), written whole then renamed into place."""
    import csv

    columns = [k for k in dict.fromkeys(k for row in history for k in row)
               if all(_scalar(row.get(k)) for row in history)]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in history:
            writer.writerow(["" if _missing(row.get(k)) else row.get(k) for k in columns])
    tmp.replace(path)
    return path


def _scalar(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))
