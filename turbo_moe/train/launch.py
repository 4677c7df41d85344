"""`turbo-moe train CONFIG.yaml` and `turbo-moe launch --gpus N CONFIG.yaml`: a TrainConfig file, run.

    load_train_config("experiments/configs/tiny.yaml", ["steps=20", "model_overrides.moe_path=ragged"])
    train_from_file(path, sets, record=None)   # this process: one of a job when the environment says so
    launch_local(path, sets, processes=2, gpus=2)  # one `turbo-moe train` per GPU of this host

A config file is a YAML (or JSON) mapping of `TrainConfig` fields, flat or in a section per sub-config
(`optimizer:`, `data:`, `parallel:`, `checkpoint:`), model overrides nested under `model_overrides` (or a whole
ModelConfig mapping under `model`), as `TrainConfig.from_dict` reads them. `--set key=value` replaces one value
after the file is read: `key` is a field, or a dotted path into a nested mapping (`model_overrides.moe_path=turbo`,
`optimizer.learning_rate=1e-3`); `value` is read as YAML (`20`, `3e-3`, `true`, `null`,
`ragged`). The config checks every value and names the field it refuses.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import yaml

from turbo_moe.train import distributed
from turbo_moe.train.config import TrainConfig


class _Loader(yaml.SafeLoader):
    """YAML 1.1's SafeLoader, except that `3e-3` and `1e5` are floats (YAML 1.2), not strings."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.?[0-9_]*|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ValueError(f"{where}: not valid YAML{at}: {problem}") from None


def parse_set(item: str) -> tuple[list[str], Any]:
    """'model_overrides.moe_path=turbo' -> (['model_overrides', 'moe_path'], 'turbo')."""
    key, sep, text = item.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k in keys):
        raise ValueError(f"--set {item!r}: expected key=value with key a field name or a dotted path such as "
                         f"model_overrides.moe_path")
    return keys, _yaml(text, f"--set {item!r}") if text.strip() else None


def apply_sets(values: dict[str, Any], sets: Sequence[str]) -> dict[str, Any]:
    """`values` with each `--set key=value` applied in order (nested mappings copied, never changed in place)."""
    out = dict(values)
    for item in sets:
        keys, value = parse_set(item)
        node = out
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ValueError(f"--set {item!r}: {'.'.join(keys[:depth + 1])} is {child!r}, not a mapping")
            node[key] = child = dict(child)
            node = child
        node[keys[-1]] = value
    return out


def load_train_config(path: str | Path, sets: Sequence[str] = ()) -> TrainConfig:
    """The TrainConfig of a YAML/JSON file with `--set` overrides; ValueError naming the file, key or field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"config file {str(path)!r}: cannot read it ({exc.strerror or exc})") from None
    values = _yaml(text, f"config file {str(path)!r}")
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ValueError(f"config file {str(path)!r}: expected a mapping of TrainConfig fields, got "
                         f"{type(values).__name__}")
    values = apply_sets(values, sets)
    try:
        return TrainConfig.from_dict(values)
    except TypeError as exc:  # e.g. model_overrides given as a list
        raise ValueError(f"config {str(path)!r}: {exc}") from None


def default_record_path(config_path: str | Path, config: TrainConfig) -> Path:
    """Where `turbo-moe train` writes the run's record when not told: beside the checkpoints, else runs/<stem>.json."""
    if config.checkpoint_dir is not None:
        return Path(config.checkpoint_dir).expanduser() / "record.json"
    return Path("runs") / f"{Path(config_path).stem}.json"


def _prepare_data(config: TrainConfig, process_id: int) -> None:
    """Process 0 fetches and tokenises a named corpus while the others wait: no two processes write the cache."""
    from jax.experimental import multihost_utils

    from turbo_moe.data import load_dataset

    if process_id == 0 and config.dataset != "synthetic":
        load_dataset(config.dataset, seq_len=config.resolved_seq_len, vocab_size=config.model_config().vocab_size,
                     data_dir=config.data_dir, text_field=config.text_field, val_fraction=config.val_fraction,
                     tokenizer=config.tokenizer)
    multihost_utils.sync_global_devices("turbo-moe train: dataset prepared")


