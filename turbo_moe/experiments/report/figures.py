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


def short_commit(text: str) -> str:
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
    commits = ", ".join(sorted({short_commit(c) for c in values("git_commit", "commit")})) or "unknown"
    devices = ", ".join(values("device_kind", "device")) or "unknown"
    campaigns = ", ".join(values("campaign")) or "unknown"
    made = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    commits += " (+: modified tree)" if "+" in commits else ""
    lines = [f"campaign: {campaigns} | device: {devices} | run date: {dates} | commit: {commits} | drawn {made}"]
    loaded = load_note(rows)
    if loaded:
        lines.append(loaded)
    # Reserve a strip at the bottom so the footer never overlaps rotated tick labels.
    fig.tight_layout(rect=(0, (0.25 + 0.13 * len(lines)) / fig.get_figheight(), 1, 1))
    fig.text(0.01, 0.05 / fig.get_figheight(), "\n".join(lines), fontsize=7, color="0.35", ha="left", va="bottom")
    return fig


LOADED_PER_CORE = 0.5  # other work on the machine above this (1-min load per core, outside the run) skews timings


def load_note(rows: pd.DataFrame) -> str:
    """A warning line when rows were measured on a loaded machine (``load_per_core``, recorded at run time):
    their timings are not comparable with runs on an idle one."""
    if "load_per_core" not in rows:
        return ""
    load = pd.to_numeric(rows["load_per_core"], errors="coerce").dropna()
    if load.empty or load.max() <= LOADED_PER_CORE:
        return ""
    return (f"measured on a loaded machine (1-min load {load.max():.2f} per core): "
            "timings are not comparable with the published ones")


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
        _mark_not_run(ax, rows)
        oom = rows[rows["status"] == "oom"]
        for i, (batch, paths) in enumerate(oom.groupby("per_device_batch")["path"]):
            # Red x on the batch axis; the paths that ran out of memory there are written above it, one
            # column each (rotated text: one line per path, side by side, never on top of each other).
            ax.scatter(batch, 0.02, marker="x", color="red", s=60, zorder=5,
                       transform=ax.get_xaxis_transform(), label="OOM" if i == 0 else None)
            ax.annotate("\n".join(paths), (batch, 0.05), xycoords=ax.get_xaxis_transform(),
                        rotation=90, fontsize=6, color="red", ha="center", va="bottom")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="per-device batch (sequences)", ylabel=TGS_LABEL, title=f"TGS vs batch — {device}")
        ax.set_ylim(bottom=0)
        # Outside the axes: inside, it covered the largest batch's points (the ones that matter most).
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return add_provenance(fig, frame)


def _mark_not_run(ax: plt.Axes, rows: pd.DataFrame) -> None:
    """Grey open circles on the batch axis where a path has no result at a batch its sweep ran for other
    paths (not run: device time, a skipped point past the OOM frontier, or an error)."""
    first = True
    for sweep, sweep_rows in rows.groupby("sweep"):
        batches = set(sweep_rows["per_device_batch"])
        for path, path_rows in sweep_rows.groupby("path"):
            done = set(path_rows.loc[path_rows["status"].isin(["ok", "oom"]), "per_device_batch"])
            for batch in sorted(batches - done):
                # Above the OOM crosses (which sit at the bottom), so that both stay readable.
                ax.scatter(batch, 0.45, marker="o", facecolors="none", edgecolors="0.4", s=60, zorder=5,
                           transform=ax.get_xaxis_transform(), label="not run" if first else None)
                ax.annotate(f"{path}: not run", (batch, 0.45), xycoords=ax.get_xaxis_transform(),
                            xytext=(-8, 0), textcoords="offset points", fontsize=7, color="0.25", ha="right",
                            va="center", bbox={"fc": "white", "ec": "none", "alpha": 0.8, "pad": 1})
                first = False


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
    """Memory per path (GiB), grouped by per-device batch; one sweep per device.

    Bars: what the train step needs by XLA's memory analysis of the compiled step (arguments + outputs - aliases +
    temporaries: `compiled_total_bytes`), where recorded. Markers: the measured peak of the whole process (device
    allocator on GPUs, RSS on the CPU). The measured peak also covers the parameter init, whose program can need more
    than a small batch's step (on GPUs its threefry kernel lowering materialises ~24 bytes per element of the largest
    draw), so at small batches it is the init's, the same for every path. Without the analysis the bars are the peak."""
    frame = with_path_labels(results)
    if frame.empty or "peak_memory_bytes" not in frame:
        return None
    frame = frame[(frame["status"] == "ok") & frame["peak_memory_bytes"].notna()].copy()
    if frame.empty:
        return None
    frame["peak_gib"] = frame["peak_memory_bytes"].astype(float) / GIB
    need = pd.to_numeric(frame["compiled_total_bytes"], errors="coerce") if "compiled_total_bytes" in frame else None
    frame["need_gib"] = need / GIB if need is not None else float("nan")
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
        analysed = rows["need_gib"].notna().all()
        sns.barplot(data=rows, x="path", y="need_gib" if analysed else "peak_gib", hue=hue, errorbar=None, ax=ax,
                    palette="viridis" if hue else None)
        # Where the number comes from matters (device allocator peak vs host RSS on CPU).
        source = _unique(s.split(" (")[0] for s in rows["memory_source"].dropna()) \
            if "memory_source" in rows else "unknown"
        if analysed:
            sns.stripplot(data=rows, x="path", y="peak_gib", hue=hue, dodge=bool(hue), ax=ax, marker="D", size=5,
                          palette=["black"] * (rows[hue].nunique() if hue else 1) if hue else None,
                          color=None if hue else "black", legend=False, jitter=False)
            title = f"Memory — {device}, {sweep}\nbars: train step (XLA memory analysis); \u25c6 measured peak " \
                    f"incl. init\n({source})"
        else:
            title = f"Peak memory — {device}, {sweep}\nsource: {source}"
        ax.set(xlabel="MoE path", ylabel="memory (GiB)")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", rotation=20)
        if hue:  # outside the axes: inside, it covered the tallest bars
            handles, labels = ax.get_legend_handles_labels()
            n = rows[hue].nunique()
            ax.legend(handles[:n], labels[:n], title="per-device batch", fontsize=8, bbox_to_anchor=(1.01, 1),
                      loc="upper left")
    return add_provenance(fig, frame)


