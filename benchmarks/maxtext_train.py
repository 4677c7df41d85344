"""MaxText's own training loop (`maxtext.trainers.pre_train.train`, synthetic data) on a DeepSeek-style MoE model, its
expert GEMMs on MaxText's kernel or on turbo (`turbo_moe.integrations.maxtext.enable()`), one child process a run.

    PYTHONPATH=$PWD python benchmarks/maxtext_train.py --out DIR [--shape reduced] [--gemms maxtext,turbo]
        [--steps 20] [--set key=value ...]          # GPU, maxtext installed (benchmarks/maxtext_wheels.txt)
    PYTHONPATH=$PWD python benchmarks/maxtext_train.py --out /tmp/mt --shape smoke --steps 3   # CPU check
    ... --set ici_expert_parallelism=2             # expert parallelism (turbo: its EP body, column turbo_body)

Shapes: `reduced` is turbo_moe's `reduced` preset in MaxText's keys (DeepSeek decoder block, MLA, 64 routed experts
top-6 + 1 shared, d 1280, 16 layers of which 1 dense, vocabulary 32768, 8 x 2048 tokens a device); `smoke` a tiny
one. MaxText's dropless path (`sparse_matmul`, `ragged_dot`), dropless without capacity (`capacity_factor=-1`).
Each run's row: MaxText's per-step lines (seconds, tokens/s/device, TFLOP/s/device, loss), the median of the steps
after the first `--skip` (compiles), peak device memory, status; <DIR>/maxtext_train.csv and .json with provenance,
written as each run ends. A run that fails, runs out of memory or out of time is a row with its status.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import Recorder, error_text  # noqa: E402 (one writer of rows for the benchmarks)

from turbo_moe.provenance import TABLE_COLUMNS, package_version  # noqa: E402
from turbo_moe.provenance import collect as collect_provenance  # noqa: E402

SHAPES = {
    "reduced": dict(
        decoder_block="deepseek", attention_type="mla", base_emb_dim=1280, base_num_query_heads=16,
        base_num_kv_heads=16, base_mlp_dim=3584, base_moe_mlp_dim=512, base_num_decoder_layers=16,
        first_num_dense_layers=1, num_experts=64, num_experts_per_tok=6, shared_experts=1, routed_scaling_factor=2.5,
        routed_score_func="sigmoid", routed_bias=True, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, vocab_size=32768, mlp_activations=["silu", "linear"],
        per_device_batch_size=8, max_target_length=2048),
    "smoke": dict(  # the same keys at toy widths
        decoder_block="deepseek", attention_type="mla", base_emb_dim=64, base_num_query_heads=2, base_num_kv_heads=2,
        base_mlp_dim=128, base_moe_mlp_dim=32, base_num_decoder_layers=2, first_num_dense_layers=1, num_experts=4,
        num_experts_per_tok=2, shared_experts=1, routed_scaling_factor=2.5, routed_score_func="sigmoid",
        routed_bias=True, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        vocab_size=256, mlp_activations=["silu", "linear"], per_device_batch_size=1, max_target_length=32),
}
STEP = re.compile(r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+), Tokens/s/device: ([\d.]+),"
                  r".*? loss: ([\d.naif]+)")
RESULT_TAG = "MAXTEXT_TRAIN_PEAK "
FIELDS = [*TABLE_COLUMNS, "shape", "gemms", "steps", "status", "step_s", "tokens_per_s_device", "tflops_device",
          "final_loss", "peak_gib", "turbo_calls", "turbo_body", "turbo_stats", "error"]


def maxtext_args(shape: str, steps: int, overrides: list[str]) -> list[str]:
    import maxtext  # noqa: PLC0415 (optional: a row says where it does not import)
    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    keys = SHAPES[shape] | dict(dataset_type="synthetic", steps=steps, enable_checkpointing=False,
                                skip_jax_distributed_system=True, sparse_matmul=True, megablox=False,
                                use_tokamax_gmm=False, capacity_factor=-1.0)
    args = [f"{k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in keys.items()]
    return ["maxtext_train", base, f"run_name=bench_{shape}", f"base_output_directory={tempfile.mkdtemp()}",
            *args, *overrides]


def child(args) -> None:
    """In the child process: MaxText's train main, turbo switched on first if asked; then peak memory and calls."""
    import jax  # noqa: PLC0415
    from absl import app  # noqa: PLC0415
    from maxtext.trainers.pre_train import train  # noqa: PLC0415

    from turbo_moe.integrations import maxtext as turbo_maxtext  # noqa: PLC0415
    if args.gemms == "turbo":
        turbo_maxtext.enable()

    def main_then_report(argv):
        train.main(argv)
        stats = jax.devices()[0].memory_stats() or {}
        counts = turbo_maxtext.stats()
        calls = sum(v for k, v in counts.items() if k.startswith("turbo"))
        body = turbo_maxtext.body_summary(counts) if args.gemms == "turbo" else None
        print(RESULT_TAG + json.dumps({"peak_bytes": stats.get("peak_bytes_in_use"), "turbo_calls": calls,
                                       "body": body}), flush=True)

    app.run(main_then_report, argv=maxtext_args(args.shape, args.steps, args.set))  # absl's logging: the step lines


