"""Thin helpers the notebooks call, so that their logic is importable and tested.

``02_train`` turns its parameters cell into a ``TrainConfig`` (``train_config``, from ``params``), runs it, saves the
``RunResult`` record where the sweep collects it (``save_record``) and plots it (``plot_run``).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from turbo_moe.experiments.notebooks import display
from turbo_moe.experiments.report import figures
from turbo_moe.experiments.store import results
from turbo_moe.experiments.sweep.params import train_config  # noqa: F401  (the notebooks call nb.train_config)
from turbo_moe.experiments.sweep.runner import SweepLayout, build_row
from turbo_moe.experiments.sweep.spec import SweepPoint, point_name
from turbo_moe.model import count_params, flops_per_token


def describe(tc) -> pd.DataFrame:
    """One-column table of what will run: model size, path, tokens per step, FLOPs per token."""
    cfg = tc.model_config()
    counts = count_params(cfg)
    seq = tc.resolved_seq_len
    rows = {
        "model": tc.model if isinstance(tc.model, str) else "custom",
        "moe_path": cfg.moe_path,
        "capacity_factor": (cfg.capacity_factor if cfg.moe_path == "dense_cf" or cfg.drop_tokens
                            else "n/a (dropless)"),
        "experts (routed, shared, top-k)": f"{cfg.n_experts}, {cfg.n_shared_experts}, {cfg.top_k}",
        "layers (dense + MoE)": f"{cfg.n_dense_layers} + {cfg.n_layers - cfg.n_dense_layers}",
        "params total / active (M)": f"{counts['total'] / 1e6:.2f} / {counts['active'] / 1e6:.2f}",
        "tokens per device per step": tc.per_device_batch * seq,
        "training GFLOP per token": f"{flops_per_token(cfg, seq) / 1e9:.4f}",
        "dataset": str(tc.dataset),
        "steps": tc.steps,
    }
    return pd.DataFrame({"value": [str(v) for v in rows.values()]}, index=list(rows))


def default_record_path(output_dir: str | Path, tc) -> Path:
    """Where an interactive (non-sweep) run keeps its record: ``<output_dir>/<path>_<UTC time>.json``."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return Path(output_dir) / f"{tc.model_config().moe_path}_{stamp}.json"


def save_record(result, result_json: str | Path | None, output_dir: str | Path, tc) -> Path:
    """Save the RunResult JSON at ``result_json`` (set by the sweep) or under ``output_dir``."""
    path = Path(result_json) if result_json else default_record_path(output_dir, tc)
    return result.save(path)


def summary_table(result) -> pd.DataFrame:
    """The run's status and key figures as a human table (GiB, fixed decimals; unknown values left out)."""
    return display.run_summary(result.status, result.error, result.summary)


def plot_run(result, title: str = "") -> plt.Figure | None:
    """Loss (train and eval), TGS and dropped fraction against step for one run."""
    history = pd.DataFrame(result.history)
    if history.empty or "step" not in history:
        print(f"nothing to plot: the run has no history (status {result.status})")
        return None
    sns.set_theme(style="whitegrid")
    fig, (ax_loss, ax_tgs, ax_drop) = plt.subplots(1, 3, figsize=(15, 3.8))
    ax_loss.plot(history["step"], history["loss"], label="train (total)", linewidth=1, alpha=0.5)
    if "ce_loss" in history:  # the eval loss is cross-entropy only; compare like with like
        ax_loss.plot(history["step"], history["ce_loss"], label="train cross-entropy", linewidth=1)
    if "eval_loss" in history and history["eval_loss"].notna().any():
        evals = history[history["eval_loss"].notna()]
        ax_loss.plot(evals["step"], evals["eval_loss"], "o-", label="eval cross-entropy")
    ax_loss.set(xlabel="step", ylabel="loss (nats / token)", title=f"Loss {title}".strip())
    ax_loss.legend()
    if "tgs" in history:
        ax_tgs.plot(history["step"], history["tgs"], linewidth=1)
    ax_tgs.set(xlabel="step", ylabel=figures.TGS_LABEL, title="Throughput")
    ax_tgs.set_ylim(bottom=0)
    if "dropped_fraction" in history:
        ax_drop.plot(history["step"], history["dropped_fraction"], linewidth=1)
    ax_drop.set(xlabel="step", ylabel="dropped token copies (fraction)", title="Dropped tokens")
    ax_drop.set_ylim(bottom=0)
    prov = pd.DataFrame([result.provenance]) if result.provenance else pd.DataFrame()
    return figures.add_provenance(fig, prov)


def plot_expert_load(result, title: str = "", model_config=None) -> plt.Figure | None:
    """Final expert load (layer × expert) relative to the mean; ``model_config`` names the rows (its MoE
    layers, then its MoE MTP blocks)."""
    if not result.expert_load:
        return None
    prov = pd.DataFrame([result.provenance]) if result.provenance else pd.DataFrame()
    label = title or "expert load"
    names = {label: figures.moe_row_labels(model_config)} if model_config is not None else None
    return figures.expert_load_heatmaps({label: result.expert_load}, prov, names)


def record_in_table(result, *, results_dir: str | Path, sweep: str, params: Mapping[str, Any],
                    elapsed_s: float = float("nan")) -> Path:
    """Save a run made inside a notebook like a sweep point: ``<results_dir>/<sweep>/<point>.json`` plus
    a row in ``<results_dir>/<sweep>.csv`` (so the report picks it up)."""
    layout = SweepLayout(results_dir=Path(results_dir), runs_dir=Path(results_dir), sweep=sweep)
    point = SweepPoint(point_name(params), dict(params), dict(params))
    path = result.save(layout.record(point))
    row = build_row(sweep, point, result.status, result.error, elapsed_s, result.to_dict(), layout, path, None)
    results.append_row(layout.table, row)
    return path


def device_memory_bytes() -> tuple[float, str]:
    """Memory of the first device and where the number comes from (host memory on CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"]), f"{jax.devices()[0].device_kind} bytes_limit"
    with open("/proc/meminfo") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    return float(available), "host MemAvailable"
