"""Issue 13: worst-layer expert load over steps, per router recipe, from `routing_balance_gpu.py` folders.

    python benchmarks/routing_balance_figure.py \
        experiments/results/routing_balance_h100_2:preset/dense_cf_cf1.25 \
        experiments/results/routing_balance_h200_zero_unigram \
        --figure experiments/figures/routing_balance_recipes.png

Each argument is a folder holding `steps.csv` + `runs.json`, optionally `:run1,run2` to draw only those
runs, each optionally `run=label` (e.g. a "preset" run, whose recipe changed with the preset). Top: max over the router rows (MTP included) of max/mean expert load per step (5-step rolling
mean, the raw steps faint), with T1's line (2.0) and window (from step 100); bottom: dense_cf's dropped
fraction (T2: <= 10% over steps 50-400). Footer: device, dates and commits from the folders' runs.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from turbo_moe.experiments.figures import add_provenance  # noqa: E402

T1_LOAD, T1_FROM, T2_WINDOW = 2.0, 100, (50, 400)


def load_source(spec: str) -> tuple[pd.DataFrame, dict]:
    """'folder[:run,run]' -> (its steps with a worst-layer column, the folder's provenance)."""
    folder, _, wanted = spec.partition(":")
    folder = Path(folder)
    for name in ("steps.csv", "runs.json"):
        if not (folder / name).is_file():
            raise SystemExit(f"{folder}: no {name} (a routing_balance_gpu.py --out folder expected)")
    steps = pd.read_csv(folder / "steps.csv")
    load_cols = [c for c in steps.columns if c.startswith("load_L")]
    if not load_cols:
        raise SystemExit(f"{folder}/steps.csv has no load_L<i> columns")
    labels = dict(item.partition("=")[::2] for item in wanted.split(",") if item)
    runs = list(labels) or list(dict.fromkeys(steps["run"]))
    missing = sorted(set(runs) - set(steps["run"]))
    if missing:
        raise SystemExit(f"{folder}: no run {missing}; it has {sorted(set(steps['run']))}")
    steps = steps[steps["run"].isin(runs)].copy()
    steps["worst"] = steps[load_cols].max(axis=1)
    record = json.loads((folder / "runs.json").read_text())
    lr = record.get("parameters", {}).get("lr")
    steps["label"] = steps["run"].map(lambda run: labels.get(run) or run) + ("" if lr in (None, 1e-3) else f" (lr {lr:g})")
    return steps, {k: record.get(k) for k in ("device_kind", "git_commit", "date")}


def draw(sources: list[tuple[pd.DataFrame, dict]], figure: Path) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7.5), sharex=True, height_ratios=(2, 1))
    for steps, _ in sources:
        for label, run in steps.groupby("label", sort=False):
            run = run.sort_values("step")
            line, = top.plot(run["step"], run["worst"].rolling(5, min_periods=1).mean(), lw=1.6, label=label)
            top.plot(run["step"], run["worst"], lw=0.5, alpha=0.3, color=line.get_color())
            if run["path"].iloc[0] == "dense_cf":
                bottom.plot(run["step"], 100 * run["dropped"].rolling(5, min_periods=1).mean(), lw=1.4,
                            color=line.get_color(), label=label)
    top.axhline(T1_LOAD, color="k", lw=0.8, ls="--")
    last = max(int(steps["step"].max()) for steps, _ in sources)
    top.axvspan(T1_FROM, last, color="0.9", zorder=0)
    top.set_ylabel("worst layer max/mean load")
    top.set_title("T1: every layer <= 2.0 from step 100 (shaded); 5-step mean, raw steps faint")
    top.legend(fontsize=7, ncol=2)
    bottom.axvspan(*T2_WINDOW, color="0.9", zorder=0)
    bottom.axhline(10, color="k", lw=0.8, ls="--")
    bottom.set_ylabel("dense_cf dropped %")
    bottom.set_xlabel("step")
    bottom.set_title("T2: dense_cf cf 1.25 drops <= 10% over steps 50-400 (shaded)")
    provenance = pd.DataFrame([p for _, p in sources])
    add_provenance(fig, provenance)
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sources", nargs="+", help="folder[:run,run] of routing_balance_gpu.py output")
    p.add_argument("--figure", required=True)
    args = p.parse_args(argv)
    draw([load_source(s) for s in args.sources], Path(args.figure))
    print("saved", args.figure)


if __name__ == "__main__":
    main()