def run_one(args, gemms: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "--gemms", gemms, "--shape", args.shape, "--steps", str(args.steps),
           *[a for kv in args.set for a in ("--set", kv)]]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return dict(status="timeout", error=f"no result within {args.timeout_s:.0f} s (--timeout-s)")
    text = done.stdout + done.stderr
    steps = [m.groups() for m in STEP.finditer(text)]
    tail = [r for r in steps if int(r[0]) >= args.skip] or steps
    result = [json.loads(line[len(RESULT_TAG):]) for line in done.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if done.returncode or not steps or not result:
        oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
        lines = [ln for ln in text.splitlines() if "Error" in ln or "error" in ln] or text.splitlines()[-2:]
        return dict(status="oom" if oom else "failed", error=f"exit {done.returncode}: {' | '.join(lines[-2:])[-300:]}")
    peak = result[-1]["peak_bytes"]
    return dict(status="ok", step_s=statistics.median(float(r[1]) for r in tail),
                tokens_per_s_device=statistics.median(float(r[3]) for r in tail),
                tflops_device=statistics.median(float(r[2]) for r in tail), final_loss=float(steps[-1][4]),
                peak_gib=round(peak / 2**30, 2) if peak else None, turbo_calls=result[-1]["turbo_calls"],
                **(result[-1].get("body") or {}))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/maxtext_train", help="folder for the CSV and JSON")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="reduced")
    parser.add_argument("--gemms", default="maxtext,turbo", help="comma-separated: maxtext (its ragged_dot), turbo")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=5, help="steps left out of the medians (compilation)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a MaxText config key")
    parser.add_argument("--timeout-s", type=float, default=400.0, help="a run's time limit")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.gemms = args.gemms.split(",")[0]
        return child(args)
    gemms = args.gemms.split(",")
    if bad := set(gemms) - {"maxtext", "turbo"}:
        parser.error(f"--gemms: unknown {sorted(bad)} (expected maxtext, turbo)")
    if args.steps <= args.skip:
        parser.error(f"--steps ({args.steps}) must exceed --skip ({args.skip})")
    if bad := [kv for kv in args.set if "=" not in kv]:
        parser.error(f"--set: expected KEY=VALUE, got {bad}")
    prov = collect_provenance() | {"maxtext_version": package_version("maxtext"),
                                   "params": f"shape={args.shape} steps={args.steps} skip={args.skip} set={args.set}"}
    rec = Recorder(Path(args.out) / "maxtext_train", prov, FIELDS)
    for g in gemms:
        row = dict(shape=args.shape, gemms=g, steps=args.steps)
        try:
            rec.add(row | run_one(args, g))
        except Exception as e:  # noqa: BLE001 (a run that cannot start is a row)
            rec.add(row | dict(status="failed", error=error_text(e)))
    print(f"wrote {rec.csv}, {rec.json}")


if __name__ == "__main__":
    main()
