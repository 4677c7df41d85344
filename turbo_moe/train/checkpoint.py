"""Orbax checkpoints of the TrainState plus a JSON record (step, history, config) for exact resume.

The state is saved as a flat {name: array} dict keyed by each leaf's pytree path, so a checkpoint
does not depend on how nnx/optax lay out their containers, and restore checks every leaf's name and
shape against a freshly initialised state of the same config.

Failures are ``CheckpointError``s naming the directory and the reason (a full disk, a file where the
folder should be); ``finish()`` waits and always closes the manager. Saves are synchronous: when an
asynchronous orbax save fails early (its folder cannot be made), its other non-daemon threads wait for
a signal that never comes and the process hangs at exit; a save costs no step time either way (the loop
excludes checkpointing from step times). ``restore()`` of the latest step falls back to the newest
step that restores, moving a damaged one aside as ``<step>.damaged-<n>``.

One writer per folder: a ``Checkpointer`` holds ``.<folder>.writer.lock`` beside the folder (naming its
holder) from creation to ``close()``, and a second one is refused with ``CheckpointBusy`` before orbax
touches the folder (orbax removes unfinished saves it finds there: the other run's save in progress).
Under ``jax.distributed`` process 0 holds it for the job. A failed save removes its own unfinished
``<step>.orbax-checkpoint-tmp`` folder, and the tracebacks orbax's threads print for it (the same error,
once per thread) are left out: the ``CheckpointError`` carries it once. (tensorstore may still print a
late "Event loop is closed" echo from C++ after the save returned; nothing in Python can catch that.)
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from turbo_moe.train.config import TrainConfig
from turbo_moe.writer_lock import HolderLock


log = logging.getLogger(__name__)
# TrainConfig fields that must match for a resumed run to continue the same run: any other value would
# silently change the trajectory (eval/checkpoint cadence and progress may change; steps as SCHEDULE_FIELDS say).
RESUME_FIELDS = ("model", "model_overrides", "dataset", "tokenizer", "text_field", "val_fraction", "per_device_batch",
                 "expert_parallel", "weight_decay", "adam_b1", "adam_b2", "moments_dtype", "grad_clip", "seed",
                 "master_weights")
# The learning-rate schedule's fields, and "steps" where it is the schedule's length (lr_schedule_steps unset): a
# change moves the LR of the steps to come (e.g. 30 -> 50 steps jumped it from 3.1e-4 to 1.3e-3 at step 30). Refused
# unless the config sets allow_schedule_change.
SCHEDULE_FIELDS = ("learning_rate", "warmup_steps", "min_lr_ratio")
# Fields a checkpoint's record may lack (written before the field existed): the value such a run had.
RESUME_DEFAULTS = {"master_weights": "float32"}
# Why a difference matters where the generic advice (another checkpoint_dir, or resume=False) is not the whole story.
_RESUME_HINTS = {"master_weights": "the checkpoint stores the weights in its layout: resume with its master_weights"}


class CheckpointError(RuntimeError):
    """Saving or restoring a checkpoint failed (the message names the directory and the reason).

    Never an out-of-memory condition: a full disk reads RESOURCE_EXHAUSTED in tensorstore's words.
    """


class ResumeRefused(ValueError):
    """The checkpoint was written by another run, or one this run's config cannot continue (a config error: the
    message names the fields)."""


class CheckpointBusy(CheckpointError):
    """Another process (or another Checkpointer in this one) writes this checkpoint folder."""


class _WriterLock(HolderLock):
    busy = CheckpointBusy

    def __init__(self, directory: Path):
        self.directory = directory
        super().__init__(directory.with_name(f".{directory.name}.writer.lock"))

    def refusal(self, holder: str, waited: str) -> str:
        return (f"checkpoint folder {self.directory} is being written by another run: {holder}. Two writers "
                "destroy each other's saves; wait for it to finish or give this run another checkpoint_dir")


def _reason(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:1500]


def _as_now(config: dict) -> dict:
    """A recorded config in today's flat fields (an older checkpoint's seq_len is now the model's max_seq_len, its
    two moment dtypes one field), or as written where it does not read as a TrainConfig."""
    try:
        now = TrainConfig.from_record(config).to_dict()
    except (TypeError, ValueError):
        return config
    moved = {"model_overrides": "seq_len" in config, "moments_dtype": "adam_mu_dtype" in config}
    return {k: v for k, v in now.items() if k in config or moved.get(k)}


def _schedule_length(config: dict) -> tuple[str, Any]:
    """(the field that sets the LR schedule's length, its value): lr_schedule_steps, else steps."""
    if config.get("lr_schedule_steps") is not None:
        return "lr_schedule_steps", config["lr_schedule_steps"]
    return "steps", config.get("steps")


def _schedule_changes(saved: dict, current: dict) -> list[str]:
    """'field=<saved> in the checkpoint, <now> now' for each change of the learning-rate schedule."""
    changed = [f"{k}={saved[k]!r} in the checkpoint, {current[k]!r} now" for k in SCHEDULE_FIELDS
               if k in saved and k in current and saved[k] != current[k]]
    (saved_name, saved_len), (name, length) = _schedule_length(saved), _schedule_length(current)
    if saved_len is not None and length is not None and saved_len != length:
        if saved_name == name:
            unset = ": lr_schedule_steps is unset" if name == "steps" else ""
            changed.append(f"{name}={saved_len} in the checkpoint, {length} now (the schedule's length{unset})")
        else:
            changed.append(f"the schedule's length {saved_name}={saved_len} in the checkpoint, {name}={length} now")
    return changed


def check_resume_config(saved: dict | None, current: dict) -> None:
    """Raise ResumeRefused naming every field in which the checkpoint's run differs from this one, the learning-rate
    schedule's included unless `current` sets allow_schedule_change."""
    if not saved:
        return
    saved = _as_now({**{k: v for k, v in RESUME_DEFAULTS.items() if k in current}, **saved})
    current = _as_now(current)
    changed = [k for k in RESUME_FIELDS if k in saved and k in current and saved[k] != current[k]]
    if changed:
        diffs = "; ".join(f"{k}={saved[k]!r} in the checkpoint, {current[k]!r} now" for k in changed)
        hints = "".join(f"; {_RESUME_HINTS[k]}" for k in changed if k in _RESUME_HINTS)
        raise ResumeRefused(f"cannot resume: the checkpoint was written by a different run ({diffs}); use another "
                            f"checkpoint_dir or set resume=False{hints}")
    schedule = [] if current.get("allow_schedule_change") else _schedule_changes(saved, current)
    if schedule:
        raise ResumeRefused(f"cannot resume: the learning-rate schedule differs from the checkpoint's run "
                            f"({'; '.join(schedule)}), which changes the learning rate of the steps to come; "
                            "set allow_schedule_change=true to continue anyway, or split a run into several calls "
                            "with one lr_schedule_steps (its total steps) in each")


def _leaf_names(tree) -> list[str]:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    names = [re.sub(r"[^A-Za-z0-9_]+", ".", p).strip(".") for p in paths]  # file-system friendly
    if len(set(names)) != len(names):
        raise ValueError("checkpoint leaf names collide after sanitising; cannot save this state")
    return names


def _saved_part(state):
    """The state without what is derived from it: TrainState.compute (a cast copy of some params) is rebuilt."""
    return state._replace(compute=None) if getattr(state, "compute", None) is not None else state


def flatten_state(state) -> dict[str, Any]:
    state = _saved_part(state)
    return dict(zip(_leaf_names(state), jax.tree.leaves(state)))


def unflatten_state(flat: dict[str, Any], like):
    """`like`'s structure from `flat`; a TrainState comes back with compute None (Program.refresh_compute)."""
    like = _saved_part(like)
    names = _leaf_names(like)
    missing = sorted(set(names) - set(flat))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} state entries, e.g. {missing[:3]}; was it "
                         f"written for a different model config?")
    return jax.tree.unflatten(jax.tree.structure(like), [flat[n] for n in names])


