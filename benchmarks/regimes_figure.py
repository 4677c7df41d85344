"""Throughput by routing regime: step time and expert load per step, per path, from `train_once.py` records.

    python benchmarks/regimes_figure.py experiments/results/regimes_h100 \
        --figure experiments/figures/throughput_by_routing_regime_h100.png

Each record is one `turbo_moe.train.run` with `log_every: 1` (every step's time and load in its history).
The figure puts TGS (tokens per device per second, 5-step rolling median) above the mean and worst-layer
max/mean expert load, so the throughput with the router collapsed (early steps) and balancing (late steps)
reads off one run; the table prints median TGS per window.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

WINDOWS = ((3, 23), (23, 50), (50, 80), (80, 110), (110, 150))  # a window past a run's end is left out
# the opt-in speed switches of issue 14 (README "Faster steps"): a run with any of them is labelled "+ cuts"
CUT_KEYS = ("adam_mu_dtype", "adam_nu_dtype", "cast_params_before_scan", "loss_chunk_tokens")


def load_runs(folder: Path) -> list[dict]:
    runs = []
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        history = [row for row in record.get("history", []) if "step_time_s" in row]
        if not history:
            raise SystemExit(f"{path}: no per-step history (run train_once.py with \"log_every\": 1)")
        overrides = record["config"].get("model_overrides", {})
        label = overrides.get("moe_path", "?")
        if label == "dense_cf":
            label += f" cf {overrides.get('capacity_factor')}"
        if any(record["config"].get(k) or overrides.get(k) for k in CUT_KEYS):
            label += " + cuts"
        if overrides.get("remat_policy"):
            label += f" + remat {overrides['remat_policy']}"
        runs.append({"label": label, "history": history, "provenance": record.get("provenance", {})})
    if not runs:
        raise SystemExit(f"{folder}: no train_once.py records (*.json)")
    return runs


def window_table(run: dict) -> list[dict]:
    tokens = run["history"][0]["tgs"] * run["history"][0]["step_time_s"]
    rows = []
    for lo, hi in WINDOWS:
        steps = [r for r in run["history"] if lo <= r["step"] < hi]
        if steps:
            ms = statistics.median(r["step_time_s"] for r in steps) * 1e3
            rows.append({"steps": f"{lo}-{hi - 1}", "ms": ms, "tgs": tokens / ms * 1e3,
                         "load": statistics.mean(r["load_max_over_mean"] for r in steps),
                         "worst": statistics.mean(r["load_max_over_mean_worst_layer"] for r in steps),
                         "dropped": statistics.mean(r["dropped_fraction"] for r in steps)})
    return rows


def draw(runs: list[dict], figure: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for run in runs:
        h = run["history"][2:]  # the first steps include one-off work
        steps = [r["step"] for r in h]
        tgs = [statistics.median(r["tgs"] for r in h[max(0, i - 4):i + 1]) for i in range(len(h))]
        line, = top.plot(steps, tgs, label=run["label"])
        bottom.plot(steps, [r["load_max_over_mean"] for r in h], color=line.get_color(), label=f"{run['label']}: mean")
        bottom.plot(steps, [r["load_max_over_mean_worst_layer"] for r in h], color=line.get_color(), ls=":",
                    label=f"{run['label']}: worst layer")
    top.set_ylabel("TGS (tokens/device/s)")
    top.set_ylim(bottom=0)
    top.legend()
    bottom.axhline(1.0, color="grey", lw=0.5)
    bottom.set_ylabel("max/mean expert load")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8, ncol=2)
    prov = runs[0]["provenance"]
    top.set_title("Throughput while the router is collapsed (early steps) and balancing (later)")
    fig.text(0.01, 0.005, f"{prov.get('device_kind')} | jax {prov.get('jax_version')} | commit {prov.get('git_commit')}"
             f" | {prov.get('date', '')[:10]} | benchmarks/regimes_figure.py", fontsize=7, color="grey")
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    figure.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(figure, dpi=110)
    plt.close(fig)
    print(f"saved {figure}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--figure", type=Path, default=None)
    args = ap.parse_args()
    runs = load_runs(args.folder)
    for run in runs:
        print(run["label"])
        for row in window_table(run):
            print(f"  steps {row['steps']:>7}: {row['ms']:6.1f} ms  TGS {row['tgs']:8.0f}  load {row['load']:.2f}"
                  f" (worst layer {row['worst']:.2f})  dropped {row['dropped']:.1%}")
    if args.figure:
        draw(runs, args.figure)


if __name__ == "__main__":
    main()
