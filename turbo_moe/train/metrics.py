"""Honest run metrics: TGS, MFU (with a named peak), memory (with its source), routing, provenance, OOM."""

from __future__ import annotations

import datetime
import errno
import math
import platform
import re
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

# Dense (no structured sparsity) bf16 tensor-core peak per device, from vendor datasheets.
# Matched in order by substring of `device.device_kind`, so specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float, str], ...] = (
    ("H100 PCIe", 756e12, "NVIDIA H100 PCIe datasheet, dense bf16"),
    ("H100 NVL", 835e12, "NVIDIA H100 NVL datasheet, dense bf16"),
    ("H100", 989e12, "NVIDIA H100 SXM datasheet, dense bf16"),
    ("GH200", 989e12, "NVIDIA GH200 datasheet, dense bf16"),
    ("H200", 989e12, "NVIDIA H200 SXM datasheet, dense bf16"),
    ("H800", 989e12, "NVIDIA H800 SXM datasheet, dense bf16"),
    ("B200", 2250e12, "NVIDIA B200 (HGX) datasheet, dense bf16"),
    ("A100", 312e12, "NVIDIA A100 datasheet, dense bf16"),
    ("L40S", 362e12, "NVIDIA L40S datasheet, dense bf16"),
    ("L4", 121e12, "NVIDIA L4 datasheet, dense bf16"),
    ("MI355X", 2300e12, "AMD Instinct MI355X datasheet, dense bf16"),
    ("MI325X", 1307e12, "AMD Instinct MI325X datasheet, dense bf16"),
    ("MI300X", 1307e12, "AMD Instinct MI300X datasheet, dense bf16"),
    ("TPU v4", 275e12, "Google Cloud TPU v4 docs, bf16"),
    ("TPU v5 lite", 197e12, "Google Cloud TPU v5e docs, bf16"),
    ("TPU v5p", 459e12, "Google Cloud TPU v5p docs, bf16"),
    ("TPU v5", 459e12, "Google Cloud TPU v5p docs, bf16"),
    ("TPU v6 lite", 918e12, "Google Cloud TPU v6e (Trillium) docs, bf16"),
)


def peak_flops(device_kind: str, platform_name: str) -> tuple[float, str]:
    """(peak bf16 FLOP/s per device, where the number comes from); NaN when we do not know it."""
    for pattern, flops, source in PEAK_BF16_FLOPS:
        if pattern.lower() in device_kind.lower():
            return flops, f"{source}: {flops / 1e12:.0f} TFLOP/s ({device_kind})"
    return math.nan, f"unknown ({platform_name}: {device_kind})"


def tokens_per_device_per_second(tokens_per_device: int, step_times: Sequence[float]) -> float:
    """TGS over the given steps: total tokens / total time (not a mean of per-step rates)."""
    total = float(np.sum(step_times)) if len(step_times) else 0.0
    return tokens_per_device * len(step_times) / total if total > 0 else math.nan


def model_flops_utilization(flops_per_token: float, tgs: float, peak: float) -> float:
    """Achieved model FLOP/s per device over the peak (NaN when the peak is unknown)."""
    if not (math.isfinite(peak) and peak > 0 and math.isfinite(tgs)):
        return math.nan
    return flops_per_token * tgs / peak


def load_imbalance(expert_load: np.ndarray) -> tuple[float, float, list[float]]:
    """expert_load (L_moe, E) → (mean over layers, max over layers, per-layer list) of max/mean load."""
    load = np.asarray(expert_load, dtype=np.float64)
    if load.size == 0:
        return math.nan, math.nan, []
    ratio = load.max(-1) / np.maximum(load.mean(-1), 1e-9)  # (L_moe,)
    return float(ratio.mean()), float(ratio.max()), [float(r) for r in ratio]


