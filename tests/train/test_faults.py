"""Checkpoint faults: a failed save is the run's `error` status (never an exception, never a hang at
exit), a full disk is never `oom`, a damaged latest checkpoint falls back to the one before, and a
resume with another config is refused. (tests/FAULTS.md lists them with their results.)"""

import shutil
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from turbo_moe.train import TrainConfig, run
from turbo_moe.train import metrics as M
from turbo_moe.train.checkpoint import Checkpointer, CheckpointError, ResumeRefused, check_resume_config

ENOSPC_TEXT = ("RESOURCE_EXHAUSTED: Error writing local file \"{d}/2.orbax-checkpoint-tmp/state/d/1\": Failed to "
               "write 659118 bytes to file 4: No space left on device [os_error_code='28']")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two tiny layers on synthetic tokens: the cheapest program that still saves a full TrainState."""
    return TrainConfig(model="tiny", model_overrides={"n_layers": 2, "mtp_depth": 0}, dataset="synthetic",
                       data_dir=str(tmp_path_factory.mktemp("data")), per_device_batch=1, seq_len=32, steps=3,
                       warmup_steps=1, eval_every=0, eval_batches=0, progress=False)


def test_checkpoint_dir_that_is_a_file_is_an_error_status(tiny, tmp_path):
    (tmp_path / "ckpt").write_text("not a folder")
    r = run(tiny.replace(checkpoint_dir=str(tmp_path / "ckpt")))
    assert r.status == "error" and str(tmp_path / "ckpt") in r.error and "Not a directory" in r.error
    assert len(r.history) == 3 and r.summary["steps_done"] == 3  # the training itself is kept


def test_full_disk_during_a_periodic_save_is_error_not_oom(tiny, tmp_path, monkeypatch):
    real_save, calls = ocp.CheckpointManager.save, []

    def save_until_disk_full(self, step, *args, **kwargs):
        calls.append(step)
        if step >= 2:
            raise ValueError(ENOSPC_TEXT.format(d=self.directory))
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", save_until_disk_full)
    r = run(tiny.replace(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1))
    assert calls == [1, 2] and r.status == "error", r.error
    assert "No space left on device" in r.error and str(tmp_path / "ckpt") in r.error
    assert "step 2" in r.error and r.summary["steps_done"] == 2


@pytest.mark.parametrize("error, oom", [
    (ValueError(ENOSPC_TEXT.format(d="/x")), False),
    (OSError(28, "No space left on device"), False),
    (CheckpointError("checkpoint save of step 2 in /x failed: OSError: [Errno 122] Disk quota exceeded"), False),
    (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1024 bytes."), True),
    (MemoryError(), True),
])
def test_oom_means_memory_only(error, oom):
    assert M.is_oom(error) is oom


def test_finish_closes_the_manager_even_when_the_last_save_failed(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path / "ckpt")
    closed = []
    monkeypatch.setattr(ckpt._manager, "wait_until_finished",
                        lambda: (_ for _ in ()).throw(ValueError(ENOSPC_TEXT.format(d=ckpt.directory))))
    monkeypatch.setattr(ckpt._manager, "close", lambda: closed.append(True))
    message = ckpt.finish()
    assert closed == [True] and "No space left" in message and str(ckpt.directory) in message


TASK_ECHO = textwrap.dedent("""
    import asyncio, gc, sys
    from unittest import mock
    from turbo_moe.train.checkpoint import Checkpointer

    async def write(path):
        raise ValueError(f"RESOURCE_EXHAUSTED: Error writing {path}/1.orbax-checkpoint-tmp/d/x: No space left")

    def abandon(path):  # a task that fails and is never awaited, as orbax leaves them after a failed save
        loop = asyncio.new_event_loop()
        task = loop.create_task(write(path))
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
        del task
        gc.collect()

    ckpt = Checkpointer(sys.argv[1])
    with mock.patch.object(ckpt._manager, "save", side_effect=ValueError("No space left on device")):
        try:
            ckpt.save(1, {}, {"step": 1})
        except Exception as exc:
            print("SAVE", type(exc).__name__)
    abandon(ckpt.directory)          # an echo of this folder's failed save: held back
    abandon("/some/other/folder")    # anything else is still reported
    print("FINISH", ckpt.finish())
""")


def test_a_failed_saves_abandoned_write_tasks_print_nothing(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(TASK_ECHO)
    out = _run_child([sys.executable, str(script), str(tmp_path / "ckpt")])
    assert out.returncode == 0 and "SAVE CheckpointError" in out.stdout, out
    assert out.stderr.count("Task exception was never retrieved") == 1, out.stderr
    assert "/some/other/folder" in out.stderr and str(tmp_path / "ckpt") not in out.stderr, out.stderr


HANGS = textwrap.dedent("""
    import sys, jax.numpy as jnp
    from turbo_moe.train.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1])
    try:
        ckpt.save(1, {"w": jnp.ones((256, 1024))}, {"step": 1})  # 1 MiB into a smaller disk, or into a file
        ckpt.save(2, {"w": jnp.ones((256, 1024))}, {"step": 2})
    except Exception as exc:
        print("SAVE", type(exc).__name__, exc)
    print("FINISH", ckpt.finish())
