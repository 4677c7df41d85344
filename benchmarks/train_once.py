"""One training run per JSON config, in this process, its summary printed and saved as it finishes.

    python benchmarks/train_once.py --out DIR '{"model": "reduced", "dataset": "synthetic", "steps": 20}' ...

For GPU machines without Jupyter (the sweeps need papermill): each config is a `TrainConfig` dict;
a failed or out-of-memory run is a record with its status, never the end of the list. Each record
(`<DIR>/<i>_<moe_path>.json`: summary, provenance, history) is written as soon as its run ends.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", help="TrainConfig dicts as JSON")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from turbo_moe.train import TrainConfig, run

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keys = ("status", "tgs", "mfu", "step_time_s", "peak_memory_bytes", "compile_time_s", "phase_seconds",
            "final_loss", "dropped_fraction_mean", "load_max_over_mean_mean")
    for i, text in enumerate(args.configs):
        try:
            config = TrainConfig.from_dict({"progress": False, **json.loads(text)})
        except (ValueError, TypeError) as error:
            print(f"config {i}: {error}", file=sys.stderr)
            continue
        result = run(config)
        record = {"config": json.loads(text), "status": result.status, "error": result.error,
                  "summary": result.summary, "provenance": result.provenance, "history": result.history}
        path = out / f"{i}_{config.model_config().moe_path}.json"
        path.write_text(json.dumps(record, default=str, separators=(",", ":")))  # compact: records travel to the GPU machine (64 MiB)
        brief = {k: (result.status if k == "status" else result.summary.get(k)) for k in keys}
        print(json.dumps({"config": json.loads(text), **brief}, default=str), flush=True)
        if result.error:
            print(f"  error: {str(result.error)[:400]}", flush=True)


if __name__ == "__main__":
    main()
