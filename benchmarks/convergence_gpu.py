"""Issue 13, part 3: a convergence comparison that can resolve a drop penalty (turbo vs dense_cf).

Trains one run per (seed, path) one after another in this process with `turbo_moe.train.run`: the
dropless turbo path and dense_cf at each capacity factor, every seed, same data order per seed, the
router recipe of the model preset as it is at run time. Held-out loss is evaluated every
--eval-every steps and at the end on one fixed eval set (the first --eval-batches batches of the
validation split; the same for every run). Runs go seed-major (all paths of seed 0, then seed 1, ...)
so a budget cut leaves whole seeds.

Output (--out), written as each run finishes, so an interrupted call keeps the finished runs:
  runs/<label>.json   one record per run: config, router settings, status, summary, provenance, eval
                      points (step, tokens, eval_loss, train loss, dropped fraction, load) and per-step rows
  evals.csv           one row per (run, eval point)
  summary.md          per-path final eval loss over seeds and the penalty (dense_cf - turbo) with its
                      t-intervals (turbo_moe.experiments.convergence), refreshed after every run
  convergence.png     eval loss vs tokens with t-bands, and the penalty with its Welch band (--figure)
Resumable: runs whose record says "ok" are skipped. --max-seconds: no run starts that would not end
before that many seconds after start (estimated from the runs of this call: a path run before takes its
wall time less its compile time; a new path 1.6x the slowest run so far, as it compiles afresh and
dense_cf runs up to 2x slower than turbo).

GPU (one H100, ~8-9 min with compilation; see experiments/NOTES.md "Convergence run"):
  source benchmarks/gpu_env.sh && TURBO_MOE_GIT_COMMIT=<commit> python benchmarks/convergence_gpu.py \\
      --out $OUT/convergence --max-seconds 500
Data: the `pd_english` cache must be prepared first (here, with the network):
  TURBO_MOE_DATA_DIR=build/data_cache python benchmarks/convergence_gpu.py --prepare-data
CPU smoke test (tiny model, 12 steps, < 2 minutes once the data are prepared):
  TURBO_MOE_DATA_DIR=build/data_cache python benchmarks/convergence_gpu.py --smoke --out /tmp/conv_smoke
Analysis only (e.g. after copying a GPU call's records into the repository):
  python benchmarks/convergence_gpu.py --analyze-only --out experiments/results/convergence_h100 \\
      --figure experiments/figures/convergence_h100.png
Your own corpus: --dataset /path/to/c4/en (a C4-style .json.gz/.jsonl.gz file or directory).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _records import parse_paths  # noqa: E402

SMOKE_SIZES = dict(  # a tiny `reduced`-like model: same routing proportions, CPU-sized
    d_model=64, n_layers=3, n_dense_layers=1, dense_ffn_dim=128, moe_ffn_dim=16, n_heads=2,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    max_seq_len=64, remat_policy="none", dtype="float32",
)
ROUTER_FIELDS = ("head_bias", "zero_init_out_proj", "router_bias_update", "router_lr_scale", "router_bias_rate",
                 "router_init_std", "balance_loss_weight", "n_experts", "top_k", "n_groups", "topk_groups",
                 "routed_scaling_factor",
                 "router_center_causal", "router_seq_load_penalty", "router_seq_load_chunk")
NEW_PATH_FACTOR = 1.6


def run_tag(path: str, cf: float, seed: int) -> str:
    return (path if path != "dense_cf" else f"dense_cf_cf{cf:g}") + f"_seed{seed}"


def eval_points(history: list[dict], tokens_per_step: int) -> list[dict]:
    points = []
    for h in history:
        if isinstance(h.get("eval_loss"), float) and math.isfinite(h["eval_loss"]):
            done = h["step"] + 1
            points.append({"step": done, "tokens": done * tokens_per_step, "eval_loss": h["eval_loss"],
                           "loss": h["loss"], "ce_loss": h["ce_loss"], "dropped_fraction": h["dropped_fraction"],
                           "load_max_over_mean": h["load_max_over_mean"]})
    return points


def step_rows(history: list[dict]) -> dict[str, list]:
    keys = ("step", "loss", "ce_loss", "dropped_fraction", "load_max_over_mean", "load_max_over_mean_worst_layer",
            "step_time_s", "lr")
    return {k: [h.get(k) for h in history] for k in keys}


def estimate_seconds(path_key: tuple[str, float], walls: dict[tuple[str, float], tuple[float, float]]) -> float:
    """Expected wall time of the next run of ``path_key`` from this call's finished runs, given as
    (wall s, compile s) per path (0: no basis). A path run before reuses its compiled programs (the
    persistent cache): its wall less its compile time; a new path: 1.6x the slowest wall so far."""
    if path_key in walls:
        wall, compile_s = walls[path_key]
        return wall - (compile_s if math.isfinite(compile_s) else 0.0)
    return NEW_PATH_FACTOR * max(w for w, _ in walls.values()) if walls else 0.0


def train_one(args, overrides: dict, path: str, cf: float, seed: int) -> dict:
    from _provenance import provenance
    from turbo_moe.train import TrainConfig, run

    run_overrides = dict(overrides, moe_path=path)
    if path == "dense_cf":
        run_overrides["capacity_factor"] = cf
    tc = TrainConfig(model=args.model, model_overrides=run_overrides, dataset=args.dataset,
                     per_device_batch=args.batch, seq_len=args.seq, steps=args.steps, learning_rate=args.lr,
                     warmup_steps=args.warmup, eval_every=args.eval_every, eval_batches=args.eval_batches,
                     seed=seed, progress=False)
    model_cfg = tc.model_config().to_dict()
    t0 = time.time()
    result = run(tc)
    wall = time.time() - t0
    tokens_per_step = int(result.summary.get("tokens_per_step") or args.batch * args.seq)
    keep = ("tgs", "step_time_s", "compile_time_s", "phase_seconds", "final_loss", "final_eval_loss",
            "dropped_fraction_mean", "load_max_over_mean_mean", "peak_memory_bytes", "params_total",
            "params_active", "steps_done", "tokens_per_step", "mfu")
    return {
        "label": run_tag(path, cf, seed), "path": path, "capacity_factor": cf if path == "dense_cf" else None,
        "seed": seed, "status": result.status, "error": result.error, "wall_s": round(wall, 1),
        "tokens_per_step": tokens_per_step, "train_config": tc.to_dict(),
        "router": {k: model_cfg.get(k) for k in ROUTER_FIELDS},
        "summary": {k: result.summary.get(k) for k in keep},
        "evals": eval_points(result.history, tokens_per_step), "steps": step_rows(result.history),
        "final_expert_load": result.expert_load,
        "provenance": {**provenance(), "run": result.provenance},
    }


def write_outputs(out: Path, figure: Path | None) -> str:
    """evals.csv, summary.md and the figure from every record under ``out``; returns the summary text."""
    from turbo_moe.experiments import convergence as C

    records = C.load_records(out)
    rows = [{"label": r["label"], "path": C.run_label(r), "seed": r["seed"], **e}
            for r in records if r["status"] == "ok" for e in r["evals"]]
    if rows:
        tmp = out / "evals.csv.partial"
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(out / "evals.csv")
    summary = C.summarize(records)
    text = C.format_summary(summary)
    prov = next((r["provenance"] for r in records), {})
    footer = (f"{prov.get('device_kind', '?')} | jax {prov.get('jax_version', '?')} | commit "
              f"{prov.get('git_commit', '?')} | {prov.get('date', '?')} | benchmarks/convergence_gpu.py")
    dataset = next((r["train_config"]["dataset"] for r in records), "?")
    (out / "summary.md").write_text(f"dataset {dataset}; {footer}\n\n{text}\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    if figure is not None and rows:
        try:
            C.plot_convergence(records, figure, footer=footer)
        except ImportError as e:  # a GPU machine without matplotlib: draw it later with --analyze-only
            print(f"figure not drawn ({e}); the records are complete", flush=True)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output directory (created); runs/ inside it")
    p.add_argument("--paths", default="turbo,dense_cf:1.0,dense_cf:1.25", help="comma list of path[:capacity_factor]")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--model", default="reduced")
    p.add_argument("--dataset", default="pd_english", help="a named dataset or a path (C4-style jsonl.gz, txt, ...)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--override", action="append", default=[], help="ModelConfig field=value (JSON value)")
    p.add_argument("--max-seconds", type=float, default=math.inf, help="start no run that would end later")
    p.add_argument("--figure", default=None, help="figure path (default: <out>/convergence.png)")
    p.add_argument("--smoke", action="store_true", help="tiny model, 12 steps, seq 64, batch 2 (CPU check)")
    p.add_argument("--prepare-data", action="store_true", help="build the dataset's token cache and exit")
    p.add_argument("--analyze-only", action="store_true", help="rewrite evals.csv/summary/figure from --out")
    args = p.parse_args(argv)
    start = time.time()

    if args.prepare_data:
        from turbo_moe.data import load_dataset

        ds = load_dataset(args.dataset, seq_len=args.seq, vocab_size=args.vocab)
        print(json.dumps(ds.info, indent=1))
        print(f"prepared: {ds.info.get('prepared', ds.info.get('cache_dir'))}; "
              f"{len(ds.train)} train / {len(ds.val)} validation sequences of {args.seq}")
        return 0
    if not args.out:
        p.error("--out is required")
    out = Path(args.out)
    figure = Path(args.figure) if args.figure else out / "convergence.png"
    if args.analyze_only:
        print(write_outputs(out, figure))
        return 0

    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jax_compilation_cache")
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    overrides: dict = {"vocab_size": args.vocab}
    if args.smoke:
        overrides.update(SMOKE_SIZES)
        args.seq, args.batch, args.steps, args.warmup, args.eval_every, args.eval_batches = 64, 2, 12, 2, 4, 2
    for item in args.override:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    (out / "runs").mkdir(parents=True, exist_ok=True)
    paths = parse_paths(args.paths)
    seeds = [int(s) for s in args.seeds.split(",")]
    walls: dict[tuple[str, float], tuple[float, float]] = {}
    failed = 0
    for seed in seeds:
        for path, cf in paths:
            label = run_tag(path, cf, seed)
            record_file = out / "runs" / f"{label}.json"
            if record_file.exists() and json.loads(record_file.read_text()).get("status") == "ok":
                print(f"[{label}] done before: skipped", flush=True)
                continue
            elapsed, need = time.time() - start, estimate_seconds((path, cf), walls)
            if elapsed + need > args.max_seconds:
                print(f"[{label}] not started: {elapsed:.0f}s elapsed + ~{need:.0f}s expected > --max-seconds "
                      f"{args.max_seconds:g} (a later call resumes it)", flush=True)
                continue
            record = train_one(args, overrides, path, cf, seed)
            walls[(path, cf)] = (record["wall_s"], float(record["summary"].get("compile_time_s") or 0.0))
            tmp = record_file.with_suffix(".partial")
            tmp.write_text(json.dumps(record, indent=1, default=str))
            tmp.replace(record_file)
            failed += record["status"] != "ok"
            final = record["evals"][-1]["eval_loss"] if record["evals"] else math.nan
            print(f"[{label}] {record['status']} in {record['wall_s']:.0f}s (compile "
                  f"{record['summary']['compile_time_s']:.0f}s, tgs {record['summary']['tgs']:.0f}): final eval "
                  f"loss {final:.4f}, dropped {record['summary']['dropped_fraction_mean']:.3f}", flush=True)
            if record["error"]:
                print(str(record["error"])[:2000], flush=True)
            write_outputs(out, figure)
    print(write_outputs(out, figure))
    print(f"total {time.time() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
