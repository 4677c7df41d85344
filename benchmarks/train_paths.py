"""Train each MoE path side by side in ONE process on the device at hand (a benchmark, not a test).

The same points as a sweep spec (papermill needs Jupyter, which GPU machines often lack), recorded in
the same tidy table a sweep writes (`<results>/<sweep>.csv` + one JSON record per point, with
provenance), so `turbo-moe report` draws them. A failed or out-of-memory point is a row, never a crash.
Points are run in the order given; `--budget-s` stops starting new points when time runs out.

    python benchmarks/train_paths.py --sweep gpu_paths_x_batch --model reduced --batches 8 16 \
        --paths dense_cf:1.25 dense_cf:2 ragged turbo --steps 12 --budget-s 420
"""
from __future__ import annotations

import argparse
import time
import traceback

from turbo_moe.experiments import notebook as nb
from turbo_moe.train import run


def parse_path(text: str) -> dict:
    """'dense_cf:1.25' -> {moe_path: dense_cf, capacity_factor: 1.25}; 'turbo' -> {moe_path: turbo}."""
    name, _, cf = text.partition(":")
    return {"moe_path": name, **({"capacity_factor": float(cf)} if cf else {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", required=True, help="results table name (experiments/results/<sweep>.csv)")
    p.add_argument("--results-dir", default="experiments/results")
    p.add_argument("--model", default="reduced")
    p.add_argument("--paths", nargs="+", default=["dense_cf:1.25", "dense_cf:2", "ragged", "turbo"])
    p.add_argument("--batches", nargs="+", type=int, default=[8])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--skip-steps-for-tgs", type=int, default=3)
    p.add_argument("--dataset", default="synthetic")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no new point after this many seconds")
    args = p.parse_args()

    start = time.time()
    for batch in args.batches:
        for path in args.paths:
            if time.time() - start > args.budget_s:
                print(f"budget of {args.budget_s:.0f}s spent: not running batch={batch} {path}")
                continue
            params = {"model": args.model, **parse_path(path), "per_device_batch": batch, "seq_len": args.seq_len,
                      "steps": args.steps, "dataset": args.dataset}
            t0 = time.time()
            try:
                tc = nb.train_config(
                    model=args.model, model_overrides={}, moe_path=params["moe_path"],
                    capacity_factor=params.get("capacity_factor"), per_device_batch=batch, steps=args.steps,
                    train_overrides={"skip_steps_for_tgs": args.skip_steps_for_tgs, "progress": False},
                    seq_len=args.seq_len, learning_rate=3e-4, warmup_steps=args.warmup_steps, eval_every=0,
                    eval_batches=1, dataset=args.dataset, seed=0)
                result = run(tc)
            except Exception:  # a crash outside run() is still a data point
                print(f"batch={batch} {path}: error\n{traceback.format_exc()}")
                continue
            nb.record_in_table(result, results_dir=args.results_dir, sweep=args.sweep, params=params,
                               elapsed_s=time.time() - t0)
            s = result.summary or {}
            print(f"batch={batch:3d} {path:14s} status={result.status:5s} tgs={s.get('tgs', float('nan')):9.1f} "
                  f"peak={s.get('peak_memory_bytes', float('nan')) / 2**30:6.1f} GiB  ({time.time() - t0:.0f}s)"
                  + (f"  {result.error[:160]}" if result.error else ""), flush=True)


if __name__ == "__main__":
    main()
