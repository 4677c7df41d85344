"""Fault cases of `turbo-moe train` and `turbo-moe launch`: records never replaced in silence, no process outliving
its launcher, and one line (no traceback) for each user error. Each case refuses before any training step: the
checks under test run before JAX compiles anything, so every case takes seconds."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from harness import REPO, TRACEBACK, Outcome, cli_run

TINY = REPO / "experiments" / "configs" / "tiny.yaml"


def _one_line(rc: int, err: str, *expected: str) -> None:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and all(e in lines[0] for e in expected), (rc, err)


def _finished_run(folder: Path, steps: int = 12) -> Path:
    """What a finished run leaves: a record, its curves and the checkpoint of its last step."""
    (folder / "checkpoint" / str(steps)).mkdir(parents=True)
    (folder / "history.csv").write_text("step,loss\n0,7.0\n")
    record = folder / "record.json"
    record.write_text(json.dumps({"status": "ok", "summary": {"steps_done": steps, "tgs": 212.8}}))
    return record


def records_never_replaced(root: Path, o: Outcome) -> str:
    from turbo_moe.train import run_folder
    from turbo_moe.train.launch import resolve_run

    folders = []
    for _ in range(2):  # two trains of one config: two folders
        _, plan = resolve_run(TINY, root=root / "runs")
        run_folder.prepare(plan)
        folders.append(plan.folder.name)
    assert folders == ["tiny-1", "tiny-2"], folders
    record = _finished_run(root / "done")
    before = record.read_bytes()
    rc, out, err = cli_run(["train", str(TINY), "--out", str(root / "done"), "--set", "resume=true"], o)
    assert rc == 0 and "is finished" in out and "unchanged" in out and not err, (out, err)
    rc, _, err = cli_run(["train", str(TINY), "--out", str(root / "done")], o)
    _one_line(rc, err, "already holds a run (record.json (status ok, 12 steps)", "--overwrite")
    (root / "a_file").write_text("x")
    rc, _, err = cli_run(["train", str(TINY), "--out", str(root / "new"), "--record", str(root / "a_file" / "r.json")],
                         o)
    _one_line(rc, err, "a_file is a file, not a folder")
    rc, _, err = cli_run(["train", str(TINY), "--out", str(root / "new"), "--record", str(root / "done")], o)
    _one_line(rc, err, "is a folder; give a file path")
    assert record.read_bytes() == before and not (root / "new").exists()
    return ("runs/tiny-1, runs/tiny-2; a finished run resumed: 'is finished', exit 0, record unchanged; a folder "
            "holding a run, --record under a file or naming a folder: one line before training")


# One process imports the launcher once and forks a launcher per signal (each starting two sleeping children), so the
# case pays the package's import once. A launcher's output goes to <signal>/out.txt.
LAUNCHERS = """
    import json, os, sys
    from pathlib import Path
    from turbo_moe.train.launch import launch_local
    root, config = Path(sys.argv[1]), sys.argv[2]
    pids = {}
    for name in sys.argv[3:]:
        pid = os.fork()
        if pid == 0:
            out = os.open(root / name / "out.txt", os.O_WRONLY | os.O_CREAT)
            os.dup2(out, 1), os.dup2(out, 2)
            code = launch_local(config, processes=2, cpu_devices=1, python=str(root / name / "python"),
                                out=root / name / "run", log_dir=root / name / "logs")
            sys.stdout.flush()
            os._exit(code)
        pids[name] = pid
    print(json.dumps(pids), flush=True)
    print(json.dumps({name: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for name, pid in pids.items()}))
"""
SLEEPER = """#!{python}
import os, sys, time
open(os.path.join({folder!r}, "pid" + os.environ["TURBO_MOE_PROCESS_ID"]), "w").write(str(os.getpid()))
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited: only its parent (init, after a SIGKILL) has yet to reap it


