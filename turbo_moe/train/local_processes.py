"""The processes `turbo-moe launch` starts on this host, owned by it: they never outlive it.

- Each child asks the kernel for SIGKILL when its parent dies (`prctl(PR_SET_PDEATHSIG)`, Linux): a parent killed
  with SIGKILL, which no handler sees, still takes its children along. SIGKILL, not SIGTERM: under
  `jax.distributed` a child catches SIGTERM (JAX's preemption notifier) and trains on.
- Each child runs in its own process group, so a Ctrl-C at the terminal reaches the parent alone; the parent stops
  the children (SIGTERM, then SIGKILL after a grace period) and says so in one line. SIGTERM to the parent does
  the same.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

from turbo_moe.train import distributed

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
except (OSError, AttributeError):  # not Linux: children are still stopped on SIGTERM and Ctrl-C
    _prctl = None


class Stopped(Exception):
    """The parent was asked to stop (SIGINT or SIGTERM): `signum` says which."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def check_port_free(port: int) -> None:
    """ValueError naming `port` when a listener already holds it on this host (the coordinator could not bind)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"--port must be an int in [1, 65535], got {port!r}")
    taken = distributed.port_taken(port)
    if taken:
        raise ValueError(f"--port {port}: the coordinator port is taken on this host ({taken}); choose another, or "
                         "leave --port out for a free one")


def process_envs(processes: int, *, gpus: int | None = None, cpu_devices: int | None = None,
                 port: int, base: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The environment of each of `processes` local processes: the coordinator on `port`, its rank, and its
    devices (GPUs split evenly by CUDA_VISIBLE_DEVICES, or `cpu_devices` host devices each on the CPU)."""
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise ValueError(f"--gpus must be a positive int, got {gpus!r}")
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
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


def _die_with(parent: int) -> Callable[[], None]:
    """The child's first act after fork: SIGKILL when `parent` dies, and at once if it died before this call."""
    def preexec() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
    return preexec


def start(argv: Sequence[str], envs: list[dict[str, str]], logs: Path) -> tuple[list[subprocess.Popen], list]:
    """One child per environment: process 0's output to this terminal, the others' to logs/process<i>.log."""
    procs, files = [], []
    try:
        for rank, env in enumerate(envs):
            out = None if rank == 0 else open(logs / f"process{rank}.log", "w")
            files.append(out)
            procs.append(subprocess.Popen(list(argv), env=env, stdout=out,
                                          stderr=subprocess.STDOUT if out else None,
                                          process_group=0, preexec_fn=_die_with(os.getpid())))
    except BaseException:
        stop(procs)
        close(files)
        raise
    return procs, files


def close(files: list) -> None:
    for f in files:
        if f is not None:
            f.close()


def wait_all(procs: list[subprocess.Popen], logs: Path, echo) -> int:
    """Wait for every child; when one fails, stop the others and return its code (its log's tail printed).
    SIGINT/SIGTERM to this process raise `Stopped` (the caller stops the children)."""
    def stopped(signum, frame):
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                stop(procs)
                echo(f"turbo-moe launch: process {rank} exited with code {code}; stopped the others", flush=True)
                if rank > 0:
                    tail = (logs / f"process{rank}.log").read_text(errors="replace").splitlines()[-30:]
                    echo("\n".join(f"  [process {rank}] {line}" for line in tail), flush=True)
                return code if code > 0 else 128 - code  # killed by a signal: the shell's convention
            if all(code == 0 for code in codes):
                return 0
            time.sleep(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every child still running, SIGKILL what is left after `grace_s` (a child under jax.distributed
    ignores SIGTERM)."""
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
