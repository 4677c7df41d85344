"""A run's folder (turbo_moe/train/run_folder.py): numbered, never reused, checked before a run starts, and what the
shipped configs ask of the devices their headers run them on. File-system work only: no JAX program runs here."""

import json
import math
import re
import shlex
from pathlib import Path

import pytest

from turbo_moe.train import run_folder
from turbo_moe.train.launch import prepared, resolve_run
from turbo_moe.train.run_folder import RunFolderError

CONFIGS = Path(__file__).resolve().parents[2] / "experiments" / "configs"


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text("model: tiny\ndataset: synthetic\nsteps: 12\nseq_len: 32\n")
    return path


def finished_run(folder: Path, steps: int = 12) -> Path:
    """What a finished run leaves: its record, curves, events and a checkpoint at its last step."""
    (folder / "checkpoint" / str(steps)).mkdir(parents=True)
    record = folder / "record.json"
    record.write_text(json.dumps({"status": "ok", "summary": {"steps_done": steps}}))
    (folder / "history.csv").write_text("step,loss\n")
    (folder / "events.out.tfevents.1.host").write_bytes(b"")
    return record


def test_default_folders_are_numbered_and_never_reused(tmp_path, config_file):
    root = tmp_path / "runs"
    config, plan = resolve_run(config_file, root=root)
    assert plan.folder == root / "tiny-1" and plan.record == root / "tiny-1" / "record.json"
    assert config.checkpoint_dir == str(root / "tiny-1" / "checkpoint") and plan.own_checkpoint
    run_folder.prepare(plan)
    (root / "tiny-3").mkdir()
    assert resolve_run(config_file, root=root)[1].folder == root / "tiny-4"  # after the highest, not a gap
    # Two trains of one config at once: the one that finds its planned folder taken takes the next number.
    config, plan = resolve_run(config_file, root=root)
    plan.folder.mkdir()
    config, plan = prepared(config_file, [], config, plan, record=None, overwrite=False, root=root)
    assert plan.folder == root / "tiny-5" and config.checkpoint_dir == str(root / "tiny-5" / "checkpoint")
    # A config that names its checkpoint_dir keeps it (null: no checkpoints at all).
    assert resolve_run(config_file, ["checkpoint_dir=null"], root=root)[0].checkpoint_dir is None
    assert resolve_run(config_file, [f"checkpoint_dir={tmp_path / 'ck'}"], root=root)[1].own_checkpoint is False


def test_a_folder_holding_a_run_is_refused_unless_overwritten_or_resumed(tmp_path, config_file):
    out = tmp_path / "run"
    record = finished_run(out)
    with pytest.raises(RunFolderError, match=r"already holds a run \(record.json \(status ok, 12 steps\); "
                                             r"history.csv; TensorBoard events; checkpoints at steps 12\); give "
                                             r"another --out, --overwrite to replace it, or --set resume=true"):
        resolve_run(config_file, out=out)
    before = record.read_text()
    _, plan = resolve_run(config_file, ["resume=true"], out=out)
    assert plan.finished and plan.resume_from == 12 and record.read_text() == before
    _, plan = resolve_run(config_file, ["resume=true", "steps=20", "lr_schedule_steps=20"], out=out)
    assert not plan.finished and plan.resume_from == 12
    _, plan = resolve_run(config_file, out=out, overwrite=True)
    assert record.exists()  # planning writes nothing
    run_folder.prepare(plan, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == []  # the earlier run's files, its checkpoint included
    with pytest.raises(RunFolderError, match="--overwrite starts the run folder over and resume=true continues"):
        resolve_run(config_file, ["resume=true"], out=out, overwrite=True)


@pytest.mark.parametrize("case, message", [
    ("resume without a folder", r"resume=true continues a run: name its folder with --out"),
    ("out is a file", r"--out .*/a_file is a file, not a folder"),
    ("out under a file", r"--out .*/a_file/run: .*/a_file is a file, not a folder"),
    ("record is a folder", r"--record .*/run is a folder; give a file path"),
    ("record exists", r"--record .*/old.json already holds a record \(status ok, 3 steps\)"),
    ("record of a run without a checkpoint", r"resume=true, but .* holds a run .* and no checkpoint to continue"),
])
def test_locations_are_checked_before_the_run(tmp_path, config_file, case, message):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "run").mkdir()
    (tmp_path / "old.json").write_text(json.dumps({"status": "ok", "summary": {"steps_done": 3}}))
    kwargs = {
        "resume without a folder": dict(sets=["resume=true"], root=tmp_path / "runs"),
        "out is a file": dict(out=tmp_path / "a_file"),
        "out under a file": dict(out=tmp_path / "a_file" / "run"),
        "record is a folder": dict(out=tmp_path / "new", record=tmp_path / "run"),
        "record exists": dict(out=tmp_path / "new", record=tmp_path / "old.json"),
        "record of a run without a checkpoint": dict(out=tmp_path / "run", sets=["resume=true"]),
    }[case]
    if case.startswith("record of a run"):
        (tmp_path / "run" / "record.json").write_text("{}")
    sets = kwargs.pop("sets", [])
    with pytest.raises(RunFolderError, match=message):
        resolve_run(config_file, sets, **kwargs)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "new").exists()


def test_history_csv_keeps_the_numeric_columns(tmp_path):
    rows = [{"step": 0, "loss": 7.0, "ce_loss": 5.5, "eval_loss": math.nan, "per_layer": [1.0, 2.0]},
            {"step": 1, "loss": 6.9, "ce_loss": 5.4, "eval_loss": 5.6, "per_layer": [1.0, 2.5]}]
    path = run_folder.write_history(rows, tmp_path / "history.csv")
    assert path.read_text().splitlines() == ["step,loss,ce_loss,eval_loss", "0,7.0,5.5,", "1,6.9,5.4,5.6"]


def _devices(command: list[str], config_text: str) -> int | None:
    """The devices a header command runs on: launch's counts, one CPU device for a CPU config's `train`."""
    if command[1] == "launch":
        args = dict(zip(command[2::], command[3::]))
        if "--gpus" in args:
            return int(args["--gpus"])
        return int(args["--cpu-devices"]) * int(args.get("--processes", 2))
    return 1 if "CPU" in config_text.splitlines()[0] else None  # a GPU config's `train`: every GPU of the host


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_shipped_configs_fit_the_devices_their_header_runs_them_on(name, tmp_path):
    path = CONFIGS / name
    text = path.read_text()
    commands = [shlex.split(line.lstrip("# ").split("  #")[0]) for line in text.splitlines()
                if re.match(r"#\s+turbo-moe (train|launch) ", line)]
    assert commands, f"{name}: its header shows no turbo-moe command"
    for command in commands:
        sets = [command[i + 1] for i, arg in enumerate(command) if arg == "--set"]
        config = resolve_run(path, sets, out=tmp_path / "run")[0]  # as the command reads it, its folder's included
        devices = _devices(command, text)
        assert devices is None or devices % config.expert_parallel == 0, (
            f"{name}: `{' '.join(command)}` runs on {devices} device(s) with expert_parallel={config.expert_parallel}")
