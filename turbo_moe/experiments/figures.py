"""Report figures. Each function takes report data and returns a Figure, or None when its data is absent.

Every figure carries units on its axes and a provenance footer (device, date, commit) built from the
rows that fed it.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

GIB = 1024**3
TGS_LABEL = "TGS (tokens / device / s)"


def path_label(moe_path: object, capacity_factor: object = None) -> str:
    """``dense_cf (cf=1.25)`` for the capacity-factor path, the path name otherwise."""
    if moe_path == "dense_cf" and capacity_factor is not None and not pd.isna(capacity_factor):
        return f"dense_cf (cf={float(capacity_factor):g})"
    return str(moe_path)


def with_path_labels(frame: pd.DataFrame) -> pd.DataFrame:
    """Copy of ``frame`` with a ``path`` column (rows without ``moe_path`` dropped). Where a sweep runs one
    path with several seeds (to show seed-to-seed noise), the label names the seed: ``turbo (seed 1)``."""
    if frame.empty or "moe_path" not in frame:
        return frame.iloc[0:0].assign(path=[])
    frame = frame[frame["moe_path"].notna()].copy()
    cf = frame["capacity_factor"] if "capacity_factor" in frame else pd.Series(None, index=frame.index)
    frame["path"] = [path_label(p, c) for p, c in zip(frame["moe_path"], cf)]
    if "seed" in frame and frame["seed"].notna().any():
        keys = [frame[c] for c in ("sweep", "path") if c in frame]
        several = frame.groupby(keys, dropna=False)["seed"].transform("nunique") > 1
        frame.loc[several, "path"] = [f"{p} (seed {int(s)})" for p, s in zip(frame.loc[several, "path"],
                                                                            frame.loc[several, "seed"])]
    return frame


def _values(column: pd.Series) -> list[str]:
    return sorted({str(v) for v in column if v is not None and not pd.isna(v) and str(v) != ""})


def _unique(values: Iterable[object]) -> str:
    seen = _values(pd.Series(list(values), dtype=object))
    return ", ".join(seen) if seen else "unknown"


def _short_commit(text: str) -> str:
    """The hash (10 hex digits) when the text holds one, e.g. 'daa4578+working tree (...)' -> 'daa4578+'."""
    match = re.match(r"[0-9a-f]{7,40}", text)
    if not match:
        return text[:20]
    return match.group(0)[:10] + ("+" if len(text) > len(match.group(0)) else "")


def add_provenance(fig: plt.Figure, rows: pd.DataFrame) -> plt.Figure:
    """Footer: devices, run dates, commits of the rows drawn, and when the figure was made."""
    def values(name: str, *aliases: str) -> list[str]:
        for candidate in (name, *aliases):  # kernel tables may spell provenance differently
            if candidate in rows:
                return _values(rows[candidate])
        return []

    days = sorted({d[:10] for d in values("date")})
    dates = "unknown" if not days else days[0] if len(days) == 1 else f"{days[0]} .. {days[-1]}"
    commits = ", ".join(sorted({_short_commit(c) for c in values("git_commit", "commit")})) or "unknown"
    devices = ", ".join(values("device_kind", "device")) or "unknown"
    made = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    commits += " (+: modified tree)" if "+" in commits else ""
    text = f"device: {devices} | run date: {dates} | commit: {commits} | drawn {made}"
    # Reserve a strip at the bottom so the footer never overlaps rotated tick labels.
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))
    fig.text(0.01, 0.05 / fig.get_figheight(), text, fontsize=7, color="0.35", ha="left", va="bottom")
    return fig


def _device(frame: pd.DataFrame) -> pd.Series:
    """The device label of each row ("unknown" where the table has none)."""
    if "device_kind" not in frame:
        return pd.Series("unknown", index=frame.index)
    return frame["device_kind"].fillna("unknown").astype(str)


def _facet_axes(n: int, width: float = 5.5, height: float = 4.0) -> tuple[plt.Figure, list[plt.Axes]]:
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    return fig, list(axes[0])


def tgs_vs_batch(results: pd.DataFrame) -> plt.Figure | None:
    """TGS against per-device batch, one line per path, OOM points marked with a red x at the bottom."""
    frame = with_path_labels(results)
    if frame.empty or "per_device_batch" not in frame or "tgs" not in frame:
        return None
    frame = frame[frame["per_device_batch"].notna()]
    # Only sweeps that actually vary the batch belong on this figure.
    varied = frame.groupby("sweep")["per_device_batch"].transform("nunique") > 1
    frame = frame[varied]
    if frame.empty:
        return None
    devices = sorted(_device(frame).unique())
    fig, axes = _facet_axes(len(devices))
    for ax, device in zip(axes, devices):
        rows = frame[_device(frame) == device]
        ok = rows[rows["status"] == "ok"]
        if not ok.empty:
            sns.lineplot(data=ok, x="per_device_batch", y="tgs", hue="path", marker="o", errorbar=None, ax=ax)
        oom = rows[rows["status"] == "oom"]
        for i, (_, row) in enumerate(oom.iterrows()):
            # Red x on the batch axis; the path is written above it (several paths may OOM at one batch).
            ax.scatter(row["per_device_batch"], 0.02, marker="x", color="red", s=60, zorder=5,
                       transform=ax.get_xaxis_transform(), label="OOM" if i == 0 else None)
            ax.annotate(row["path"], (row["per_device_batch"], 0.05), xycoords=ax.get_xaxis_transform(),
                        rotation=90, fontsize=6, color="red", ha="center", va="bottom")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="per-device batch (sequences)", ylabel=TGS_LABEL, title=f"TGS vs batch — {device}")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    return add_provenance(fig, frame)


def _memory_sweep(rows: pd.DataFrame) -> str:
    """The sweep whose peak memory one device's panel shows: the one that varies the batch most (one
    sweep per panel, since sweeps differ in sequence length and model overrides)."""
    if "sweep" not in rows:
        return ""
    n_batches = rows.groupby("sweep")["per_device_batch"].nunique() if "per_device_batch" in rows else None
    sizes = rows.groupby("sweep").size()
    order = sorted(sizes.index, key=lambda s: (-(n_batches[s] if n_batches is not None else 0), -sizes[s], s))
    return order[0]


def peak_memory(results: pd.DataFrame) -> plt.Figure | None:
    """Peak device memory per path (GiB), grouped by per-device batch; one sweep per device."""
    frame = with_path_labels(results)
    if frame.empty or "peak_memory_bytes" not in frame:
        return None
    frame = frame[(frame["status"] == "ok") & frame["peak_memory_bytes"].notna()].copy()
    if frame.empty:
        return None
    frame["peak_gib"] = frame["peak_memory_bytes"].astype(float) / GIB
    devices = sorted(_device(frame).unique())
    panels = []
    for device in devices:
        rows = frame[_device(frame) == device]
        sweep = _memory_sweep(rows)
        panels.append((device, sweep, rows[rows["sweep"] == sweep] if sweep else rows))
    frame = pd.concat([rows for _, _, rows in panels])
    hue = "per_device_batch" if "per_device_batch" in frame and frame["per_device_batch"].nunique() > 1 else None
    fig, axes = _facet_axes(len(devices))
    for ax, (device, sweep, rows) in zip(axes, panels):
        sns.barplot(data=rows, x="path", y="peak_gib", hue=hue, errorbar=None, ax=ax,
                    palette="viridis" if hue else None)
        # Where the number comes from matters (device allocator peak vs host RSS on CPU).
        source = _unique(s.split(" (")[0] for s in rows["memory_source"].dropna()) \
            if "memory_source" in rows else "unknown"
        ax.set(xlabel="MoE path", ylabel="peak memory (GiB)")
        ax.set_title(f"Peak memory — {device}, {sweep}\nsource: {source}", fontsize=10)
        ax.tick_params(axis="x", rotation=20)
        if hue:
            ax.legend(title="per-device batch", fontsize=8)
    return add_provenance(fig, frame)


def loss_curves(histories: pd.DataFrame, results: pd.DataFrame) -> plt.Figure | None:
    """Train loss (left) and eval loss (right) against step, one line per point, one row per sweep."""
    if histories.empty or "loss" not in histories:
        return None
    sweeps = sorted(histories["sweep"].unique())
    fig, grid = plt.subplots(len(sweeps), 2, figsize=(12, 4 * len(sweeps)), squeeze=False)
    for (ax_train, ax_eval), sweep in zip(grid, sweeps):
        rows = histories[histories["sweep"] == sweep]
        # Cross-entropy, comparable with the eval loss (the total loss adds MTP and balance terms).
        y = "ce_loss" if "ce_loss" in rows and rows["ce_loss"].notna().any() else "loss"
        sns.lineplot(data=rows, x="step", y=y, hue="label", ax=ax_train, errorbar=None, linewidth=1)
        ax_train.set(xlabel="step", ylabel=f"train {'cross-entropy' if y == 'ce_loss' else 'loss'} (nats / token)",
                     title=f"Train loss — {sweep}")
        evals = rows[rows["eval_loss"].notna()] if "eval_loss" in rows else rows.iloc[0:0]
        if not evals.empty:
            sns.lineplot(data=evals, x="step", y="eval_loss", hue="label", marker="o", ax=ax_eval, errorbar=None)
        ax_eval.set(xlabel="step", ylabel="eval cross-entropy (nats / token)", title=f"Eval loss — {sweep}")
        for ax in (ax_train, ax_eval):
            if ax.get_legend() is not None:
                ax.legend(fontsize=8)
    return add_provenance(fig, results[results["sweep"].isin(sweeps)])


def dropped_fraction(histories: pd.DataFrame, results: pd.DataFrame) -> plt.Figure | None:
    """Fraction of token copies dropped by the capacity-factor path over training."""
    if histories.empty or "dropped_fraction" not in histories:
        return None
    rows = histories[(histories["moe_path"] == "dense_cf") & histories["dropped_fraction"].notna()]
    if rows.empty:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = rows.assign(run=rows["sweep"] + ": " + rows["label"])
    sns.lineplot(data=rows, x="step", y="dropped_fraction", hue="run", ax=ax, errorbar=None, linewidth=1)
    ax.set(xlabel="step", ylabel="dropped token copies (fraction of T·k)", title="Dropped tokens, dense_cf")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return add_provenance(fig, results[results["point"].isin(rows["point"])])


def expert_load_heatmaps(loads: dict[str, np.ndarray], results: pd.DataFrame) -> plt.Figure | None:
    """Final expert load (layer × expert) per run, as a multiple of the mean load (1 = balanced)."""
    if not loads:
        return None
    relative = {}
    for label, load in loads.items():
        load = np.asarray(load, dtype=float)  # (L_moe, E)
        relative[label] = load / np.maximum(load.mean(axis=1, keepdims=True), 1e-12)
    vmax = max(2.0, max(float(r.max()) for r in relative.values()))  # one colour scale for all panels
    fig, axes = _facet_axes(len(loads), width=5.0, height=3.5)
    for ax, (label, rel) in zip(axes, relative.items()):
        sns.heatmap(rel, ax=ax, cmap="vlag", center=1.0, vmin=0, vmax=vmax,
                    cbar_kws={"label": "load / mean load"})
        ax.set(xlabel="expert", ylabel="MoE layer", title=label)
    return add_provenance(fig, results)


CEILING_IMPLS = ("dense", "dense_cublas")  # one dense (M, K) x (K, N) GEMM with the same FLOPs
GEMM_OPS = ("fwd", "dgrad", "wgrad")


def kernel_tflops(kernels: pd.DataFrame) -> plt.Figure | None:
    """Grouped-GEMM TFLOP/s per shape and implementation (one panel per routing x op); black bars mark
    the dense-GEMM ceiling of the same FLOPs. Rows of ``benchmarks/grouped_gemm.py`` tables."""
    if kernels.empty or not {"shape", "impl", "tflops"} <= set(kernels.columns):
        return None
    rows = kernels.copy()
    rows["op"] = rows["op"] if "op" in rows else "fwd"
    rows["routing"] = rows["routing"].astype(str) if "routing" in rows else "-"
    if "status" in rows:
        rows = rows[rows["status"].astype(str) == "ok"]
    rows = rows[rows["op"].isin(GEMM_OPS) & pd.to_numeric(rows["tflops"], errors="coerce").notna()]
    rows["tflops"] = rows["tflops"].astype(float)
    ceiling = rows[rows["impl"].isin(CEILING_IMPLS)].groupby(["shape", "op"])["tflops"].max()
    grouped = rows[~rows["impl"].isin(CEILING_IMPLS)]
    if grouped.empty:
        return None
    routings = sorted(grouped["routing"].unique())
    # The comparisons the report is about; other routings (one_group, half_empty) stay in the table.
    routings = [r for r in ("balanced", "skewed") if r in routings] or routings
    ops = [o for o in GEMM_OPS if o in set(grouped["op"])]
    impls = sorted(grouped["impl"].unique(), key=lambda i: (i != "turbo", i))  # same colours in every panel
    shapes = list(dict.fromkeys(grouped["shape"]))
    width = max(6.0, 0.9 * len(shapes))
    fig, axes = plt.subplots(len(routings), len(ops), figsize=(width * len(ops), 4.2 * len(routings)),
                             squeeze=False)
    for r, routing in enumerate(routings):
        for c, op in enumerate(ops):
            ax, panel = axes[r][c], grouped[(grouped["routing"] == routing) & (grouped["op"] == op)]
            if not panel.empty:
                sns.barplot(data=panel, x="shape", y="tflops", hue="impl", order=shapes, hue_order=impls,
                            errorbar=None, ax=ax)
            for i, shape in enumerate(shapes):
                if (shape, op) in ceiling:
                    ax.hlines(ceiling[(shape, op)], i - 0.45, i + 0.45, color="black", linewidth=2,
                              label="dense GEMM ceiling" if i == 0 else None)
            ax.set(xlabel="shape", ylabel="TFLOP/s", title=f"Grouped GEMM {op}, {routing} routing")
            ax.set_ylim(0, 1.35 * float(rows["tflops"].max()))  # headroom for the legend
            ax.tick_params(axis="x", rotation=30, labelsize=7)
            ax.legend(fontsize=7, ncol=len(impls) + 1, loc="upper center")
    return add_provenance(fig, kernels)


def synthetic_vs_real(results: pd.DataFrame) -> plt.Figure | None:
    """TGS per path on synthetic tokens against real text (same sweep, same settings otherwise)."""
    frame = with_path_labels(results)
    if frame.empty or "dataset" not in frame or "tgs" not in frame:
        return None
    frame = frame[(frame["status"] == "ok") & frame["tgs"].notna()]
    varied = frame.groupby("sweep")["dataset"].transform("nunique") > 1
    frame = frame[varied]
    if frame.empty:
        return None
    frame = frame.assign(data=np.where(frame["dataset"] == "synthetic", "synthetic", "real text"))
    devices = sorted(_device(frame).unique())
    fig, axes = _facet_axes(len(devices))
    for ax, device in zip(axes, devices):
        rows = frame[_device(frame) == device]
        sns.barplot(data=rows, x="path", y="tgs", hue="data", errorbar=None, ax=ax)
        ax.set(xlabel="MoE path", ylabel=TGS_LABEL, title=f"Synthetic vs real data — {device}")
        ax.tick_params(axis="x", rotation=20)
    return add_provenance(fig, frame)
