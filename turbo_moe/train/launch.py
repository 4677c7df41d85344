"""`turbo-moe train CONFIG.yaml` and `turbo-moe launch --gpus N CONFIG.yaml`: a TrainConfig file, run in its folder.

    train_from_file(path, sets, out=None)          # this process: one of a job when the environment says so
    launch_local(path, sets, processes=2, gpus=2)  # one `turbo-moe train` per GPU of this host

The config file and `--set`: turbo_moe/train/config_file.py. Where a run writes (`runs/<config stem>-<n>/` or
`--out DIR`: record, curves, TensorBoard events, checkpoint) and what it refuses to replace:
turbo_moe/train/run_folder.py. The launcher's children: turbo_moe/train/local_processes.py.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import Sequence

from turbo_moe.data import load_dataset
from turbo_moe.train import distributed, local_processes, run_folder
from turbo_moe.train.config import TrainConfig
from turbo_moe.train.config_file import (apply_sets, config_from_values, load_config_values,  # noqa: F401
                                         load_train_config, parse_set)
from turbo_moe.train.local_processes import free_port, process_envs  # noqa: F401 (the launcher's API)
from turbo_moe.train.loop import run
from turbo_moe.train.progress import loss_text
from turbo_moe.train.run_folder import RunPlan
from turbo_moe.train.tensorboard import TensorBoardLog


def resolve_run(config_path: str | Path, sets: Sequence[str] = (), *, out: str | Path | None = None,
                record: str | Path | None = None, overwrite: bool = False,
                root: Path = run_folder.DEFAULT_ROOT) -> tuple[TrainConfig, RunPlan]:
    """The config of a file with its run folder's checkpoint_dir, and what the run does with the folder (`out`, else
    the next root/<config stem>-<n>). Raises ValueError for a bad config and RunFolderError for a location that
    would lose a record; writes nothing."""
    values = load_config_values(config_path, sets)
    folder = Path(out) if out is not None else run_folder.next_folder(Path(config_path).stem, root)
    config = config_from_values(run_folder.with_run_checkpoint(values, folder), config_path)
    plan = run_folder.plan_run(config, folder, record=Path(record) if record is not None else None,
                               overwrite=overwrite, own_checkpoint=not run_folder.names_checkpoint_dir(values),
                               fresh_folder=out is None)
    return config, plan


def prepared(config_path: str | Path, sets: Sequence[str], config: TrainConfig, plan: RunPlan, *,
             record: str | Path | None, overwrite: bool, root: Path) -> tuple[TrainConfig, RunPlan]:
    """`run_folder.prepare(plan)`; a new default folder another run took meanwhile (two trains of one config at
    once) makes the plan again, with the next number."""
    for _ in range(1000):
        try:
            run_folder.prepare(plan, overwrite=overwrite)
            return config, plan
        except run_folder.FolderTaken:
            config, plan = resolve_run(config_path, sets, record=record, overwrite=overwrite, root=root)
    raise run_folder.RunFolderError(f"no free run folder next to {plan.folder}")


def check_devices(config: TrainConfig, devices: int, where: str) -> None:
    """expert_parallel must divide the devices (the mesh is devices / EP x EP): one line before any process starts."""
    ep = config.expert_parallel
    if devices % ep:
        raise ValueError(f"expert_parallel={ep} does not divide the {devices} device(s) {where}; set --set "
                         f"expert_parallel to a divisor of {devices}, or run on a multiple of {ep} devices")


def _finished(plan: RunPlan, config: TrainConfig, echo) -> int:
    echo(f"the run in {plan.folder} is finished (its checkpoint is at step {plan.resume_from} of steps="
         f"{config.steps}): nothing to do; {plan.record} unchanged", flush=True)
    return 0


def _prepare_data(config: TrainConfig, process_id: int) -> None:
    """Process 0 fetches and tokenises a named corpus while the others wait: no two processes write the cache."""
    from jax.experimental import multihost_utils

    if process_id == 0 and config.dataset != "synthetic":
        load_dataset(config.dataset, seq_len=config.resolved_seq_len, vocab_size=config.model_config().vocab_size,
                     data_dir=config.data_dir, text_field=config.text_field, val_fraction=config.val_fraction,
                     tokenizer=config.tokenizer)
    multihost_utils.sync_global_devices("turbo-moe train: dataset prepared")


def train_from_file(config_path: str | Path, sets: Sequence[str] = (), *, out: str | Path | None = None,
                    record: str | Path | None = None, overwrite: bool = False, root: Path = run_folder.DEFAULT_ROOT,
                    echo=print) -> int:
    """`turbo-moe train`: read the config, check its run folder, join the job the environment describes (if any),
    run, write the record, curves and TensorBoard events (process 0), leave the job. Returns the exit code: 0 for
    status "ok" (and for a finished run resumed: nothing changes), 1 for any other status. A bad config,
    environment or output location raises ValueError before any JAX work."""
    group = distributed.detect()
    if group is not None and out is None:
        raise ValueError(f"a job of {group.num_processes} processes needs --out DIR: every process must name the "
                         "same run folder")
    # Every process checks before any writes (the job's start below waits for all of them): they see one folder.
    config, plan = resolve_run(config_path, sets, out=out, record=record, overwrite=overwrite, root=root)
    if plan.finished:
        return _finished(plan, config, echo) if group is None or group.process_id == 0 else 0
    joined = distributed.initialize(group)
    import jax

    check_devices(config, jax.device_count(), f"this run sees ({jax.device_count()} x {jax.devices()[0].device_kind})")
    rank0 = jax.process_index() == 0
    log = None
    if rank0:
        config, plan = prepared(config_path, sets, config, plan, record=record, overwrite=overwrite, root=root)
        where = (f"process 0 of {group.num_processes} ({group.cluster})" if group else "one process")
        echo(f"turbo-moe train {config_path}: {where}, {jax.device_count()} device(s) "
             f"({jax.devices()[0].device_kind}), expert_parallel={config.expert_parallel}; run folder {plan.folder}",
             flush=True)
        log = TensorBoardLog(plan.folder, purge_step=plan.resume_from)
    if joined:
        _prepare_data(config, jax.process_index())
    try:
        result = run(config, on_log=log.row if log is not None else None)
    finally:
        if log is not None:
            log.close()
    if rank0:
        _write_outputs(result, plan, config, echo)
    if joined and result.ok:
        distributed.shutdown()
    elif joined:  # a failed process leaves at once, and the others' collectives fail instead of hanging: not through
        sys.stdout.flush()  # JAX's exit handler, which waits up to 5 minutes for the others to leave together
        sys.stderr.flush()
        os._exit(1)
    return 0 if result.ok else 1


def _write_outputs(result, plan: RunPlan, config: TrainConfig, echo) -> None:
    s = result.summary
    if result.ok and (s.get("resumed_from_step") or 0) >= config.steps:  # restored at the end: nothing ran
        _finished(dataclasses.replace(plan, resume_from=s["resumed_from_step"]), config, echo)
        return
    result.save(plan.record)
    run_folder.write_history(result.history, plan.folder / run_folder.HISTORY)
    resumed = f" (resumed from step {s['resumed_from_step']})" if s.get("resumed_from_step") else ""
    echo(f"status {result.status}: {s.get('steps_done')} steps{resumed}"
         + (f", {loss_text(s)}" if loss_text(s) else ""), flush=True)
    if result.error:
        first = result.error.strip().splitlines()[0] if result.error.strip() else ""
        echo(f"error: {first} (the full text in {plan.record})", flush=True)
    kept = [p.name for p in (plan.record, plan.folder / run_folder.HISTORY) if p.parent == plan.folder]
    if any(plan.folder.glob(run_folder.EVENTS_GLOB)):
        kept.append(f"TensorBoard events (tensorboard --logdir {plan.folder})")
    if plan.checkpoint_dir is not None and run_folder.saved_steps(plan.checkpoint_dir):
        kept.append(f"{run_folder.CHECKPOINT}/" if plan.own_checkpoint else f"checkpoints in {plan.checkpoint_dir}")
    echo(f"results in {plan.folder}: {', '.join(kept)}"
         + (f"; record {plan.record}" if plan.record.parent != plan.folder else ""), flush=True)


def launch_local(config_path: str | Path, sets: Sequence[str] = (), *, processes: int, gpus: int | None = None,
                 cpu_devices: int | None = None, out: str | Path | None = None, record: str | Path | None = None,
                 overwrite: bool = False, port: int | None = None, log_dir: str | Path | None = None,
                 python: str = sys.executable, root: Path = run_folder.DEFAULT_ROOT, echo=print) -> int:
    """Start `processes` `turbo-moe train` processes on this host, stream process 0's output, wait for all.

    Everything the children would refuse is checked here first (the config, the devices for expert_parallel, the
    run folder, the coordinator `port`; default a free one). The others write to `log_dir/process<i>.log`
    (default: the run folder's logs/). When one exits with an error the others are stopped and its code returned
    (its log's tail printed); 0 when all succeed. SIGINT (Ctrl-C) or SIGTERM stop every child (one line, exit
    128 + the signal); a SIGKILL takes them along (local_processes)."""
    if port is None:
        port = free_port()
    else:
        local_processes.check_port_free(port)
    envs = process_envs(processes, gpus=gpus, cpu_devices=cpu_devices, port=port)
    config, plan = resolve_run(config_path, sets, out=out, record=record, overwrite=overwrite, root=root)
    devices = gpus if gpus is not None else cpu_devices * processes
    check_devices(config, devices,
                  f"launch gives ({processes} processes x {_devices_text(gpus, cpu_devices, processes)})")
    if plan.finished:
        return _finished(plan, config, echo)
    config, plan = prepared(config_path, sets, config, plan, record=record, overwrite=overwrite, root=root)
    logs = Path(log_dir) if log_dir is not None else plan.folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    argv = [python, "-m", "turbo_moe.cli", "train", str(config_path), *(a for s in sets for a in ("--set", s)),
            "--out", str(plan.folder)]
    if record is not None:
        argv += ["--record", str(record)]
    echo(f"turbo-moe launch: {processes} processes ({_devices_text(gpus, cpu_devices, processes)}), run folder "
         f"{plan.folder}; process 0's output follows, the others' in {logs}", flush=True)
    procs, files = local_processes.start(argv, envs, logs)
    try:
        return local_processes.wait_all(procs, logs, echo)
    except local_processes.Stopped as stopped:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while the children stop
        try:
            local_processes.stop(procs)
        finally:
            signal.signal(signal.SIGINT, previous)
        how = "Ctrl-C" if stopped.signum == signal.SIGINT else str(stopped)
        echo(f"turbo-moe launch: stopped ({how}); its {processes} processes were stopped too; what the run wrote "
             f"is in {plan.folder}", flush=True)
        return 128 + stopped.signum
    finally:
        local_processes.stop(procs)
        local_processes.close(files)


def _devices_text(gpus, cpu_devices, processes) -> str:
    if gpus is not None:
        return f"{gpus // processes} GPU(s) each"
    return f"{cpu_devices} CPU host device(s) each"