def loss_curves(histories: pd.DataFrame, results: pd.DataFrame) -> plt.Figure | None:
    """Train loss (left) and eval loss (right) against step, one line per point, one row per sweep."""
    if histories.empty or "loss" not in histories:
        return None
    sweeps = sorted(histories["sweep"].unique())
    fig, grid = plt.subplots(len(sweeps), 2, figsize=(10, 3.6 * len(sweeps)), squeeze=False)
    for (ax_train, ax_eval), sweep in zip(grid, sweeps):
        rows = histories[histories["sweep"] == sweep]
        # Cross-entropy, comparable with the eval loss (the total loss adds MTP and balance terms).
        y = "ce_loss" if "ce_loss" in rows and rows["ce_loss"].notna().any() else "loss"
        labels = sorted(rows["label"].unique())
        palette = dict(zip(labels, sns.color_palette(n_colors=len(labels))))  # same colours on both panels
        _smoothed_lines(ax_train, rows, y, palette)
        ax_train.set(xlabel="step", ylabel=f"train {'cross-entropy' if y == 'ce_loss' else 'loss'} (nats / token)",
                     title=f"Train loss — {sweep}")
        evals = rows[rows["eval_loss"].notna()] if "eval_loss" in rows else rows.iloc[0:0]
        if not evals.empty:
            sns.lineplot(data=evals, x="step", y="eval_loss", hue="label", marker="o", ax=ax_eval, errorbar=None,
                         palette=palette, hue_order=[label for label in labels if label in set(evals["label"])])
        ax_eval.set(xlabel="step", ylabel="eval cross-entropy (nats / token)", title=f"Eval loss — {sweep}")
        if ax_eval.get_legend() is not None:
            ax_eval.legend(fontsize=8)
    return add_provenance(fig, results[results["sweep"].isin(sweeps)])