class Checkpointer:
    """Save/restore (TrainState, record) under `directory/<step>/` with orbax, keeping the last `keep`."""

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory).expanduser().resolve()
        self._lock = _WriterLock(self.directory) if jax.process_index() == 0 else None
        if self._lock is not None:
            try:
                self._lock.__enter__()  # before orbax opens the folder (see the module doc)
            except OSError as exc:
                raise CheckpointError(f"cannot take the writer lock of the checkpoint folder {self.directory}: "
                                      f"{_reason(exc)}") from exc
        try:
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                     enable_async_checkpointing=False),  # see the module doc
                item_names=("state", "record"),
            )
        except Exception as exc:  # e.g. no permission to create it: name the folder and the reason
            self._release()
            raise CheckpointError(f"cannot open the checkpoint folder {self.directory}: {_reason(exc)}") from exc

    def _release(self) -> None:
        if getattr(self, "_lock", None) is not None:
            self._lock.__exit__(None, None, None)
            self._lock = None

    def __del__(self):
        self._release()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state, record: dict) -> None:
        """Durable when it returns (synchronous, see the module doc). Raises CheckpointError."""
        try:
            with _orbax_noise_held_back() as failed:
                try:
                    self._manager.save(step, args=ocp.args.Composite(
                        state=ocp.args.StandardSave(flatten_state(state)), record=ocp.args.JsonSave(record)))
                except Exception:
                    failed.append(True)
                    _hold_back_task_echoes(self.directory)
                    gc.collect()  # orbax's abandoned write tasks report now, into the held-back stderr
                    raise
        except Exception as exc:
            self._failed_save = True
            left = self._remove_unfinished(step)
            raise CheckpointError(f"checkpoint save of step {step} in {self.directory} failed: {_reason(exc)}"
                                  + left) from exc

    def _remove_unfinished(self, step: int) -> str:
        """Remove this save's unfinished ``<step>.orbax-checkpoint-tmp*`` folders (ours: we hold the lock)."""
        kept = []
        for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            try:
                shutil.rmtree(tmp)
            except OSError as exc:
                kept.append(f"{tmp} ({exc.strerror or exc})")
        return f"; could not remove the unfinished {', '.join(kept)}" if kept else ""

    def restore(self, like, step: int | None = None, *, config: dict | None = None) -> tuple[Any, dict]:
        """(state with `like`'s structure and shardings, record) at `step`.

        `step=None`: the latest step that restores; damaged newer steps are moved aside with a warning.
        `config` (``TrainConfig.to_dict()``) is compared with the checkpoint's (``check_resume_config``).
        """
        steps = [step] if step is not None else sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint found in {self.directory}")
        if config is not None:
            self._check_not_past(steps[0], config)
        failures = []
        for candidate in steps:
            try:
                record = self._restore_record(candidate)
            except Exception as exc:  # a damaged step: try the one before
                failures.append(f"step {candidate}: {_reason(exc)}")
                continue
            # Before the state: another run's state may not restore into `like` at all (master_weights changes its
            # leaves), and that must read as another run's checkpoint, not as a damaged step.
            if config is not None:
                check_resume_config(record.get("config"), config)
            try:
                state = self._restore_state(like, candidate)
            except Exception as exc:
                failures.append(f"step {candidate}: {_reason(exc)}")
                continue
            if failures:
                self._set_aside(steps[:steps.index(candidate)], failures)
            return state, record
        raise CheckpointError(f"no checkpoint in {self.directory} could be restored: " + " | ".join(failures))

    def check_resume(self, config: dict) -> None:
        """Before any work (initialising, compiling): raise ResumeRefused where the latest checkpoint's record says
        `config` cannot continue it. A record that does not read is left to `restore`, which falls back."""
        steps = sorted(self._manager.all_steps(), reverse=True)
        if not steps:
            return
        self._check_not_past(steps[0], config)
        try:
            record = self._restore_record(steps[0])
        except Exception:  # noqa: BLE001 — a damaged step: restore() moves it aside and tries the one before
            return
        check_resume_config(record.get("config"), config)

    def _check_not_past(self, step: int, config: dict) -> None:
        if isinstance(config.get("steps"), int) and step > config["steps"]:
            raise ResumeRefused(f"cannot resume: the checkpoint in {self.directory} is at step {step}, past this "
                                f"run's steps={config['steps']}; set steps >= {step} to continue it, or use "
                                "another checkpoint_dir (or resume=False) to start again")

    def _restore_record(self, step: int) -> dict:
        record = self._manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]
        if not isinstance(record, dict) or record.get("step") != step:
            raise ValueError(f"its record names step {record.get('step') if isinstance(record, dict) else record!r}")
        return record

    def _restore_state(self, like, step: int):
        target = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                  for name, x in flatten_state(like).items()}
        restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
        return unflatten_state(restored["state"], like)

    def _set_aside(self, damaged: list[int], failures: list[str]) -> None:
        """Rename damaged steps so that later saves at those steps do not collide with them."""
        for step in damaged:
            src = self.directory / str(step)
            n = 0
            while (dst := self.directory / f"{step}.damaged-{n}").exists():
                n += 1
            try:
                src.rename(dst)
            except OSError as exc:
                log.warning("could not move the damaged checkpoint %s aside: %s", src, exc)
        self._manager.reload()
        log.warning("checkpoint(s) %s in %s could not be restored and were moved aside (%s); resumed from "
                    "an earlier step", damaged, self.directory, " | ".join(failures))

    def wait(self) -> None:
        """Block until pending saves are durable. Raises CheckpointError."""
        try:
            self._manager.wait_until_finished()
        except Exception as exc:
            raise CheckpointError(f"checkpoint save in {self.directory} failed: {_reason(exc)}") from exc

    def close(self) -> None:
        """Wait, then always release the manager's threads; raises the wait's CheckpointError afterwards."""
        try:
            self.wait()
        finally:
            try:
                with _orbax_noise_held_back() as failed:  # after a failed save, its late echoes
                    failed.extend([True] if getattr(self, "_failed_save", False) else [])
                    self._manager.close()
            finally:
                self._release()

    def finish(self) -> str | None:
        """`close()` that never raises an Exception: the error message, or None when all saves landed."""
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 — the caller turns it into the run's status
            return str(exc) if isinstance(exc, CheckpointError) else \
                f"checkpoint close in {self.directory} failed: {_reason(exc)}"
        return None