""")


def _run_child(argv, timeout=120):
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)  # a hang fails here


def test_failed_save_does_not_hang_the_exit(tmp_path):
    (tmp_path / "ckpt").write_text("a file where the folder should be")
    script = tmp_path / "child.py"
    script.write_text(HANGS)
    out = _run_child([sys.executable, str(script), str(tmp_path / "ckpt")])
    assert out.returncode == 0, out.stderr
    assert "Not a directory" in out.stdout and str(tmp_path / "ckpt") in out.stdout


def test_real_full_disk_on_a_tiny_tmpfs(tmp_path):
    """A 64 KiB tmpfs in a private mount namespace: the real ENOSPC from tensorstore, end to end."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) not available")
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.decode().strip()}")
    script = tmp_path.parent / f"{tmp_path.name}_child.py"
    script.write_text(HANGS + textwrap.dedent("""
        from turbo_moe.train import metrics
        from turbo_moe.train.checkpoint import CheckpointError
        print("OOM", metrics.is_oom(CheckpointError(ckpt.finish() or "")))
    """))
    disk = tmp_path / "disk"
    disk.mkdir()
    out = _run_child(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                      f"mount -t tmpfs -o size=64k tmpfs {disk} && exec {sys.executable} {script} {disk}/ckpt"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "No space left on device" in out.stdout and f"{disk}/ckpt" in out.stdout
    assert "OOM False" in out.stdout


def _save_steps(directory, steps):
    ckpt = Checkpointer(directory, keep=5)
    for step in steps:
        ckpt.save(step, {"w": jnp.full((4,), float(step))}, {"step": step, "config": {"seed": 0}})
    assert ckpt.finish() is None
    return Checkpointer(directory, keep=5)


def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    ckpt = _save_steps(tmp_path / "ckpt", [1, 2])
    for f in (tmp_path / "ckpt" / "2" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00garbage")  # a torn write: every file of the newest state
    like = {"w": jnp.zeros((4,))}
    state, record = ckpt.restore(like)
    assert record["step"] == 1 and np.asarray(state["w"]).tolist() == [1.0] * 4
    assert (tmp_path / "ckpt" / "2.damaged-0").is_dir() and ckpt.latest_step() == 1
    ckpt.save(2, {"w": jnp.full((4,), 7.0)}, {"step": 2})  # the step can be written again
    assert ckpt.finish() is None
    assert Checkpointer(tmp_path / "ckpt").restore(like)[1]["step"] == 2


def test_no_restorable_checkpoint_names_every_failure(tmp_path):
    ckpt = _save_steps(tmp_path / "ckpt", [1])
    shutil.rmtree(tmp_path / "ckpt" / "1" / "state")
    with pytest.raises(CheckpointError, match=r"could be restored: step 1: "):
        ckpt.restore({"w": jnp.zeros((4,))})
    assert (tmp_path / "ckpt" / "1").is_dir()  # nothing moved when nothing restores
    ckpt.finish()


def test_resume_with_another_seed_or_path_is_refused(tmp_path):
    saved = {"seed": 0, "model": "tiny", "model_overrides": {"moe_path": "ragged"}, "steps": 4, "lr_schedule_steps": 8}
    check_resume_config(saved, {**saved, "steps": 8})  # more steps of one schedule: the same run, continued
    with pytest.raises(ValueError, match=r"seed=0 in the checkpoint, 1 now"):
        check_resume_config(saved, {**saved, "seed": 1})
    with pytest.raises(ValueError, match=r"model_overrides=.*'ragged'.*'turbo'"):
        check_resume_config(saved, {**saved, "model_overrides": {"moe_path": "turbo"}})
    ckpt = _save_steps(tmp_path / "ckpt", [1])
    with pytest.raises(ValueError, match="seed=0 in the checkpoint, 3 now"):
        ckpt.restore({"w": jnp.zeros((4,))}, config={"seed": 3})
    ckpt.finish()


def test_resume_with_another_learning_rate_schedule_is_refused_unless_allowed():
    """More steps without lr_schedule_steps stretch the cosine: the LR of every step to come changes."""
    saved = {"seed": 0, "model": "tiny", "steps": 30, "lr_schedule_steps": None, "learning_rate": 3e-3}
    with pytest.raises(ResumeRefused, match=r"schedule differs .*\(steps=30 in the checkpoint, 50 now \(the "
                                            r"schedule's length: lr_schedule_steps is unset\)\).*allow_schedule_change"):
        check_resume_config(saved, {**saved, "steps": 50})
    with pytest.raises(ResumeRefused, match=r"learning_rate=0.003 in the checkpoint, 0.001 now"):
        check_resume_config(saved, {**saved, "learning_rate": 1e-3})
    check_resume_config(saved, {**saved, "steps": 50, "allow_schedule_change": True})
    check_resume_config(saved, {**saved, "lr_schedule_steps": 30})  # the same length, named


def test_cpu_state_larger_than_host_memory_is_refused_before_it_exists(tiny, monkeypatch):
    """The train state's bytes are checked against the host's available memory before the init program runs:
    a model too large for the host is an `oom` status naming the state, not a process killed mid-init."""
    inits = []
    monkeypatch.setattr(M, "device_memory_limit", lambda: (1000, "host MemAvailable (test)"))
    from turbo_moe.train import init_program

    real_call = init_program.InitProgram.__call__
    monkeypatch.setattr(init_program.InitProgram, "__call__", lambda self, key: inits.append(key) or real_call(self, key))
    r = run(tiny)
    assert r.status == "oom" and "train state" in r.error and "1000 bytes" in r.error
    assert inits == [] and r.history == []
