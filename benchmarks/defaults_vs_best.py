"""Each MoE path at its defaults and at the best known settings, side by side, one process per point.

    python benchmarks/defaults_vs_best.py --out DIR [--paths turbo dense_cf ragged pallas] [--steps 40]

A user who sets only `model` and `moe_path` gets the defaults; "best" spells out every setting that measurements
found fastest (`BEST` below). "previous" (turbo only, `--previous`) is what the defaults were before they were
decided, for the record of what changed. Each point is a fresh process (`train_once.py`): no compiled program or
allocator state is shared, except JAX's persistent compilation cache when the environment turns it on.

Writes, as soon as each point ends: DIR/<path>_<variant>/0_<path>.json (the run record); after each pair:
DIR/defaults_vs_best.csv (one row a point, TGS ratio defaults / best per path) and DIR/defaults_vs_best.json (rows +
provenance: device, jax, commit, date, parameters); at the end DIR/defaults_vs_best.png.
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _provenance import provenance  # noqa: E402

# The fastest settings measured for `reduced` on one H200: TrainConfig fields, then model overrides.
BEST = {"moments_dtype": "bfloat16", "master_weights": "split"}
BEST_MODEL = {"loss_chunk_tokens": 4096, "remat_policy": "dots_experts_attention", "logits_dtype": "bfloat16"}
# The defaults before they were decided (what a user got without copying the settings above), where still settable.
PREVIOUS = {"moments_dtype": None, "master_weights": "float32"}
PREVIOUS_MODEL = {"loss_chunk_tokens": 0, "remat_policy": "dots_no_batch", "logits_dtype": "float32"}
CAPACITY = {"dense_cf": 1.25}


def point_config(path: str, variant: str, args) -> dict:
    model = {"moe_path": path, **({"capacity_factor": CAPACITY[path]} if path in CAPACITY else {})}
    config = {"model": args.model, "dataset": args.dataset, "per_device_batch": args.batch, "seq_len": args.seq,
              "steps": args.steps, "warmup_steps": min(10, args.steps), "eval_every": 0, "eval_batches": 0,
              "seed": args.seed}
    if variant == "best":
        config.update(BEST)
        model.update(BEST_MODEL)
    elif variant == "previous":
        config.update(PREVIOUS)
        model.update(PREVIOUS_MODEL)
    return {**config, "model_overrides": model}


def run_point(path: str, variant: str, args, out: Path) -> dict:
    config = point_config(path, variant, args)
    folder = out / f"{path}_{variant}"
    cmd = [sys.executable, str(HERE / "train_once.py"), "--out", str(folder), json.dumps(config)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row = {"path": path, "variant": variant, "status": "error", "tgs": None, "mfu": None, "step_time_s": None,
           "peak_memory_bytes": None, "final_loss": None, "error": None}
    records = sorted(folder.glob("*.json"))
    if records:
        record = json.loads(records[0].read_text())
        summary = record.get("summary") or {}
        row.update(status=record.get("status"), error=(record.get("error") or None) and str(record["error"])[:300],
                   **{k: summary.get(k) for k in ("tgs", "mfu", "step_time_s", "peak_memory_bytes", "final_loss")})
    else:  # the process died before writing its record: keep its last words
        row["error"] = f"rc {proc.returncode}: " + (proc.stderr or proc.stdout)[-300:]
    return row


def add_ratios(rows: list[dict]) -> None:
    best = {r["path"]: r["tgs"] for r in rows if r["variant"] == "best" and r["tgs"]}
    for r in rows:
        r["tgs_over_best"] = round(r["tgs"] / best[r["path"]], 4) if r["tgs"] and r["path"] in best else None


def save(rows: list[dict], out: Path, params: dict, prov: dict) -> None:
    add_ratios(rows)
    with open(out / "defaults_vs_best.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "defaults_vs_best.json").write_text(json.dumps(
        {"provenance": prov, "parameters": params, "best": {**BEST, "model_overrides": BEST_MODEL},
         "previous": {**PREVIOUS, "model_overrides": PREVIOUS_MODEL}, "rows": rows}, indent=1, default=str))


def plot(rows: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["tgs_over_best"] is not None]
    if not shown:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['path']}\n{r['variant']}" for r in shown]
    bars = ax.bar(labels, [r["tgs_over_best"] for r in shown],
                  color=["#4c72b0" if r["variant"] == "defaults" else "#999999" for r in shown])
    ax.bar_label(bars, fmt="%.2f")
    ax.axhline(0.97, color="#c44e52", lw=1, ls="--", label="target 0.97x")
    ax.set_ylabel("TGS / TGS at best settings")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "defaults_vs_best.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--paths", nargs="+", default=["turbo", "dense_cf", "ragged", "pallas"])
    ap.add_argument("--model", default="reduced")
    ap.add_argument("--dataset", default="synthetic")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--previous", action="store_true", help="also run turbo at the defaults before they were decided")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    params = {k: v for k, v in vars(args).items() if k != "out"}
    prov = provenance()
    rows: list[dict] = []
    variants = ["defaults", "best"]
    for path in args.paths:
        for variant in variants + (["previous"] if args.previous and path == "turbo" else []):
            row = run_point(path, variant, args, args.out)
            rows.append(row)
            save(rows, args.out, params, prov)
            print(json.dumps({k: row[k] for k in ("path", "variant", "status", "tgs", "mfu", "step_time_s",
                                                   "peak_memory_bytes", "final_loss")}), flush=True)
            if row["error"]:
                print(f"  error: {row['error']}", flush=True)
    add_ratios(rows)
    print(f"{'path':10s} {'variant':9s} {'TGS':>10s} {'x best':>7s}")
    for r in rows:
        tgs = f"{r['tgs']:.0f}" if r["tgs"] else r["status"]
        ratio = f"{r['tgs_over_best']:.3f}" if r["tgs_over_best"] is not None else "-"
        print(f"{r['path']:10s} {r['variant']:9s} {tgs:>10s} {ratio:>7s}")
    device = prov.get("device_kind") or prov.get("device") or "?"
    plot(rows, args.out, f"defaults vs best, {args.model} b{args.batch} x {args.seq}, {args.steps} steps, {device}, "
                         f"jax {prov.get('jax_version')}, {str(prov.get('git_commit'))[:8]}")


if __name__ == "__main__":
    main()