def train_from_file(config_path: str | Path, sets: Sequence[str] = (), *, record: str | Path | None = None,
                    echo=print) -> int:
    """`turbo-moe train`: read the config, join the job the environment describes (if any), run, write the
    record (process 0), leave the job. Returns the exit code: 0 for status "ok", 1 for any other status.
    A bad config or environment raises ValueError before any JAX work."""
    config = load_train_config(config_path, sets)
    group = distributed.detect()
    joined = distributed.initialize(group)
    import jax

    from turbo_moe.train.loop import run

    rank0 = jax.process_index() == 0
    if rank0:
        where = (f"process 0 of {group.num_processes} ({group.cluster})" if group else "one process")
        echo(f"turbo-moe train {config_path}: {where}, {jax.device_count()} devices "
             f"({jax.devices()[0].device_kind}), expert_parallel={config.expert_parallel}", flush=True)
    if joined:
        _prepare_data(config, jax.process_index())
    result = run(config)
    if rank0:
        path = Path(record) if record is not None else default_record_path(config_path, config)
        result.save(path)
        last = result.history[-1] if result.history else {}
        echo(f"status {result.status}: {result.summary.get('steps_done')} steps, final loss "
             f"{last.get('loss', float('nan')):.4f}; record {path}", flush=True)
        if result.error:
            echo(f"error: {result.error}", flush=True)
    if joined and result.ok:
        distributed.shutdown()  # a failed process leaves at once: the others' collectives fail instead of hanging
    return 0 if result.ok else 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def process_envs(processes: int, *, gpus: int | None = None, cpu_devices: int | None = None,
                 port: int, base: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The environment of each of `processes` local processes: the coordinator on `port`, its rank, and its
    devices (GPUs split evenly by CUDA_VISIBLE_DEVICES, or `cpu_devices` host devices each on the CPU)."""
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"--processes must be a positive int, got {processes!r}")
    if (gpus is None) == (cpu_devices is None):
        raise ValueError("give exactly one of --gpus N and --cpu-devices K")
    if gpus is not None and (not isinstance(gpus, int) or gpus < 1 or gpus % processes):
        raise ValueError(f"--gpus {gpus} must be a positive multiple of --processes {processes}")
    if cpu_devices is not None and (not isinstance(cpu_devices, int) or cpu_devices < 1):
        raise ValueError(f"--cpu-devices must be a positive int, got {cpu_devices!r}")
    base = dict(os.environ if base is None else base)
    visible = [d for d in base.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if gpus is not None and visible and len(visible) < gpus:
        raise ValueError(f"--gpus {gpus} but CUDA_VISIBLE_DEVICES={base['CUDA_VISIBLE_DEVICES']!r} lists "
                         f"{len(visible)}")
    gpu_ids = visible[:gpus] if visible else [str(i) for i in range(gpus or 0)]
    envs = []
    for rank in range(processes):
        env = {k: v for k, v in base.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_"))}
        for name in (*distributed.COORDINATOR_VARS, *distributed.NUM_PROCESSES_VARS,
                     *distributed.PROCESS_ID_VARS, *distributed.LOCAL_DEVICE_IDS_VARS):
            env.pop(name, None)
        env.update({"TURBO_MOE_COORDINATOR": f"127.0.0.1:{port}", "TURBO_MOE_NUM_PROCESSES": str(processes),
                    "TURBO_MOE_PROCESS_ID": str(rank), "PYTHONUNBUFFERED": "1"})
        if gpus is not None:
            per = gpus // processes
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids[rank * per:(rank + 1) * per])
        else:
            flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
            env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={cpu_devices}"])
            env["JAX_PLATFORMS"] = "cpu"
        envs.append(env)
    return envs


def launch_local(config_path: str | Path, sets: Sequence[str] = (), *, processes: int, gpus: int | None = None,
                 cpu_devices: int | None = None, record: str | Path | None = None, log_dir: str | Path | None = None,
                 python: str = sys.executable, echo=print) -> int:
    """Start `processes` `turbo-moe train` processes on this host, stream process 0's output, wait for all.

    The others write to `log_dir/process<i>.log` (default: a new temporary folder). When one exits with an
    error the others are stopped and its code returned (its log's tail printed); 0 when all succeed."""
    load_train_config(config_path, sets)  # a bad config fails here once, not in every process
    envs = process_envs(processes, gpus=gpus, cpu_devices=cpu_devices, port=free_port())
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="turbo-moe-launch-"))
    logs.mkdir(parents=True, exist_ok=True)
    argv = [python, "-m", "turbo_moe.cli", "train", str(config_path), *(a for s in sets for a in ("--set", s))]
    if record is not None:
        argv += ["--record", str(record)]
    echo(f"turbo-moe launch: {processes} processes ({_devices_text(gpus, cpu_devices, processes)}); process 0's "
         f"output follows, the others' in {logs}", flush=True)
    procs, files = [], []
    try:
        for rank, env in enumerate(envs):
            out = None if rank == 0 else open(logs / f"process{rank}.log", "w")
            files.append(out)
            procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT if out else None))
        return _wait_all(procs, logs, echo)
    finally:
        _stop(procs)
        for f in files:
            if f is not None:
                f.close()


def _devices_text(gpus, cpu_devices, processes) -> str:
    if gpus is not None:
        return f"{gpus // processes} GPU(s) each"
    return f"{cpu_devices} CPU host device(s) each"


def _wait_all(procs: list[subprocess.Popen], logs: Path, echo) -> int:
    while True:
        codes = [p.poll() for p in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            _stop(procs)
            echo(f"turbo-moe launch: process {rank} exited with code {code}; stopped the others", flush=True)
            if rank > 0:
                tail = (logs / f"process{rank}.log").read_text(errors="replace").splitlines()[-30:]
                echo("\n".join(f"  [process {rank}] {line}" for line in tail), flush=True)
            return code if code > 0 else 128 - code  # killed by a signal: the shell's convention
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every process still running, SIGKILL what is left after `grace_s`."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in alive:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

