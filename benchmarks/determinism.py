"""Run-to-run determinism on the GPU: what `TrainConfig(deterministic=True)` costs, and XLA's crash it works around.

    python benchmarks/determinism.py train --out DIR [--model reduced] [--steps 60] [--repeats 2]
        [--variants default,deterministic] [--tag a]
    python benchmarks/determinism.py repro

`train`: each variant's run (`run(TrainConfig(...))`, synthetic tokens, no evaluation) `--repeats` times in this
process, variants alternating; one JSON record a run under DIR (config, summary, provenance, history, as
benchmarks/train_once.py writes them), then a table over every record in DIR (a second process with another `--tag`
adds to the comparison): TGS per variant, and whether the losses, gradient norms and final state digests of one
variant's runs are equal. Variants: `default`, `deterministic` (the field), `deterministic_cublas` (the field with
XLA's Triton GEMMs off, an experiment: the options are written into the record's `extra`).

`repro`: the minimal reproduction of XLA's crash with determinism required (docs/notes/determinism.md), each case in
its own process: one or two identical cuDNN attention layers (public `jax.nn.dot_product_attention`), the option per
program or in XLA_FLAGS, and the workaround (`turbo_moe.train.determinism.mark_attention_deterministic`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = {"default": None, "deterministic": {}, "deterministic_cublas": {"xla_gpu_enable_triton_gemm": False}}
REPRO_CASES = {  # name -> (layers, how determinism is required, marked)
    "one_layer_option": (1, "option", False),
    "two_layers_option": (2, "option", False),
    "two_layers_xla_flags": (2, "xla_flags", False),
    "two_layers_exclude_option": (2, "exclude_option", False),
    "two_layers_option_marked": (2, "option", True),
}


def train(args) -> None:
    from turbo_moe.train import TrainConfig, determinism, run, step

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base_options = dict(determinism.GPU_OPTIONS)
    for rep in range(args.repeats):
        for variant in args.variants:
            extra = VARIANTS[variant]
            options = {**base_options, **(extra or {})}
            if options != determinism.GPU_OPTIONS:  # the experiment's options: programs are rebuilt with them
                determinism.GPU_OPTIONS.clear()
                determinism.GPU_OPTIONS.update(options)
                step.build_program.cache_clear()
            config = {"model": args.model, "dataset": "synthetic", "steps": args.steps, "eval_batches": 0,
                      "progress": False, "seed": args.seed, "deterministic": extra is not None,
                      **({"per_device_batch": args.per_device_batch} if args.per_device_batch else {})}
            result = run(TrainConfig.from_dict(config))
            record = {"config": config, "status": result.status, "error": result.error, "summary": result.summary,
                      "provenance": result.provenance, "history": result.history,
                      "extra": {"variant": variant, "repeat": rep, "process": args.tag,
                                "xla_options": dict(determinism.GPU_OPTIONS) if extra is not None else {}}}
            path = out / f"{variant}_{args.tag}{rep}.json"
            path.write_text(json.dumps(record, default=str, separators=(",", ":")))
            print(json.dumps({"variant": variant, "repeat": rep, "status": result.status,
                              "tgs": result.summary.get("tgs"), "compile_time_s": result.summary.get("compile_time_s"),
                              "final_loss": result.summary.get("final_loss"),
                              "state_digest": result.summary.get("state_digest")}), flush=True)
            if result.error:
                print(f"  error: {str(result.error)[:600]}", flush=True)
    determinism.GPU_OPTIONS.clear()
    determinism.GPU_OPTIONS.update(base_options)
    print(table(out))


def table(out: Path) -> str:
    """Per variant over every record in `out`: TGS of each run, and whether the runs repeat bit for bit."""
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    by_variant: dict[str, list] = {}
    for r in records:
        by_variant.setdefault(r["extra"]["variant"], []).append(r)
    lines = ["variant                 runs  TGS (each)                     mean TGS  losses  grad_norms  digests"]
    means = {}
    for variant, runs in by_variant.items():
        ok = [r for r in runs if r["status"] == "ok"]
        tgs = [r["summary"]["tgs"] for r in ok]
        means[variant] = sum(tgs) / len(tgs) if tgs else float("nan")
        same = lambda key: len({json.dumps([row[key] for row in r["history"]]) for r in ok}) == 1
        digests = {r["summary"].get("state_digest") for r in ok}
        lines.append(f"{variant:22s}  {len(runs):4d}  {' '.join(f'{t:8.0f}' for t in tgs):30s} {means[variant]:8.0f}"
                     f"  {'equal' if same('loss') else 'DIFFER':6s}  {'equal' if same('grad_norm') else 'DIFFER':10s}"
                     f"  {'equal' if len(digests) == 1 and None not in digests else 'DIFFER' if None not in digests else '-'}")
    if "default" in means:
        lines += [f"{v} / default TGS: {m / means['default']:.4f}" for v, m in means.items() if v != "default"]
    return "\n".join(lines)


def repro_case(name: str) -> None:
    """One case of the reproduction, in this process (the parent sets XLA_FLAGS for the `xla_flags` case)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    layers, how, marked = REPRO_CASES[name]

    def loss(q, k, v):  # q, k, v (B, S, H, D); each layer's output is the next one's queries: identical calls
        for _ in range(layers):
            q = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(q.astype(jnp.float32) ** 2)

    options = {"option": {"xla_gpu_deterministic_ops": True},
               "exclude_option": {"xla_gpu_exclude_nondeterministic_ops": True}}.get(how)
    program = jax.jit(jax.grad(loss, (0, 1, 2)), compiler_options=options)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 1024, 8, 128)), jnp.bfloat16) for _ in range(3))
    lowered = program.lower(q, k, v)
    if marked:
        from turbo_moe.train.determinism import mark_attention_deterministic

        mark_attention_deterministic(lowered.compiler_ir("stablehlo"))
    compiled = lowered.compile()
    runs = [[np.asarray(g).tobytes() for g in compiled(q, k, v)] for _ in range(3)]
    print(f"ran; gradients {'repeat' if all(r == runs[0] for r in runs) else 'DIFFER'} over 3 runs")


