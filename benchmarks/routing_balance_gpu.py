"""Issue 13 target check: is `reduced` routing balanced on real text, and does dense_cf stop dropping?

Trains `reduced` (vocab 8192) on Shakespeare, batch 4 x seq 1024, 400 steps (lr 1e-3, warm-up 40, the
`gpu_paths_x_steps` recipe), once with the dropless turbo path and once with dense_cf at cf 1.25, via
`turbo_moe.train.run`. Records per step and per MoE layer (MTP block included) max/mean expert load and
the dropped fraction, and checks the two targets:

  T1  max/mean expert load <= 2.0 in every MoE layer (MTP included) at every step from step 100 on
  T2  dense_cf at cf 1.25 drops <= 10% of token copies, averaged over steps 50-400

Output (written as each run finishes, so an interrupted call keeps the finished runs), in --out:
  steps.csv      one row per (run, step): path, cf, step, loss, ce, dropped (mean over layers),
                 load_L<i> (max/mean per router layer, MTP last), dropped_L<i> (when the loop reports them)
  runs.json      provenance (device, jax, git commit, date, parameters) + per-run summary + target checks

Each run is one compile (~45 s on an H100) plus ~40-60 s of training: 5 runs fit a 10-minute call.
The issue-13 check (2026-11-23; candidates ranked by the CPU probe, experiments/NOTES.md), one H100/H200,
runs in order of importance and --budget-s leaves out the tail rather than the call's time limit cutting
a run:
  TURBO_MOE_GIT_COMMIT=$(git rev-parse HEAD) timeout 590 python benchmarks/routing_balance_gpu.py \
      --out experiments/results/routing_balance_h100_2 --budget-s 500 \
      --runs lrs0.02_prop/dense_cf:1.25,lrs0.02_prop/turbo,prop/dense_cf:1.25,bal1e-2_bias1e-2/dense_cf:1.25,preset/dense_cf:1.25
(T1 reads the routed load, before any drop, so the dense_cf runs check it too.)
CPU smoke test (tiny sizes, minutes):
  python benchmarks/routing_balance_gpu.py --smoke --out /tmp/routing_balance_smoke --runs lrs_prop/dense_cf:1.25
Recipes (RECIPES below): --recipes a,b x --paths p,q (every pair), or --runs recipe/path[:cf],... in order.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _records import parse_paths  # noqa: E402

# Router recipes: ModelConfig overrides on top of DeepSeek-V3's router settings (_DEEPSEEK: what the
# `reduced` preset had before issue 13 part 6: bias rate 1e-3 sign rule, no head bias, random out
# projections, gate at the full lr; balance weight 1e-4, router init = init_std 0.006), so each name keeps
# the meaning it had in the committed records. "preset": the preset as it is at run time (parts 6-7: the
# recipe "zero_unigram_lrs_prop"; since part 8 "zero_unigram_lrs_prop_causal"); "deepseek": _DEEPSEEK itself (the "preset" of the older records).
# "bias1e-2": bias rate 1e-2 throughout (needs no change in turbo_moe.train.step). "sched": rate 1e-2
# decaying (half-cosine) to 1e-3 over 400 steps -- only effective once turbo_moe.train.step calls
# turbo_moe.model.router.bias_rate_at (the script records whether it does). "fanin": "sched" plus the
# router kernel initialised with std d_model ** -0.5 (MaxText's gate init). "bal1e-2": balance loss
# weight 1e-2 (MaxText / Megatron aux-loss default) with the preset's bias rate.
# "lrs": the gate at a tenth of the learning rate (router_lr_scale 0.1); "lrs_bias1e-2" adds bias rate
# 1e-2. "bal1e-1": balance loss weight 1e-1; "bal1e-2_bias1e-2": balance 1e-2 and bias rate 1e-2.
# "prop": proportional bias update (router_bias_update) at rate 1e-2. "lrs_prop": lrs + prop;
# "lrs0.02_prop": the same with router_lr_scale 0.02 (at d_model 1280 AdamW moves each gate logit up to
# ~5x further per step than at the CPU probe's 256: 0.02 here ~ 0.1 there).
# "center": router centering (router_center_ema 0.3: the running-mean direction of the router input
# projected out of every token before top-k; experiments/NOTES.md, issue 13 part 5) on the preset;
# "center_lrs_prop": the same on top of lrs_prop.
# "unigram*": the output head's bias starts at the data's log unigram frequencies (head_bias "unigram":
# the model does not learn them as a shared direction in the warm-up, NOTES issue 13 part 6), on the
# preset, on "prop" and on "lrs_prop". "zero_*": also zero_init_out_proj (every block starts as the identity:
# no shared direction from depth at init, part 6); "center_zero_*" adds router centering 0.3.
_DEEPSEEK = {"head_bias": "none", "zero_init_out_proj": False, "router_lr_scale": 1.0, "router_bias_update": "sign",
             "router_bias_rate": 1e-3, "router_center_causal": False}
_LRS_PROP = {"router_lr_scale": 0.1, "router_bias_update": "proportional", "router_bias_rate": 1e-2}
_ZERO_UNIGRAM_LRS_PROP = {"zero_init_out_proj": True, "head_bias": "unigram", **_LRS_PROP}
_CHANGES = {
    "deepseek": {},
    "bias1e-2": {"router_bias_rate": 1e-2},
    "sched": {"router_bias_rate_start": 1e-2, "router_bias_rate_decay_steps": 400},
    "fanin": {"router_bias_rate_start": 1e-2, "router_bias_rate_decay_steps": 400, "router_init_std": "fanin"},
    "bal1e-2": {"balance_loss_weight": 1e-2},
    "bal1e-1": {"balance_loss_weight": 1e-1},
    "bal1e-2_bias1e-2": {"balance_loss_weight": 1e-2, "router_bias_rate": 1e-2},
    "lrs": {"router_lr_scale": 0.1},
    "lrs_bias1e-2": {"router_lr_scale": 0.1, "router_bias_rate": 1e-2},
    "prop": {"router_bias_update": "proportional", "router_bias_rate": 1e-2},
    "lrs_prop": _LRS_PROP,
    "lrs0.02_prop": {"router_lr_scale": 0.02, "router_bias_update": "proportional", "router_bias_rate": 1e-2},
    "center": {"router_center_ema": 0.3},
    "center_lrs_prop": {"router_center_ema": 0.3, **_LRS_PROP},
    "unigram": {"head_bias": "unigram"},
    "unigram_prop": {"head_bias": "unigram", "router_bias_update": "proportional", "router_bias_rate": 1e-2},
    "unigram_lrs_prop": {"head_bias": "unigram", **_LRS_PROP},
    "zero_unigram_lrs_prop": {"zero_init_out_proj": True, "head_bias": "unigram", **_LRS_PROP},
    "zero_unigram_lrs0.02_prop": {"zero_init_out_proj": True, "head_bias": "unigram", **_LRS_PROP,
                                  "router_lr_scale": 0.02},
    "center_zero_unigram_lrs_prop": {"router_center_ema": 0.3, "zero_init_out_proj": True, "head_bias": "unigram",
                                     **_LRS_PROP},
    "zero_unigram_prop": {"zero_init_out_proj": True, "head_bias": "unigram", "router_bias_update": "proportional",
                          "router_bias_rate": 1e-2},
    # on the issue-13 part 6 preset: a faster proportional bias (2e-2), the same with a fast start decaying
    # (3e-2 -> 1e-2 over 200 steps), and 10x DeepSeek-V3's sequence-wise balance loss (1e-3)
    "zero_unigram_lrs_prop2e-2": {**_ZERO_UNIGRAM_LRS_PROP, "router_bias_rate": 2e-2},
    "zero_unigram_lrs_prop_sched": {**_ZERO_UNIGRAM_LRS_PROP, "router_bias_rate_start": 3e-2,
                                    "router_bias_rate_decay_steps": 200},
    "zero_unigram_lrs_prop_bal1e-3": {**_ZERO_UNIGRAM_LRS_PROP, "balance_loss_weight": 1e-3},
    # for runs at a lower peak lr (--lr 3e-4 / 5e-4) with the gate kept at the preset's 1e-4
    "zero_unigram_lrs0.33_prop": {**_ZERO_UNIGRAM_LRS_PROP, "router_lr_scale": 1 / 3},
    "zero_unigram_lrs0.2_prop": {**_ZERO_UNIGRAM_LRS_PROP, "router_lr_scale": 0.2},
    # token embeddings at init std 1.0 / 0.25 instead of d_model ** -0.5 (0.028): a residual stream that the
    # blocks' growing outputs do not swamp in the warm-up ("Spike No More", Takase et al. 2023: small
    # embeddings in pre-LN models make loss spikes); a slower proportional bias (5e-3)
    "zero_unigram_lrs_prop_emb1": {**_ZERO_UNIGRAM_LRS_PROP, "embedding_init_std": 1.0},
    "zero_unigram_lrs_prop_emb0.25": {**_ZERO_UNIGRAM_LRS_PROP, "embedding_init_std": 0.25},
    "zero_unigram_lrs_prop5e-3": {**_ZERO_UNIGRAM_LRS_PROP, "router_bias_rate": 5e-3},
    # causal sequence centering of the selection (router_center_causal) on the preset
    "zero_unigram_lrs_prop_causal": {**_ZERO_UNIGRAM_LRS_PROP, "router_center_causal": True},
    # with the shared levels out of the choice, the reason for a slow gate is gone: gate at the full lr / 0.3;
    # and a faster proportional bias (2e-2) now that the per-batch floor is lower
    "zero_unigram_prop_causal": {**_ZERO_UNIGRAM_LRS_PROP, "router_lr_scale": 1.0, "router_center_causal": True},
    "zero_unigram_lrs0.3_prop_causal": {**_ZERO_UNIGRAM_LRS_PROP, "router_lr_scale": 0.3, "router_center_causal": True},
    "zero_unigram_lrs_prop2e-2_causal": {**_ZERO_UNIGRAM_LRS_PROP, "router_bias_rate": 2e-2, "router_center_causal": True},
    # with centering, steps over 2.0 fell with the gate's lr (1.0: 88, 0.3: 32, 0.1: 8): a slower gate still
    "zero_unigram_lrs0.03_prop_causal": {**_ZERO_UNIGRAM_LRS_PROP, "router_lr_scale": 0.03, "router_center_causal": True},
    "zero_unigram_lrs0.01_prop_causal": {**_ZERO_UNIGRAM_LRS_PROP, "router_lr_scale": 0.01, "router_center_causal": True},
    # part 10, on the causal preset: DeepSeek-V3's sequence-wise balance loss at 10x / 100x its weight (it is the
    # gradient-side tool against one sequence sending most tokens to a few experts, the over-2.0 steps' pattern);
    # no group limit (all 8 groups: is group-limited selection part of the tail?); a fast bias start (3e-2
    # decaying to 1e-2 over 200 steps: a quicker recovery from the warm-up peak, where most over-2.0 steps sit)
    "causal_bal1e-3": {**_ZERO_UNIGRAM_LRS_PROP, "router_center_causal": True, "balance_loss_weight": 1e-3},
    "causal_bal1e-2": {**_ZERO_UNIGRAM_LRS_PROP, "router_center_causal": True, "balance_loss_weight": 1e-2},
    "causal_nogroups": {**_ZERO_UNIGRAM_LRS_PROP, "router_center_causal": True, "topk_groups": 8},
    "causal_sched": {**_ZERO_UNIGRAM_LRS_PROP, "router_center_causal": True, "router_bias_rate_start": 3e-2,
                     "router_bias_rate_decay_steps": 200},
    "causal_bal1e-2_sched": {**_ZERO_UNIGRAM_LRS_PROP, "router_center_causal": True, "balance_loss_weight": 1e-2,
                             "router_bias_rate_start": 3e-2, "router_bias_rate_decay_steps": 200},
    # the causal sequence load penalty (router_seq_load_penalty) at three weights, in chunks of 64 tokens (pinned:
    # the field's default became 128 after call 43, whose records these names describe)
    **{f"causal_slp{w:g}": {**_ZERO_UNIGRAM_LRS_PROP, "router_center_causal": True, "router_seq_load_penalty": w,
                            "router_seq_load_chunk": 64} for w in (0.03, 0.1, 0.3)},
    **{f"causal_slp0.1_c{c}": {**_ZERO_UNIGRAM_LRS_PROP, "router_center_causal": True, "router_seq_load_penalty": 0.1,
                               "router_seq_load_chunk": c} for c in (128, 256)},
}
RECIPES = {"preset": {}, **{name: {**_DEEPSEEK, **changes} for name, changes in _CHANGES.items()}}


def step_uses_bias_schedule() -> bool:
    """Whether the training step takes its bias rate from router.bias_rate_at (so "sched" applies)."""
    import inspect

    from turbo_moe.train import step

    return "bias_rate_at" in inspect.getsource(step)


SMOKE_SIZES = dict(  # a tiny `reduced`-like model: same routing proportions, CPU-sized
    d_model=64, n_layers=3, n_dense_layers=1, dense_ffn_dim=128, moe_ffn_dim=16, n_heads=2,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    max_seq_len=64, remat_policy="none", dtype="float32",
)


def step_rows(label: str, path: str, cf: float, history: list[dict]) -> list[dict]:
    rows = []
    for h in history:
        row = {"run": label, "path": path, "cf": cf, "step": h["step"], "loss": h["loss"], "ce": h["ce_loss"],
               "dropped": h["dropped_fraction"], "step_time_s": h.get("step_time_s", math.nan)}
        for i, ratio in enumerate(h.get("load_max_over_mean_per_layer", [])):
            row[f"load_L{i}"] = ratio
        for i, frac in enumerate(h.get("dropped_fraction_per_layer", []) or []):
            row[f"dropped_L{i}"] = frac
        rows.append(row)
    return rows


def check_targets(rows: list[dict], path: str, balanced_from: int, drop_window: tuple[int, int],
                  max_load: float, max_drop: float) -> dict:
    """T1 (every run): worst per-layer max/mean load over steps >= balanced_from; T2 (dense_cf only):
    mean dropped fraction over steps in drop_window."""
    load_cols = sorted({k for r in rows for k in r if k.startswith("load_L")}, key=lambda k: int(k[6:]))
    late = [r for r in rows if r["step"] >= balanced_from]
    worst = [max(r[c] for c in load_cols) for r in late] if load_cols else []
    per_layer_worst = {c: max(r[c] for r in late) for c in load_cols} if late else {}
    out = {
        "T1_worst_load_after": max(worst) if worst else math.nan,
        "T1_steps_checked": len(late),
        "T1_steps_over": int(sum(w > max_load for w in worst)),
        "T1_worst_load_per_layer": per_layer_worst,
        "T1_pass": bool(worst) and max(worst) <= max_load,
        "first_step_always_balanced": _first_balanced_step(rows, load_cols, max_load),
    }
    lo, hi = drop_window
    window = [r["dropped"] for r in rows if lo <= r["step"] <= hi]
    if path == "dense_cf":
        mean_drop = float(np.mean(window)) if window else math.nan
        out.update(T2_mean_dropped=mean_drop, T2_steps=len(window),
                   T2_pass=bool(window) and mean_drop <= max_drop)
    return out


def _first_balanced_step(rows, load_cols, max_load):
    """First step from which every later step has every layer's max/mean load <= max_load (None: never)."""
    first = None
    for r in rows:
        if max(r[c] for c in load_cols) > max_load:
            first = None
        elif first is None:
            first = r["step"]
    return first


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--paths", default="turbo,dense_cf:1.25", help="comma list of path[:capacity_factor]")
    p.add_argument("--model", default="reduced")
    p.add_argument("--dataset", default="shakespeare")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipes", default="bias1e-2", help=f"comma list of {sorted(RECIPES)}")
    p.add_argument("--runs", default=None,
                   help="explicit runs in this order, comma list of recipe/path[:cf] (e.g. "
                        "'lrs/dense_cf:1.25,lrs/turbo,preset/dense_cf:1.25'); overrides --recipes x --paths")
    p.add_argument("--override", action="append", default=[], help="ModelConfig field=value (JSON value)")
    p.add_argument("--budget-s", type=float, default=0,
                   help="start no run that would end past this many seconds, judged by the longest run so far "
                        "(0: no limit); the runs left out are listed in runs.json")
    p.add_argument("--balanced-from", type=int, default=100)
    p.add_argument("--drop-window", type=int, nargs=2, default=(50, 400))
    p.add_argument("--smoke", action="store_true", help="tiny model, 24 steps, seq 64, batch 2 (CPU check)")
    args = p.parse_args(argv)

    import jax
    from turbo_moe.provenance import collect as collect_provenance
    from turbo_moe.train import TrainConfig, run

    overrides: dict = {"vocab_size": args.vocab}
    if args.smoke:
        overrides.update(SMOKE_SIZES, vocab_size=512)
        args.seq, args.batch, args.steps, args.warmup = 64, 2, 24, 4
        args.balanced_from, args.drop_window = 12, (6, 24)
    if args.runs:
        runs = []
        for item in args.runs.split(","):
            recipe, _, path = item.strip().partition("/")
            if not path:
                p.error(f"--runs: {item!r} is not recipe/path[:cf]")
            runs += [(recipe, name, cf) for name, cf in parse_paths(path)]
        recipes = list(dict.fromkeys(r for r, _, _ in runs))
    else:
        recipes = [r.strip() for r in args.recipes.split(",")]
        runs = [(recipe, path, cf) for recipe in recipes for path, cf in parse_paths(args.paths)]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        p.error(f"unknown recipe(s) {unknown}; known: {sorted(RECIPES)}")
    for item in args.override:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / "steps.csv", out / "runs.json"
    record = {
        "script": "benchmarks/routing_balance_gpu.py", "argv": sys.argv[1:], "parameters": vars(args) | {
            "drop_window": list(args.drop_window)},
        "model_overrides": overrides, "recipes": {r: RECIPES[r] for r in recipes},
        "step_uses_bias_schedule": step_uses_bias_schedule(), **collect_provenance(),
        "targets": {"T1": f"max/mean load <= 2.0 in every MoE layer (MTP incl.) from step {args.balanced_from}",
                    "T2": f"dense_cf mean dropped fraction over steps {args.drop_window[0]}-"
                          f"{args.drop_window[1]} <= 0.10"},
        "runs": [],
    }
    all_rows: list[dict] = []
    from turbo_moe.model import get_config

    started, longest = time.time(), 0.0
    for recipe, path, cf in runs:
        label = f"{recipe}/" + (path if path != "dense_cf" else f"dense_cf_cf{cf:g}")
        if args.budget_s and time.time() - started + longest > args.budget_s:
            record.setdefault("not_run_budget", []).append(label)
            json_path.write_text(json.dumps(record, indent=1, default=str))
            print(f"[{label}] not started: --budget-s {args.budget_s:g} would be exceeded", flush=True)
            continue
        run_overrides = dict(overrides, moe_path=path)
        for key, value in RECIPES[recipe].items():
            if value == "fanin":
                value = get_config(args.model, **overrides).d_model ** -0.5
            run_overrides[key] = value
        if path == "dense_cf":
            run_overrides["capacity_factor"] = cf
        tc = TrainConfig(model=args.model, model_overrides=run_overrides, dataset=args.dataset,
                         per_device_batch=args.batch, seq_len=args.seq, steps=args.steps,
                         learning_rate=args.lr, warmup_steps=args.warmup, eval_batches=0, eval_every=0,
                         seed=args.seed, progress=False)
        t0 = time.time()
        result = run(tc)
        wall = time.time() - t0
        longest = max(longest, wall)
        rows = step_rows(label, path, cf, result.history)
        for row in rows:
            row["recipe"] = recipe
        all_rows.extend(rows)
        check = check_targets(rows, path, args.balanced_from, tuple(args.drop_window), 2.0, 0.10)
        record["runs"].append({
            "label": label, "recipe": recipe, "model_overrides": run_overrides, "path": path, "capacity_factor": cf, "status": result.status, "error": result.error,
            "wall_s": round(wall, 1), "targets": check,
            "summary": {k: result.summary.get(k) for k in (
                "tgs", "step_time_s", "final_loss", "dropped_fraction_mean", "load_max_over_mean_mean",
                "compile_time_s", "phase_seconds", "steps_done", "peak_memory_bytes")},
            "final_expert_load": result.expert_load, "provenance": result.provenance,
        })
        _write_csv(csv_path, all_rows)
        json_path.write_text(json.dumps(record, indent=1, default=str))
        print(f"[{label}] status {result.status} in {wall:.0f}s; written {csv_path} and {json_path}", flush=True)
        if result.error:
            print(result.error[:2000], flush=True)

    print()
    print(f"{'run':<28}{'status':<8}{'worst load >= ' + str(args.balanced_from):>20}{'steps over 2':>14}"
          f"{'balanced from':>15}{'dropped ' + '-'.join(map(str, args.drop_window)):>16}  T1    T2")
    for r in record["runs"]:
        t = r["targets"]
        drop = t.get("T2_mean_dropped")
        print(f"{r['label']:<28}{r['status']:<8}{t['T1_worst_load_after']:>20.2f}{t['T1_steps_over']:>14}"
              f"{str(t['first_step_always_balanced']):>15}{(f'{drop:.3f}' if drop is not None else '-'):>16}  "
              f"{'pass' if t['T1_pass'] else 'FAIL':<6}{('pass' if t.get('T2_pass') else 'FAIL') if drop is not None else '-'}")
        print("    worst load per layer (MTP last): " + " ".join(
            f"{v:.2f}" for v in t["T1_worst_load_per_layer"].values()))
    return 0 if all(r["status"] == "ok" for r in record["runs"]) else 1


def _write_csv(path: Path, rows: list[dict]) -> None:
    fields: list[str] = []
    for r in rows:
        fields.extend(k for k in r if k not in fields)
    tmp = path.with_suffix(".csv.partial")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