def launch_children_die_with_it(root: Path, o: Outcome) -> str:
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
    for sig in signals:
        folder = root / sig.name
        folder.mkdir()
        fake = folder / "python"
        fake.write_text(SLEEPER.format(python=sys.executable, folder=str(folder)))
        fake.chmod(0o755)
    script = root / "launchers.py"
    script.write_text(textwrap.dedent(LAUNCHERS))
    hub = subprocess.Popen([sys.executable, str(script), str(root), str(TINY), *(s.name for s in signals)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        launchers = json.loads(hub.stdout.readline())
        deadline = time.monotonic() + 120
        while not all((root / s.name / "pid1").exists() for s in signals) and time.monotonic() < deadline:
            time.sleep(0.1)
        children = {s: [int((root / s.name / f"pid{rank}").read_text()) for rank in (0, 1)] for s in signals}
        for sig in signals:
            os.kill(launchers[sig.name], sig)
        out, err = hub.communicate(timeout=60)
    finally:
        if hub.poll() is None:
            hub.kill()
    codes = json.loads(out)
    texts = {s: (root / s.name / "out.txt").read_text() for s in signals}
    o.tracebacks += (err + "".join(texts.values())).count(TRACEBACK)
    end = time.monotonic() + 15
    while any(_alive(pid) for pids in children.values() for pid in pids) and time.monotonic() < end:
        time.sleep(0.1)
    left = [f"{s.name}: pid {pid}" for s, pids in children.items() for pid in pids if _alive(pid)]
    assert not left, f"children left running after their launcher was stopped: {left}"
    stopped = [line for line in texts[signal.SIGINT].splitlines() if "stopped" in line]
    assert len(stopped) == 1 and "stopped (Ctrl-C)" in stopped[0], texts[signal.SIGINT]
    assert (codes["SIGINT"], codes["SIGTERM"], codes["SIGKILL"]) == (130, 143, -9), codes
    return "SIGTERM, SIGINT (one line: 'stopped (Ctrl-C)'), SIGKILL to the launcher: 0 of its 6 children left"


def launch_counts_and_devices(root: Path, o: Outcome) -> str:
    for args, expected in ((["--processes", "0", "--cpu-devices", "1"], "--processes must be a positive int, got 0"),
                           (["--processes", "-2", "--cpu-devices", "1"], "--processes must be a positive int, got -2"),
                           (["--gpus", "0"], "--gpus must be a positive int, got 0")):
        rc, _, err = cli_run(["launch", *args, str(TINY), "--out", str(root / "run")], o)
        _one_line(rc, err, expected)
    rc, _, err = cli_run(["launch", "--cpu-devices", "1", "--processes", "2", str(TINY), "--set", "expert_parallel=4",
                          "--out", str(root / "run")], o)
    _one_line(rc, err, "expert_parallel=4 does not divide the 2 device(s) launch gives")
    assert not (root / "run").exists()  # refused before a folder or a child
    return "--processes 0 / -2, --gpus 0, expert_parallel=4 on 2 devices: one line each, before any child starts"


def taken_coordinator_port(root: Path, o: Outcome) -> str:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, _, err = cli_run(["launch", "--cpu-devices", "1", "--port", str(port), str(TINY), "--out",
                              str(root / "run")], o)
        _one_line(rc, err, f"--port {port}: the coordinator port is taken", "choose another")
        job = {"TURBO_MOE_COORDINATOR": f"127.0.0.1:{port}", "TURBO_MOE_NUM_PROCESSES": "2",
               "TURBO_MOE_PROCESS_ID": "0"}
        saved = {k: os.environ.get(k) for k in job}
        os.environ.update(job)
        try:
            rc, _, err = cli_run(["train", str(TINY), "--out", str(root / "run")], o)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        _one_line(rc, err, f"the coordinator port {port} is taken", "TURBO_MOE_COORDINATOR=")
    return "launch --port and a job's process 0: one line naming the port and how to choose another"


def resume_with_other_experts(root: Path, o: Outcome) -> str:
    import jax.numpy as jnp

    from turbo_moe.train.checkpoint import Checkpointer
    from turbo_moe.train.launch import load_train_config

    config = load_train_config(TINY, [f"checkpoint_dir={root / 'run' / 'checkpoint'}"]).resolved()
    ckpt = Checkpointer(root / "run" / "checkpoint")
    ckpt.save(4, {"w": jnp.zeros((4,))}, {"step": 4, "history": [], "config": config.to_dict()})
    assert ckpt.finish() is None
    rc, _, err = cli_run(["train", str(TINY), "--out", str(root / "run"), "--set", "resume=true", "--set",
                          "model_overrides.n_experts=4", "--set", "progress=false"], o)
    _one_line(rc, err, "cannot resume: the checkpoint was written by a different run (model_overrides=",
              "'n_experts': 4")
    assert not (root / "run" / "record.json").exists()
    return "refused in one line naming model_overrides (n_experts 8 -> 4), before initialising; no record written"


def binary_config(root: Path, o: Outcome) -> str:
    path = root / "config.yaml"
    path.write_bytes(b"\xff\xfe\x00s\x00t\x00e\x00p\x00s\x00")
    for command in ("train", "launch"):
        rc, _, err = cli_run([command, str(path), "--out", str(root / "run")] +
                             (["--cpu-devices", "1"] if command == "launch" else []), o)
        _one_line(rc, err, f"config file '{path}': not UTF-8 text (byte 0 is 0xff)")
    return "train and launch: one line naming the file and the first byte that is not UTF-8"


RUN_FAULTS = [
    ("24 a second train, a finished resume, --record paths", records_never_replaced),
    ("25 SIGTERM, SIGINT, SIGKILL to turbo-moe launch", launch_children_die_with_it),
    ("26 launch --processes 0, expert_parallel over the devices", launch_counts_and_devices),
    ("27 a taken coordinator port", taken_coordinator_port),
    ("28 resume with another num_experts", resume_with_other_experts),
    ("29 a binary YAML config", binary_config),
]
