"""The logic of ``03_full_deepseek`` (its cells hold parameters, these calls and plots).

Part 1 (accounting of the exact config): ``check_parameters`` validates the cell's parameters and returns
the config and mesh, ``param_table`` / ``plot_memory_per_path`` show `turbo_moe.experiments.accounting`.

Part 2: a slice of DeepSeek-V3-671B trained on the devices at hand. ``plan_on_this_device`` decides what runs
(``full_deepseek_slice``: DeepSeek-V3's exact widths, fewer layers first, then fewer experts, the experts split over
every GPU), ``run_paths`` trains it once per MoE path from one init on one batch order, with the preset's
optimizer recipe (DeepSeek-V3's learning rate), and records each run like a sweep point; ``loss_agreement`` holds the
paths' losses to the tolerances below; ``plot_paths`` / ``plot_losses`` draw TGS, memory and the losses.

The records go to ``experiments/runs/full_deepseek/`` unless the caller names a results folder, so an
interactive run never lands in the committed ``experiments/results/`` that the report reads.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from turbo_moe.experiments import accounting
from turbo_moe.experiments.notebooks import train as nb
from turbo_moe.experiments.notebooks.display import GIB
from turbo_moe.experiments.notebooks.full_deepseek_slice import (PRESET, SHRUNK_MAX_STEP_TFLOP, Devices, SlicePlan,
                                                                plan_slice)
from turbo_moe.model import get_config
from turbo_moe.model.paths import DROPLESS_PATHS, MOE_PATHS
from turbo_moe.train import run

INTERACTIVE_RESULTS = Path("experiments") / "runs" / "full_deepseek"
__all__ = ["PRESET", "SlicePlan", "Devices", "plan_slice", "plan_on_this_device", "run_paths", "loss_agreement"]


# ---- Part 1: the exact config ---------------------------------------------------------------------------
def check_parameters(*, mesh_data: int, mesh_expert: int, mesh_tensor: int, mesh_pipeline: int, fsdp: bool,
                     paths: Sequence[str] | None, max_step_tflop: float | None, capacity_factor: float):
    """(the exact DeepSeek-V3 config, its mesh) for the notebook's parameters; ValueError naming a bad one."""
    mesh = accounting.MeshShape(data=mesh_data, expert=mesh_expert, tensor=mesh_tensor, pipeline=mesh_pipeline,
                                fsdp=fsdp)
    if paths is not None and (isinstance(paths, str) or not paths or set(paths) - set(MOE_PATHS)):
        raise ValueError(f"parameter paths: expected None or a non-empty list from {MOE_PATHS}, got {paths!r}")
    if max_step_tflop is not None and (isinstance(max_step_tflop, bool)
                                       or not isinstance(max_step_tflop, (int, float)) or max_step_tflop <= 0):
        raise ValueError(f"parameter max_step_tflop: must be a positive number or None, got {max_step_tflop!r}")
    return get_config(PRESET, capacity_factor=capacity_factor), mesh


def mesh_text(mesh) -> str:
    return (f"mesh: {mesh.devices} devices = data {mesh.data} x expert {mesh.expert} x tensor {mesh.tensor}"
            f" x pipeline {mesh.pipeline} (fsdp={mesh.fsdp})")


def param_table(cfg) -> pd.DataFrame:
    """`accounting.param_budget` in billions, one row per part."""
    budget = accounting.param_budget(cfg)
    return pd.Series({k: v / 1e9 for k, v in budget.items()}, name="billions").to_frame().round(2)


def plot_memory_per_path(per_path: pd.DataFrame, mesh, batch: int, seq_len: int):
    """States and activations per device (GiB), one bar pair per path of `accounting.full_model_table`."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    melted = per_path.reset_index().melt(id_vars="path", value_vars=["states GiB/device", "activations GiB/device"],
                                         var_name="part", value_name="GiB")
    _, ax = plt.subplots(figsize=(7, 4))  # its own figure: never draw into whatever figure is current
    sns.barplot(data=melted, x="path", y="GiB", hue="part", ax=ax)
    ax.set(ylabel="memory per device (GiB)", xlabel="MoE path",
           title=f"DeepSeek-V3-671B on {mesh.devices} devices, {batch}x{seq_len} tokens/device")
    return ax.figure


# ---- Part 2: a slice on the devices at hand ---------------------------------------------------------------
# One init, one batch order, one learning-rate schedule on every path. The dropless paths compute one function and
# differ in rounding only (their GEMMs' order; turbo_fp8's FP8 experts), which a loss falling 5 nats in 12 steps
# amplifies: at the exact widths turbo_fp8 came within 0.17 nats of turbo at every step (one H200, campaign
# full_deepseek_exact_h200), the bf16 paths within 4e-6 of each other on the CPU slice. dense_cf drops the copies over
# its capacity, a different function: 66% at the first step and 95% from step 7 there (DeepSeek-V3's router
# recipe leaves a short run's routing on 8 of 256 experts: docs/notes/routing.md), 0.65 nats from turbo at most.
DROPLESS_TOLERANCE = 0.2
DENSE_CF_TOLERANCE = 1.0


def this_device() -> Devices:
    """The devices at hand as `plan_slice` reads them: the first device's memory (host memory on a CPU), the platform,
    how many, and whether they run turbo_fp8's FP8 kernels (Hopper, compute capability 9.x)."""
    import jax

    memory, source = nb.device_memory_bytes()
    first = jax.devices()[0]
    capability = str(getattr(first, "compute_capability", ""))
    return Devices(memory, source, jax.default_backend(), jax.device_count(), capability.startswith("9"),
                   first.device_kind)