def repro(args) -> None:
    if args.case:
        return repro_case(args.case)
    import jax

    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    for name, (_, how, _) in REPRO_CASES.items():
        env = dict(os.environ)
        if how == "xla_flags":
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
        proc = subprocess.run([sys.executable, __file__, "repro", "--case", name], env=env, capture_output=True,
                              text=True, timeout=300)
        text = (proc.stdout + proc.stderr).strip().splitlines()
        said = next((line for line in reversed(text) if "Error" in line or line.startswith("ran")), text[-1:] or "")
        print(f"{name:28s} exit {proc.returncode}: {str(said)[:300]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("train", help="TGS and repeatability of runs per variant")
    t.add_argument("--out", required=True, help="folder of the JSON records (added to, then tabulated)")
    t.add_argument("--model", default="reduced")
    t.add_argument("--steps", type=int, default=60)
    t.add_argument("--repeats", type=int, default=2)
    t.add_argument("--per-device-batch", type=int, default=None, help="default: TrainConfig's")
    t.add_argument("--seed", type=int, default=3)
    t.add_argument("--variants", type=lambda s: s.split(","), default=["default", "deterministic"])
    t.add_argument("--tag", default="a", help="names this process's records (a second process: another tag)")
    r = sub.add_parser("repro", help="the crash's reproduction and its workaround, a process per case")
    r.add_argument("--case", choices=sorted(REPRO_CASES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode == "train":
        unknown = [v for v in args.variants if v not in VARIANTS]
        if unknown:
            ap.error(f"--variants: unknown {unknown}; known: {sorted(VARIANTS)}")
        train(args)
    else:
        repro(args)


if __name__ == "__main__":
    main()
