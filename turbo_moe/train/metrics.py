"""Honest run metrics: TGS, MFU (with a named peak), memory (with its source), routing, provenance, OOM."""

from __future__ import annotations

import math
import resource
import sys
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from turbo_moe.provenance import collect as collect_provenance
# One OOM detector for runs and sweeps; re-exported here, where the training loop looks for it.
from turbo_moe.status import is_oom, requested_bytes  # noqa: F401

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


# Steps after compile left out of TGS and MFU (first-step transfers, the allocator's growth), or half of a shorter run.
# Five, as the GPU path comparisons measured; records keep the value they ran with.
TGS_SKIP_STEPS = 5


def timed_steps(step_times: Sequence[float]) -> Sequence[float]:
    """The step times TGS and MFU are measured over: all but the first TGS_SKIP_STEPS (half of a shorter run)."""
    return step_times[min(TGS_SKIP_STEPS, len(step_times) // 2):]


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
    # Host memory the program uses beside the device's (TrainConfig.optimizer_state_memory="host"): not in total_bytes.
    out.update({f"host_{name}": int(getattr(analysis, f"host_{name}", 0) or 0) for name in fields[:4]})
    return out


def provenance(config: dict, model_config: dict, dataset_info: dict) -> dict[str, Any]:
    """The run's provenance (`turbo_moe.provenance` schema) plus what was run: config, model, dataset."""
    return {**collect_provenance(), "config": config, "model_config": model_config, "dataset": dataset_info}
