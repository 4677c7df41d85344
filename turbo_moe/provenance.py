"""Where a result came from: one schema for training runs, sweep rows and benchmark tables.

    collect()                    every field below (initialises the JAX backend for the device fields)
    collect(devices=False)       the same without touching a device (the sweep process: a GPU backend
                                 there would take the memory the notebook kernel needs); device fields None
    normalize(mapping)           old spellings (``device``, ``jax``, ``commit``) renamed to the schema's

Fields (``FIELDS``): device_kind, device_count, local_device_count, process_count, platform, cpu,
grouped_gemm (which CUDA grouped GEMM the library holds, see `turbo_moe.ops.kernel_info`), kernel_library (the
library file loaded, with its content hash: `TURBO_MOE_LIB_DIR` can select another build),
jax_version, jaxlib_version, flax_version, optax_version, python_version, git_commit (the full hash,
``-dirty`` appended when tracked files differ from it), git_dirty, hostname, date (UTC, ISO seconds),
xla_flags (``$XLA_FLAGS`` as the process saw it, None when unset: flags change what XLA compiles).
Results tables keep the ``TABLE_COLUMNS`` subset. ``$TURBO_MOE_GIT_COMMIT`` names the commit where the
tree is a copy without ``.git`` (the GPU machine). Standard library only until ``collect()`` asks jax.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib.metadata
import os
import platform
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEVICE_FIELDS = ("device_kind", "device_count", "local_device_count", "process_count", "platform",
                 "grouped_gemm", "kernel_library")
PACKAGES = ("jax", "jaxlib", "flax", "optax")
FIELDS = (*DEVICE_FIELDS, "cpu", *(f"{p}_version" for p in PACKAGES), "python_version", "git_commit",
          "git_dirty", "hostname", "date", "xla_flags", "load_per_core")
# The columns every results table carries (sweeps, benchmarks).
TABLE_COLUMNS = ("device_kind", "device_count", "platform", "jax_version", "git_commit", "date")
# Spellings of earlier tables (benchmarks/grouped_gemm.py wrote device/jax/commit before the schema).
LEGACY_NAMES = {"device": "device_kind", "jax": "jax_version", "commit": "git_commit"}
UNKNOWN_COMMIT = "unknown (not a git checkout and no $TURBO_MOE_GIT_COMMIT)"
_REPO = Path(__file__).resolve().parents[1]


def collect(*, devices: bool = True) -> dict[str, Any]:
    """This process's provenance, every field of ``FIELDS`` (device fields None when ``devices`` is False)."""
    out: dict[str, Any] = dict.fromkeys(DEVICE_FIELDS)
    if devices:
        out.update(_device_info())
    out["cpu"] = cpu_model()
    out.update({f"{p}_version": package_version(p) for p in PACKAGES})
    out["python_version"] = platform.python_version()
    out.update(git_info())
    out["hostname"] = socket.gethostname()
    out["date"] = now()
    out["xla_flags"] = os.environ.get("XLA_FLAGS")
    # Other work on the machine skews CPU timings: the report flags runs measured under load.
    out["load_per_core"] = round(os.getloadavg()[0] / (os.cpu_count() or 1), 2) if hasattr(os, "getloadavg") else None
    return out


def _device_info() -> dict[str, Any]:
    # jax and turbo_moe.ops (which imports jax) only where devices are asked for: importing provenance stays free of
    # JAX (the results tables and the store import it; tests/test_provenance.py holds it).
    import jax

    from turbo_moe.ops import kernel_info

    first = jax.devices()[0]
    info = kernel_info()
    return {"device_kind": first.device_kind, "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(), "process_count": jax.process_count(),
            "platform": first.platform, "grouped_gemm": info.get("grouped_gemm"),
            "kernel_library": _library_id(info.get("cuda") or info.get("cpu"))}


@functools.lru_cache(maxsize=None)
def _library_id(path: str | None) -> str | None:
    """The kernel library this process loaded (TURBO_MOE_LIB_DIR may point at another build): path and content hash."""
    if not path:
        return None
    return f"{path} sha256:{hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]}"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def package_version(name: str) -> str | None:
    """The installed distribution's version, without importing it (None when not installed)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``; the machine type elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


OUTPUT_PATHS = ("experiments/results", "experiments/figures", "experiments/runs")


def git_info(repo: str | Path | None = None) -> dict[str, Any]:
    """``git_commit`` (full hash, ``-dirty`` when tracked files outside `OUTPUT_PATHS` were modified) and ``git_dirty``.
    ``$TURBO_MOE_GIT_COMMIT`` wins (its text is kept as given; git_dirty None)."""
    if os.environ.get("TURBO_MOE_GIT_COMMIT"):
        return {"git_commit": os.environ["TURBO_MOE_GIT_COMMIT"], "git_dirty": None}
    commit = _git(repo or _REPO, "rev-parse", "HEAD")
    if not commit:
        return {"git_commit": UNKNOWN_COMMIT, "git_dirty": None}
    # What a sweep writes (results, figures) does not make the code dirty: otherwise every point after a
    # sweep's first would carry "-dirty" for the first point's own table row.
    status = _git(repo or _REPO, "status", "--porcelain", "--untracked-files=no", "--", ".",
                  *(f":(exclude){path}" for path in OUTPUT_PATHS))
    dirty = bool(status) if status is not None else None
    return {"git_commit": commit + ("-dirty" if dirty else ""), "git_dirty": dirty}


def _git(repo: str | Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def normalize(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """``mapping`` with the old provenance spellings renamed (a present schema name wins)."""
    out = dict(mapping)
    for old, new in LEGACY_NAMES.items():
        if old in out:
            value = out.pop(old)
            out.setdefault(new, value)
    return out


def table_columns(record: Mapping[str, Any], fallback: Mapping[str, Any]) -> dict[str, Any]:
    """The ``TABLE_COLUMNS`` of ``record`` (old spellings accepted), each missing one from ``fallback``."""
    record = normalize(record)
    return {k: record.get(k) if record.get(k) is not None else fallback.get(k) for k in TABLE_COLUMNS}