def smooth(values: pd.Series, window: int | None = None) -> pd.Series:
    """Centred rolling mean (window ~ 1/15 of the run, at least 1): the trend of a noisy curve."""
    window = window or max(1, len(values) // 15)
    return values.rolling(window, center=True, min_periods=1).mean()


def _smoothed_lines(ax: plt.Axes, rows: pd.DataFrame, y: str, palette: dict[str, object]) -> None:
    """One colour per label: the raw curve faint, its rolling mean solid (noisy curves hide each other)."""
    for label, run in rows.groupby("label", sort=True):
        colour, run = palette[label], run.sort_values("step")
        ax.plot(run["step"], run[y], color=colour, alpha=0.25, linewidth=0.8)
        ax.plot(run["step"], smooth(run[y].reset_index(drop=True)).to_numpy(), color=colour, linewidth=1.6,
                label=label)
    if len(rows):
        ax.legend(fontsize=8, title="rolling mean (raw faint)", title_fontsize=8)


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
    ax.set(xlabel="step", ylabel="dropped token copies (fraction of T·k)",
           title="Dropped tokens, dense_cf (the dropless paths drop none)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return add_provenance(fig, results[results["point"].isin(rows["point"])])


def load_over_steps(histories: pd.DataFrame, results: pd.DataFrame,
                    phases: dict[str, tuple[float, float]]) -> plt.Figure | None:
    """Max/mean expert load (mean over MoE layers) against step, every path, one panel per sweep; the
    report's routing phases (fractions of the sweep's steps: init, late) shaded."""
    if histories.empty or "load_max_over_mean" not in histories:
        return None
    rows = histories[histories["load_max_over_mean"].notna()]
    if rows.empty:
        return None
    sweeps = list(dict.fromkeys(rows["sweep"]))
    fig, axes = plt.subplots(1, len(sweeps), figsize=(5 * len(sweeps) + 1, 4), squeeze=False)
    for ax, sweep in zip(axes[0], sweeps):
        part = rows[rows["sweep"] == sweep]
        sns.lineplot(data=part, x="step", y="load_max_over_mean", hue="label", ax=ax, errorbar=None, linewidth=1)
        last = float(part["step"].max()) + 1
        for name, (lo, hi) in phases.items():
            ax.axvspan(lo * last, hi * last, color="0.85", alpha=0.6, zorder=0)
            ax.text((lo + hi) / 2 * last, 0.98, name, transform=ax.get_xaxis_transform(), ha="center",
                    va="top", fontsize=8)
        ax.axhline(1.0, color="0.4", linewidth=0.8, linestyle=":")
        ax.set(xlabel="step", ylabel="expert load, max / mean (1 = balanced)", title=sweep)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle("Routing balance over training (mean over MoE layers)")
    return add_provenance(fig, results[results["point"].isin(rows["point"])])


def moe_row_labels(cfg) -> list[str]:
    """Row names of a model's expert load (``ModelConfig.n_router_layers`` rows): its MoE layers by layer
    index, then its MoE multi-token-prediction blocks (``MTP 0``, ...), which route tokens too."""
    main = [f"layer {i}" for i in range(cfg.n_dense_layers, cfg.n_layers)]
    return main + [f"MTP {d}" for d in range(cfg.mtp_depth) if cfg.is_moe_layer(cfg.n_layers + d)]


def expert_load_heatmaps(loads: dict[str, np.ndarray], results: pd.DataFrame,
                         row_labels: dict[str, list[str]] | None = None) -> plt.Figure | None:
    """Final expert load (layer x expert) per run, as a multiple of the layer's mean load (1 = balanced).

    One row per run (legible at a notebook's width); a logarithmic colour scale centred on 1, so that 2x
    and 0.5x are equally strong and a modest imbalance is not washed out by one hot expert. The rows are
    the MoE layers, then the MoE MTP blocks: ``row_labels[label]`` names them (``moe_row_labels``); without
    it they are numbered.
    """
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FuncFormatter

    if not loads:
        return None
    relative = {}
    for label, load in loads.items():
        load = np.asarray(load, dtype=float)  # (L_moe, E)
        relative[label] = load / np.maximum(load.mean(axis=1, keepdims=True), 1e-12)
    spread = np.concatenate([np.maximum(r, 1e-6).ravel() for r in relative.values()])
    ratio = np.maximum(spread, 1 / spread)
    vmax = float(np.clip(np.percentile(ratio, 99), 2.0, 16.0))  # one scale for all panels
    n_layers = max(r.shape[0] for r in relative.values())
    fig, axes = plt.subplots(len(relative), 1, figsize=(9, 0.9 + 0.28 * n_layers * len(relative) + 0.6 * len(relative)),
                             squeeze=False)
    ticks = [t for t in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4, 8, 16) if 1 / vmax <= t <= vmax]
    panel_in = fig.get_figheight() / len(relative) - 0.6  # the colour bar's height, about
    while len(ticks) > 3 and 0.22 * len(ticks) > panel_in:  # thin out, keeping 1 (the middle tick)
        middle = ticks.index(1)
        ticks = [t for i, t in enumerate(ticks) if (i - middle) % 2 == 0]
    as_text = FuncFormatter(lambda t, _: f"1/{1 / t:g}" if t < 1 else f"{t:g}")  # 1/4, not 0.25
    for ax, (label, rel) in zip(axes[:, 0], relative.items()):
        shown = np.clip(rel, 1 / vmax, vmax)  # idle experts (0) show as the lowest colour
        names = (row_labels or {}).get(label)
        names = names if names is not None and len(names) == rel.shape[0] else None
        sns.heatmap(shown, ax=ax, cmap="RdBu_r", norm=LogNorm(1 / vmax, vmax),
                    cbar_kws={"ticks": ticks, "format": as_text},
                    xticklabels=max(1, rel.shape[1] // 16), yticklabels=names if names is not None else True)
        bar = ax.collections[0].colorbar
        bar.ax.minorticks_off()  # a log colour bar labels its minor ticks too: they collided with these
        bar.ax.tick_params(labelsize=7)
        bar.set_label("load / mean", fontsize=7)
        idle = int((rel == 0).sum())  # (row, expert) cells with no token
        ax.set(xlabel="expert", ylabel="MoE block" if names is not None else "MoE block (layers, then MTP)",
               title=f"{label}: max/mean {rel.max(axis=1).mean():.2f}"
                     + (f", {idle} idle expert{'' if idle == 1 else 's'}" if idle else ""))
        if names is not None:
            ax.tick_params(axis="y", rotation=0)
        ax.tick_params(axis="both", labelsize=7)
    return add_provenance(fig, results)


CEILING_IMPLS = ("dense", "dense_cublas")  # one dense (M, K) x (K, N) GEMM with the same FLOPs
GEMM_OPS = ("fwd", "dgrad", "wgrad")


def _kernel_rows(kernels: pd.DataFrame) -> pd.DataFrame:
    """Timed grouped-GEMM rows (fwd/dgrad/wgrad, status ok) with op and routing columns."""
    if kernels.empty or not {"shape", "impl", "tflops"} <= set(kernels.columns):
        return kernels.iloc[0:0]
    rows = kernels.copy()
    rows["op"] = rows["op"] if "op" in rows else "fwd"
    rows["routing"] = rows["routing"].astype(str) if "routing" in rows else "-"
    if "status" in rows:
        rows = rows[rows["status"].astype(str) == "ok"]
    rows = rows[rows["op"].isin(GEMM_OPS) & pd.to_numeric(rows["tflops"], errors="coerce").notna()]
    return rows.assign(tflops=rows["tflops"].astype(float))


def kernel_routings(kernels: pd.DataFrame) -> list[str]:
    """Routings with grouped (non-ceiling) rows, the report's comparisons first (balanced, skewed); the
    others (one_group, half_empty) stay in the table only."""
    rows = _kernel_rows(kernels)
    found = sorted(set(rows.loc[~rows["impl"].isin(CEILING_IMPLS), "routing"]))
    return [r for r in ("balanced", "skewed") if r in found] or found


def kernel_tflops(kernels: pd.DataFrame, routing: str | None = None) -> plt.Figure | None:
    """Grouped-GEMM TFLOP/s per shape and implementation for one routing (default: the first of
    ``kernel_routings``), one row per op (fwd, dgrad, wgrad) so that it stays legible at a notebook's
    width; black bars mark the dense-GEMM ceiling of the same FLOPs. Rows of ``benchmarks/grouped_gemm.py``."""
    rows = _kernel_rows(kernels)
    routings = kernel_routings(kernels)
    if rows.empty or not routings:
        return None
    routing = routing or routings[0]
    ceiling = rows[rows["impl"].isin(CEILING_IMPLS)].groupby(["shape", "op"])["tflops"].max()
    grouped = rows[~rows["impl"].isin(CEILING_IMPLS)]
    ops = [o for o in GEMM_OPS if o in set(grouped["op"])]
    impls = sorted(grouped["impl"].unique(), key=lambda i: (i != "turbo", i))  # same colours in every panel
    shapes = list(dict.fromkeys(grouped["shape"]))
    fig, axes = plt.subplots(len(ops), 1, figsize=(9.5, 3.3 * len(ops)), squeeze=False, sharex=True)
    for ax, op in zip(axes[:, 0], ops):
        panel = grouped[(grouped["routing"] == routing) & (grouped["op"] == op)]
        if not panel.empty:
            sns.barplot(data=panel, x="shape", y="tflops", hue="impl", order=shapes, hue_order=impls,
                        errorbar=None, ax=ax)
            for bars in ax.containers:  # values on the bars: ragged_dot's are 50x below the others
                ax.bar_label(bars, fmt="%.0f", fontsize=6, padding=1)
        for i, shape in enumerate(shapes):
            if (shape, op) in ceiling:
                ax.hlines(ceiling[(shape, op)], i - 0.45, i + 0.45, color="black", linewidth=2,
                          label="dense GEMM ceiling" if i == 0 else None)
        # A log axis: a 10 TFLOP/s bar stays visible next to 600 TFLOP/s ones.
        ax.set_yscale("log")
        ax.set(xlabel="", ylabel="TFLOP/s (log)", title=f"Grouped GEMM {op}, {routing} routing")
        ax.set_ylim(max(0.5 * float(rows["tflops"].min()), 1e-3), 3 * float(rows["tflops"].max()))
        ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    axes[-1, 0].set_xlabel("shape")
    axes[-1, 0].tick_params(axis="x", rotation=35, labelsize=7)
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
        ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    return add_provenance(fig, frame)
