"""Analysis of a convergence comparison: per-path eval loss across seeds and the drop penalty.

Input: run records as `benchmarks/convergence_gpu.py` writes them (one dict per run):
``{"path": "dense_cf", "capacity_factor": 1.25, "seed": 0, "status": "ok",
  "evals": [{"step": 24, "tokens": 393216, "eval_loss": 5.1}, ...]}``.
The final eval loss of a run is its last eval point. The drop penalty of a path is
``mean(path) - mean(baseline)`` over seeds (positive: that path ends worse than the dropless baseline)
with a Welch t-interval (n = the seeds of each side; df by Welch-Satterthwaite) and, where both sides
ran the same seeds, a paired t-interval over the per-seed differences (n = common seeds, df = n - 1).
With 2 seeds a side the intervals are wide by construction (t = 4.3 at df ~2, 12.7 paired at df 1).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from scipy import stats

from turbo_moe.experiments.store import store

BASELINE = "turbo"


def run_label(record: dict) -> str:
    """``turbo`` / ``dense_cf (cf=1.25)``, as the report's figures spell paths (figures.path_label; not
    imported: this module must run where only jax and numpy are installed, e.g. the GPU machine)."""
    path = record.get("analysis_path", record["path"])  # dense_cf's drops run on turbo: still dense_cf's
    if path == "dense_cf" and record.get("capacity_factor") is not None:
        return f"dense_cf (cf={float(record['capacity_factor']):g})"
    return str(path)


def load_records(directory: str | Path) -> list[dict]:
    """Every ``runs/*.json`` record under ``directory`` (sorted by file name)."""
    return [json.loads(p.read_text()) for p in sorted(Path(directory, "runs").glob("*.json"))]


def final_eval_loss(record: dict) -> float:
    evals = [e["eval_loss"] for e in record.get("evals", []) if _finite(e.get("eval_loss"))]
    return evals[-1] if evals else math.nan


def t_interval(values: Sequence[float], confidence: float = 0.95) -> dict:
    """Mean of ``values`` with its t-interval (nan bounds below 2 values)."""
    x = np.asarray([v for v in values if _finite(v)], dtype=float)
    n = len(x)
    mean = float(x.mean()) if n else math.nan
    if n < 2:
        return {"n": n, "mean": mean, "sd": math.nan, "lo": math.nan, "hi": math.nan, "df": math.nan}
    sd = float(x.std(ddof=1))
    half = stats.t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "lo": mean - half, "hi": mean + half, "df": n - 1}


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> dict:
    """mean(a) - mean(b) with a Welch t-interval (nan bounds when either side has < 2 values)."""
    a = np.asarray([v for v in a if _finite(v)], dtype=float)
    b = np.asarray([v for v in b if _finite(v)], dtype=float)
    out = {"n_a": len(a), "n_b": len(b), "diff": math.nan, "lo": math.nan, "hi": math.nan, "df": math.nan}
    if len(a) and len(b):
        out["diff"] = float(a.mean() - b.mean())
    if len(a) < 2 or len(b) < 2:
        return out
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return dict(out, lo=out["diff"], hi=out["diff"], df=math.inf)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = stats.t.ppf(0.5 + confidence / 2, df) * se
    return dict(out, lo=out["diff"] - half, hi=out["diff"] + half, df=float(df))


def summarize(records: Iterable[dict], baseline: str = BASELINE, confidence: float = 0.95) -> dict:
    """Per-path final eval loss (mean, sd, t-interval over seeds) and each path's penalty vs ``baseline``."""
    finals: dict[str, dict[int, float]] = {}
    for r in records:
        if r.get("status") == "ok" and _finite(final_eval_loss(r)):
            finals.setdefault(run_label(r), {})[int(r["seed"])] = final_eval_loss(r)
    paths = {label: dict(t_interval(list(by_seed.values()), confidence), seeds=sorted(by_seed))
             for label, by_seed in finals.items()}
    penalties = {}
    base = finals.get(baseline, {})
    for label, by_seed in finals.items():
        if label == baseline or not base:
            continue
        welch = welch_interval(list(by_seed.values()), list(base.values()), confidence)
        common = sorted(set(by_seed) & set(base))
        paired = t_interval([by_seed[s] - base[s] for s in common], confidence)
        penalties[label] = {"welch": welch, "paired": dict(paired, seeds=common),
                            "separates": bool(_finite(welch["lo"]) and (welch["lo"] > 0 or welch["hi"] < 0))}
    return {"baseline": baseline, "confidence": confidence, "paths": paths, "penalties": penalties}


def curves(records: Iterable[dict]) -> dict[str, dict[int, list[tuple[float, float]]]]:
    """label -> seed -> [(tokens, eval_loss)] of finished runs."""
    out: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for r in records:
        if r.get("status") != "ok":
            continue
        points = [(float(e["tokens"]), float(e["eval_loss"])) for e in r.get("evals", []) if _finite(e.get("eval_loss"))]
        if points:
            out.setdefault(run_label(r), {})[int(r["seed"])] = points
    return out


def _band(by_seed: dict[int, list[tuple[float, float]]], confidence: float):
    """Common eval points of all seeds: tokens, mean, lo, hi (the t-interval of the mean; min/max-free)."""
    tokens = sorted(set.intersection(*(set(t for t, _ in pts) for pts in by_seed.values())))
    rows = [t_interval([dict(pts)[t] for pts in by_seed.values()], confidence) for t in tokens]
    return (np.array(tokens), np.array([r["mean"] for r in rows]), np.array([r["lo"] for r in rows]),
            np.array([r["hi"] for r in rows]))


def plot_convergence(records: Sequence[dict], out_png: str | Path, *, footer: str = "", baseline: str = BASELINE,
                     confidence: float = 0.95):
    """Left: eval loss vs training tokens, per path the mean over seeds with its t-interval band and each
    seed thin. Right: penalty (path - baseline, mean over seeds) vs tokens with the Welch band."""
    plt = _pyplot()
    fig, (ax, ax_pen) = plt.subplots(1, 2, figsize=(12, 4.6))
    colours = _colours(plt, curves(records))
    _plot_eval_loss(ax, records, colours, confidence)
    _plot_penalty(ax_pen, records, colours, baseline, confidence)
    return _save(fig, plt, out_png, footer)


def plot_drop_penalty(records: Sequence[dict], out_png: str | Path, *, footer: str = "", baseline: str = BASELINE,
                      confidence: float = 0.95, window: int = 50):
    """Four panels over training tokens: eval loss per path (seed bands), the penalty vs ``baseline`` (Welch band),
    the dropped fraction and the max/mean expert load (mean over seeds of a ``window``-step running mean): the
    regime each run was in."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.4))
    colours = _colours(plt, curves(records))
    _plot_eval_loss(axes[0, 0], records, colours, confidence)
    _plot_penalty(axes[0, 1], records, colours, baseline, confidence)
    for ax, key, label, title in ((axes[1, 0], "dropped_fraction", "dropped fraction of (token, choice) pairs",
                                   "dropped pairs"),
                                  (axes[1, 1], "load_max_over_mean", "max / mean expert load (mean over layers)",
                                   "expert load")):
        for path, (tokens, mean) in sorted(step_series(records, key, window).items()):
            ax.plot(tokens, mean, color=colours.get(path), lw=1.6, label=path)
        ax.set(xlabel="training tokens", ylabel=label, title=f"{title} ({window}-step mean, mean over seeds)")
        if ax.lines:
            ax.legend(fontsize=8)
    return _save(fig, plt, out_png, footer)


def step_series(records: Iterable[dict], key: str, window: int = 50) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """label -> (tokens, mean over seeds of the ``window``-step running mean of the per-step ``key``), over the
    steps every seed of the label has."""
    by_label: dict[str, list[np.ndarray]] = {}
    tokens_per_step: dict[str, int] = {}
    for r in records:
        values = (r.get("steps") or {}).get(key)
        if r.get("status") not in ("ok", "partial") or not values:
            continue
        x = np.asarray([np.nan if v is None else v for v in values], dtype=float)
        kernel = np.ones(min(window, len(x))) / min(window, len(x))
        by_label.setdefault(run_label(r), []).append(np.convolve(x, kernel, mode="valid"))
        tokens_per_step[run_label(r)] = int(r.get("tokens_per_step") or 1)
    out = {}
    for label, series in by_label.items():
        n = min(len(s) for s in series)
        steps = np.arange(n) + min(window, n)
        out[label] = (steps * tokens_per_step[label], np.mean([s[:n] for s in series], axis=0))
    return out


def records_from_store(store_dir: str | Path, campaigns: Iterable[str] | None = None,
                       prefix: str = "drop_penalty") -> list[dict]:
    """The run records (``runs/<label>.json``) of the store's campaigns named ``prefix``..., as
    `benchmarks/convergence_gpu.py` wrote them: eval points back from the history, per-step rows and the rest from
    the record."""
    store_dir = Path(store_dir)
    if not store_dir.is_dir():
        return []
    names = [c for c in (store.current_campaigns(store_dir) if campaigns is None else campaigns)
             if str(c).startswith(prefix)]
    if not names:
        return []
    rows = store.read_records(store_dir, names)
    rows = rows[rows["source"].str.contains("runs/", regex=False) & rows["source"].str.endswith(".json")]
    history = store.read_history(store_dir, names, wide=False)
    out = []
    for _, row in rows.iterrows():
        record = store.record_dict(row, history)
        evals = [{"step": h["step"], **{k[len("evals."):]: v for k, v in h.items() if k.startswith("evals.")}}
                 for h in record.pop("history")]
        out.append({**record, "status": row["status"], "campaign": row.get("campaign"),
                    "evals": [e for e in evals if "eval_loss" in e]})
    return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _colours(plt, data) -> dict[str, str]:
    return dict(zip(sorted(data), plt.rcParams["axes.prop_cycle"].by_key()["color"]))


def _plot_eval_loss(ax, records, colours, confidence) -> None:
    data = curves(records)
    for label, by_seed in sorted(data.items()):
        c = colours[label]
        for pts in by_seed.values():
            ax.plot(*zip(*pts), color=c, lw=0.7, alpha=0.45)
        tokens, mean, lo, hi = _band(by_seed, confidence)
        ax.plot(tokens, mean, color=c, lw=2, label=f"{label} (n={len(by_seed)})")
        if len(by_seed) > 1:
            ax.fill_between(tokens, lo, hi, color=c, alpha=0.2)
    ax.set(xlabel="training tokens", ylabel="eval cross-entropy (nats)",
           title=f"eval loss: mean over seeds, {confidence:.0%} t-band")
    ax.legend(fontsize=8)


def _plot_penalty(ax_pen, records, colours, baseline, confidence) -> None:
    data = curves(records)
    base = data.get(baseline)
    for label, by_seed in sorted(data.items()):
        if label == baseline or not base:
            continue
        tokens = sorted(set.intersection(*(set(t for t, _ in p) for p in [*by_seed.values(), *base.values()])))
        rows = [welch_interval([dict(p)[t] for p in by_seed.values()], [dict(p)[t] for p in base.values()],
                               confidence) for t in tokens]
        c = colours[label]
        ax_pen.plot(tokens, [r["diff"] for r in rows], color=c, lw=2, label=f"{label} - {baseline}")
        ax_pen.fill_between(tokens, [r["lo"] for r in rows], [r["hi"] for r in rows], color=c, alpha=0.2)
    ax_pen.axhline(0, color="k", lw=0.8)
    ax_pen.set(xlabel="training tokens", ylabel="eval loss difference (nats)",
               title=f"drop penalty vs {baseline} ({confidence:.0%} Welch band)")
    if ax_pen.lines[1:]:
        ax_pen.legend(fontsize=8)


def _save(fig, plt, out_png, footer: str):
    """Save to ``out_png`` and close (returns the path); ``out_png`` None: return the open figure (the report)."""
    if footer:
        fig.text(0.01, 0.005, footer, fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    if out_png is None:
        return fig
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return out_png


def format_summary(summary: dict) -> str:
    """A markdown table of the summary (the numbers the notes and the README quote)."""
    conf = f"{summary['confidence']:.0%}"
    lines = [f"| path | seeds | final eval loss, mean | sd | {conf} t-interval |", "|---|---|---|---|---|"]
    for label, p in sorted(summary["paths"].items()):
        lines.append(f"| {label} | {p['n']} ({', '.join(map(str, p['seeds']))}) | {p['mean']:.4f} | {p['sd']:.4f} | "
                     f"[{p['lo']:.4f}, {p['hi']:.4f}] |")
    lines += ["", f"| penalty vs {summary['baseline']} | mean diff | Welch {conf} (n, df) | paired {conf} (n) | separates |",
              "|---|---|---|---|---|"]
    for label, pen in sorted(summary["penalties"].items()):
        w, pr = pen["welch"], pen["paired"]
        lines.append(f"| {label} | {w['diff']:+.4f} | [{w['lo']:+.4f}, {w['hi']:+.4f}] ({w['n_a']}+{w['n_b']}, "
                     f"{w['df']:.1f}) | [{pr['lo']:+.4f}, {pr['hi']:+.4f}] ({pr['n']}) | "
                     f"{'yes' if pen['separates'] else 'no'} |")
    return "\n".join(lines)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