def plan_on_this_device(*, max_step_tflop: float | None, **plan_args: Any) -> SlicePlan:
    """``plan_slice`` for the devices at hand (`this_device`); ``max_step_tflop`` None takes the platform's default."""
    devices = this_device()
    if max_step_tflop is None:
        max_step_tflop = default_max_step_tflop(devices.platform)
    return plan_slice(devices=devices, max_step_tflop=max_step_tflop, **plan_args)


def device_text(plan: SlicePlan) -> str:
    import jax

    return (f"device: {jax.device_count()} x {jax.devices()[0].device_kind}, "
            f"{plan.memory_bytes / 2**30:.1f} GiB ({plan.memory_source})")


def plan_text(plan: SlicePlan, table_path: str | Path) -> str:
    """The plan's notes, what runs (one line), on which paths, and where its rows go."""
    peak = f"predicted peak {plan.need_bytes / GIB:.1f} of {plan.memory_bytes / GIB:.1f} GiB a device"
    return "\n".join([*(f"note: {n}" for n in plan.notes), f"runs: {plan.label}; {peak}",
                      f"paths: {', '.join(plan.paths)}", f"rows and records go to {table_path}"])


def default_max_step_tflop(platform: str) -> float | None:
    """CPUs get a shrunk slice whose steps take seconds; accelerators are limited by memory only."""
    return SHRUNK_MAX_STEP_TFLOP if platform == "cpu" else None


def results_location(results_dir: str | Path | None, repo_root: str | Path) -> Path:
    """Where the rows go: the named folder, else ``experiments/runs/full_deepseek`` (never the report's)."""
    return Path(results_dir) if results_dir else Path(repo_root) / INTERACTIVE_RESULTS


def run_paths(
    plan: SlicePlan, *, per_device_batch: int, steps: int, dataset: str, capacity_factor: float,
    train_overrides: Mapping[str, Any], results_dir: str | Path, table: str,
) -> list[dict[str, Any]]:
    """Train ``plan`` once per path of ``plan.paths``, each from the same init on the same batches, at the preset's
    optimizer recipe (turbo_moe/train/recipes.py: DeepSeek-V3's peak 2.2e-4; a run of under 20 steps warms up over all
    of them) unless
    ``train_overrides`` set it; each run becomes a row of ``<results_dir>/<table>.csv`` plus a record. Returns one dict
    per path (status, TGS, MFU, losses, measured and predicted bytes, error). The sequence length is the plan's."""
    rows, seq_len = [], plan.seq_len
    for path in plan.paths:
        tc = nb.train_config(model=PRESET, model_overrides=plan.overrides, moe_path=path,
                             capacity_factor=capacity_factor, per_device_batch=per_device_batch, steps=steps,
                             seq_len=seq_len, dataset=dataset, expert_parallel=plan.expert_parallel, eval_every=0,
                             eval_batches=0, train_overrides=train_overrides)  # no eval compile
        start = time.perf_counter()
        result = run(tc)
        params = {"moe_path": path, "capacity_factor": capacity_factor, "per_device_batch": per_device_batch,
                  "seq_len": seq_len, "n_layers": plan.overrides["n_layers"], "mtp_depth": plan.overrides["mtp_depth"],
                  "n_experts": plan.overrides["n_experts"], "param_dtype": plan.overrides["param_dtype"],
                  "expert_parallel": plan.expert_parallel, "shrink": plan.shrink}
        nb.record_in_table(result, results_dir=results_dir, sweep=table, params=params,
                           elapsed_s=time.perf_counter() - start)
        moments = tc.resolved().moments_dtype
        predicted = accounting.memory_prediction(tc.model_config(), per_device_batch, seq_len,
                                                 accounting.MeshShape(expert=plan.expert_parallel), moments, moments)
        rows.append({"path": path, "status": result.status, "tgs": result.summary.get("tgs"),
                     "mfu": result.summary.get("mfu"),
                     "first_loss": result.history[0]["loss"] if result.history else None,
                     "final_loss": result.summary.get("final_loss"), "history": result.history,
                     "dropped": result.summary.get("dropped_fraction_mean"),
                     "measured_bytes": result.summary.get("peak_memory_bytes"),
                     "memory_source": result.summary.get("memory_source"),
                     "predicted_bytes": sum(predicted.values()), "error": result.error})
    return rows