# Lines orbax's save threads print when a save fails: an absl ERROR record with its traceback, and
# tensorstore callbacks into an event loop orbax already closed. All repeat the error the save raises.
_NOISE_LOG = "_SignalingThread.run() raised an exception"
_NOISE_END = "RuntimeError: Event loop is closed"


@contextlib.contextmanager
def _orbax_noise_held_back() -> Iterator[list]:
    """Hold back what is written to stderr during a save: both ``sys.stderr`` (Python prints there, also
    in a Jupyter kernel) and file descriptor 2 (tensorstore writes there from C). Replayed unchanged after
    a save that worked; after one that failed (the caller appends to the list it gets), once orbax's
    threads have gone quiet, replayed without their repeats of the error (``_without_orbax_noise``)."""
    failed: list = []
    with contextlib.ExitStack() as stack:
        try:
            sys.stderr.flush()
            held = stack.enter_context(tempfile.TemporaryFile())
            saved = os.dup(2)
            os.dup2(held.fileno(), 2)
        except (OSError, ValueError, AttributeError):  # no descriptor 2, or no space for the file
            yield failed
            return
        real_stderr, text_held = sys.stderr, io.StringIO()
        sys.stderr = text_held
        log_filter = _DropOrbaxNoise()
        logging.getLogger("absl").addFilter(log_filter)
        try:
            yield failed
        finally:
            if failed:
                _wait_until_quiet(held, text_held)
            logging.getLogger("absl").removeFilter(log_filter)
            sys.stderr = real_stderr
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = text_held.getvalue() + held.read().decode(errors="replace")
            if text:
                with contextlib.suppress(OSError, ValueError):
                    real_stderr.write(_without_orbax_noise(text) if failed else text)
                    real_stderr.flush()