def peak_memory() -> tuple[int | None, str]:
    """(peak bytes, source): the devices' own counters when the backend has them, else process RSS."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    if peaks:
        return max(peaks), "device memory_stats()['peak_bytes_in_use'], max over local devices"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    scale = 1 if sys.platform == "darwin" else 1024
    return int(rss_kib * scale), "process peak RSS (getrusage ru_maxrss; host memory, includes Python)"


def device_memory_limit() -> tuple[int | None, str]:
    """Bytes one device can hold, and where that number comes from (None when unknown)."""
    device = jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "device memory_stats()['bytes_limit']"
    if device.platform == "cpu":
        available = _mem_available_bytes()
        if available is not None:
            return available, "host MemAvailable (/proc/meminfo)"
    return None, "unknown"


def _mem_available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def compiled_memory(compiled) -> dict[str, int]:
    """Per-device byte counts from XLA's memory analysis of a compiled executable ({} if unavailable)."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:
        analysis = None
    if analysis is None:
        return {}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "generated_code_size_in_bytes")
    out = {name: int(getattr(analysis, name, 0) or 0) for name in fields}
    out["total_bytes"] = (out["argument_size_in_bytes"] + out["output_size_in_bytes"]
                          - out["alias_size_in_bytes"] + out["temp_size_in_bytes"])
    return out


_OOM_MARKERS = ("resource_exhausted", "out of memory", "failed to allocate", "oom when allocating")
_BYTES = re.compile(r"(\d+(?:\.\d+)?)\s*(bytes|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)\b")
_UNIT = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
         "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


# A full disk reaches us as RESOURCE_EXHAUSTED too (tensorstore/absl status codes): that is storage, not
# memory, and must not become `oom` (final in a sweep, and it feeds the OOM frontier).
_STORAGE_MARKERS = ("no space left on device", "disk quota exceeded", "file too large",
                    "os_error_code='28'", "os_error_code='122'", "os_error_code='27'")
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def is_oom(error: BaseException) -> bool:
    """Device or host memory ran out (an allocator error, MemoryError); never a full disk or a checkpoint failure."""
    chain, seen = [], set()
    node: BaseException | None = error
    while node is not None and id(node) not in seen:  # the error and what caused it
        seen.add(id(node))
        chain.append(node)
        node = node.__cause__ or node.__context__
    for e in chain:
        if (isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS) or type(e).__name__ == "CheckpointError" \
                or any(m in str(e).lower() for m in _STORAGE_MARKERS):
            return False
    return isinstance(error, MemoryError) or any(m in str(error).lower() for m in _OOM_MARKERS)


def requested_bytes(message: str) -> int | None:
    """The allocation size an OOM message reports (the largest byte figure in it), if any."""
    sizes = [float(v) * _UNIT[u] for v, u in _BYTES.findall(message)]
    return int(max(sizes)) if sizes else None


def provenance(config: dict, model_config: dict, dataset_info: dict) -> dict[str, Any]:
    devices = jax.devices()
    import flax
    import optax

    return {
        "device_kind": devices[0].device_kind, "device_count": len(devices),
        "local_device_count": jax.local_device_count(), "process_count": jax.process_count(),
        "platform": devices[0].platform, "jax_version": jax.__version__, "flax_version": flax.__version__,
        "optax_version": optax.__version__, "python_version": platform.python_version(),
        **_git_info(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(), "config": config, "model_config": model_config,
        "dataset": dataset_info,
    }


def _git_info() -> dict[str, Any]:
    """The commit of this checkout; ``$TURBO_MOE_GIT_COMMIT`` names it where the tree is a copy without
    ``.git`` (a GPU machine that received the working tree, say)."""
    if os.environ.get("TURBO_MOE_GIT_COMMIT"):
        return {"git_commit": os.environ["TURBO_MOE_GIT_COMMIT"], "git_dirty": None}
    repo = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit or "unknown (not a git checkout or no commit yet)",
            "git_dirty": bool(status) if status is not None else None}