def loss_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per finished path: its loss at the first and the last step, its TGS and MFU."""
    lines = []
    for r in rows:
        if r["status"] != "ok":
            continue
        mfu = f", MFU {r['mfu']:.1%}" if isinstance(r.get("mfu"), float) and math.isfinite(r["mfu"]) else ""
        lines.append(f"{r['path']}: train loss {r['first_loss']:.3f} at the first step -> {r['final_loss']:.3f} at the "
                     f"last; {r['tgs']:,.0f} tokens/device/s{mfu}")
    return lines


def loss_agreement(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Per finished path: whether its loss fell (last step below the first) and its largest gap, over the steps, to the
    first dropless path's loss, against the tolerance that applies (``DROPLESS_TOLERANCE``, ``DENSE_CF_TOLERANCE``)."""
    done = {r["path"]: pd.DataFrame(r["history"]).set_index("step")["loss"] for r in rows
            if r["status"] == "ok" and r.get("history")}
    reference = next((p for p in done if p in DROPLESS_PATHS), None)
    out = []
    for path, loss in done.items():
        gap = float((loss - done[reference]).abs().max()) if reference is not None else math.nan
        tolerance = DROPLESS_TOLERANCE if path in DROPLESS_PATHS else DENSE_CF_TOLERANCE
        out.append({"path": path, "loss fell": bool(loss.iloc[-1] < loss.iloc[0]),
                    f"max |loss - {reference}|": gap, "tolerance": tolerance,
                    "within": bool(gap <= tolerance) if math.isfinite(gap) else None})
    return pd.DataFrame(out).set_index("path") if out else pd.DataFrame()


def memory_note(platform: str) -> str:
    """Why measured and predicted memory may not compare."""
    if platform == "cpu":
        return ("CPU: 'measured' is the peak RSS of the whole kernel process (Python, JAX, XLA's compiler, the "
                "data), 'predicted' only the slice's training states and activations: not comparable; the "
                "prediction is for an accelerator's allocator")
    return ("measured: the device allocator's peak for this kernel process, so a path's is the largest of its own and "
            "the paths' before it (its program's own size: compiled_total_bytes in its record); predicted: the "
            "accounting's states + activations")


def plot_paths(rows: Sequence[Mapping[str, Any]], plan: SlicePlan, platform: str):
    """TGS and memory per path; None when no path finished. On an accelerator the memory panel sets the
    allocator's measured peak beside the prediction; on the CPU the two do not compare (`memory_note`), so
    it draws the measured peak RSS alone and the prediction stays in the table."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    ok = pd.DataFrame([r for r in rows if r["status"] == "ok"])
    if ok.empty:
        print("no path finished; see the error column")
        return None
    ok["measured peak"] = ok["measured_bytes"].astype(float) / GIB
    ok["predicted"] = ok["predicted_bytes"].astype(float) / GIB
    fig, (ax_tgs, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    sns.barplot(data=ok, x="path", y="tgs", ax=ax_tgs)
    ax_tgs.set(ylabel="TGS (tokens / device / s)", xlabel="MoE path", title="Throughput")
    if platform == "cpu":
        sns.barplot(data=ok, x="path", y="measured peak", ax=ax_mem)
        ax_mem.set(ylabel="peak RSS of the kernel process (GiB)", xlabel="MoE path",
                   title="Measured memory (the whole process; the prediction is in the table)")
    else:
        mem = ok.melt(id_vars="path", value_vars=["measured peak", "predicted"], var_name="memory",
                      value_name="GiB")
        sns.barplot(data=mem, x="path", y="GiB", hue="memory", ax=ax_mem)
        ax_mem.set(ylabel="memory (GiB)", xlabel="MoE path", title="Memory: measured peak vs predicted")
    fig.suptitle(plan.label, fontsize=10)
    fig.tight_layout()
    return fig


def plot_losses(histories: Mapping[str, Sequence[Mapping[str, Any]]], plan: SlicePlan):
    """Training loss against step, one line per path (the record's history); None without any."""
    import matplotlib.pyplot as plt

    drawn = {path: pd.DataFrame(h) for path, h in histories.items() if h}
    drawn = {path: h for path, h in drawn.items() if {"step", "loss"} <= set(h.columns)}
    if not drawn:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for path, h in drawn.items():
        ax.plot(h["step"], h["ce_loss"] if "ce_loss" in h else h["loss"], marker="o", markersize=3, label=path)
    ax.set(xlabel="step", ylabel="train cross-entropy (nats / token)", title=f"Loss per path: {plan.label}")
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    return fig