def _wait_until_quiet(held, text_held: io.StringIO, quiet_s: float = 0.5, limit_s: float = 5.0) -> None:
    """Orbax's other threads report a failed save a moment after it raised: wait until they stop."""
    deadline, last, since = time.monotonic() + limit_s, None, time.monotonic()
    while time.monotonic() < deadline:
        size = (os.fstat(held.fileno()).st_size, len(text_held.getvalue()))
        if size != last:
            last, since = size, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.05)


class _DropTaskEchoes(logging.Filter):
    """asyncio's "Task exception was never retrieved" for orbax's write tasks of a failed save in one of
    ``folders``: each repeats the save's error (which names the folder), whenever the task is collected."""

    def __init__(self):
        super().__init__()
        self.folders: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        echo = any(f in text for f in self.folders) or (self.folders and "Event loop is closed" in text)
        return not ("never retrieved" in text and echo)


_TASK_ECHOES = _DropTaskEchoes()


def _hold_back_task_echoes(directory: Path) -> None:
    """From now on in this process, drop asyncio's late echoes of a failed save in ``directory``."""
    _TASK_ECHOES.folders.add(str(directory))
    logger = logging.getLogger("asyncio")
    if _TASK_ECHOES not in logger.filters:
        logger.addFilter(_TASK_ECHOES)


class _DropOrbaxNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _NOISE_LOG not in record.getMessage()


def _without_orbax_noise(text: str) -> str:
    """``text`` without tracebacks that end in ``_NOISE_END`` and absl records of ``_NOISE_LOG``."""
    lines, kept, i = text.splitlines(keepends=True), [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("Traceback (most recent call last):") or (line.startswith("ERROR:absl:")
                                                                       and _NOISE_LOG in line):
            j = i + 1
            if line.startswith("ERROR:absl:") and j < len(lines) and lines[j].startswith("Traceback"):
                j += 1
            while j < len(lines) and lines[j].startswith((" ", "\t")):
                j += 1
            block_end = min(j, len(lines) - 1)
            if _NOISE_LOG in line or _NOISE_END in lines[block_end]:
                i = block_end + 1
                continue
        kept.append(line)
        i += 1
    return "".join(kept)
