"""GPU check of the `pallas` MoE path (Hopper): correctness against float32, then one MoE layer's fwd+bwd time.

    python benchmarks/pallas_path_check.py --out experiments/runs/pallas_check

1. `turbo_moe.ops.pallas_gemm.pallas_grouped_gemm` (bf16) forward and both gradients against
   `jax.lax.ragged_dot` in float32, on fresh random inputs: empty groups, sizes not multiples of 8,
   skewed routing, rows past the groups, dims that need padding, and the `reduced` expert shapes.
2. The whole path (`moe_path_fn("pallas")`, bf16) against the `ragged` path in float32.
3. fwd+bwd time of one layer's routed experts for turbo / pallas / ragged at the `reduced` expert shapes
   (E=64, D=1280, F=512, top-6), median of --reps. Prints everything and writes <out>/pallas_path_check.json.
Exit status 1 when a check fails (the timings still run and are written).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from _provenance import provenance
from turbo_moe.shapes import REDUCED

GEMM_CASES = [  # (name, M, K, N, G, routing)
    ("odd sizes + empty groups", 1000, 256, 128, 8, "random"),
    ("padding K=200, N=72", 777, 200, 72, 5, "random"),
    ("skewed: one group takes 90%", 4096, 512, 256, 16, "skewed"),
    ("rows past the groups", 640, 128, 128, 4, "short"),
    ("reduced gate+up", 8192, REDUCED.d_model, 2 * REDUCED.moe_ffn_dim, REDUCED.n_experts, "random"),
    ("reduced down", 8192, REDUCED.moe_ffn_dim, REDUCED.d_model, REDUCED.n_experts, "skewed"),
]
TOLERANCE = 2e-2  # relative Frobenius error of bf16 inputs/outputs with float32 accumulation
LAYER = dict(d=REDUCED.d_model, f=REDUCED.moe_ffn_dim, e=REDUCED.n_experts, k=REDUCED.top_k)


def group_sizes(rng, m: int, g: int, kind: str) -> np.ndarray:
    if kind == "skewed":
        p = np.full(g, 0.1 / (g - 1)); p[g // 2] = 0.9
    else:
        p = rng.dirichlet(np.ones(g) * 0.5)
    sizes = rng.multinomial(m if kind != "short" else m // 2 + 3, p).astype(np.int32)
    sizes[rng.random(g) < 0.25] = 0  # empty groups (the sum may drop below M)
    return sizes


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.inf if not np.all(np.isfinite(a)) else np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_gemm(seed: int, m, k, n, g, kind) -> dict:
    from turbo_moe.ops.pallas_gemm import pallas_grouped_gemm

    rng = np.random.default_rng(seed)
    sizes = jnp.asarray(group_sizes(rng, m, g, kind))
    lhs = jnp.asarray(rng.normal(size=(m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(g, k, n)) / np.sqrt(k), jnp.bfloat16)
    probe = jnp.asarray(rng.normal(size=(m, n)), jnp.float32)

    def loss(gemm):
        return lambda a, b: jnp.sum(gemm(a, b).astype(jnp.float32) * probe)

    pallas = lambda a, b: pallas_grouped_gemm(a, b, sizes)
    ref = lambda a, b: jax.lax.ragged_dot(a.astype(jnp.float32), b.astype(jnp.float32), sizes)
    out = jax.jit(pallas)(lhs, rhs)
    grads = jax.jit(jax.grad(loss(pallas), argnums=(0, 1)))(lhs, rhs)
    want, want_grads = ref(lhs, rhs), jax.grad(loss(ref), argnums=(0, 1))(lhs, rhs)
    covered = int(sizes.sum())
    empty = np.flatnonzero(np.asarray(sizes) == 0)
    return {"fwd": rel_err(out, want), "dgrad": rel_err(grads[0], want_grads[0]),
            "wgrad": rel_err(grads[1], want_grads[1]),
            "tail_zero": bool(np.all(np.asarray(out[covered:], np.float32) == 0)),
            "empty_wgrad_zero": bool(np.all(np.asarray(grads[1], np.float32)[empty] == 0)),
            "sizes_not_multiple_of_8": int(np.sum(np.asarray(sizes) % 8 != 0)), "empty_groups": len(empty)}


def layer_problem(seed, tokens, dtype, d, f, e, k):
    from turbo_moe.model import ExpertWeights
    from turbo_moe.model.router import Routing

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(tokens // 2048 or 1, min(tokens, 2048), d)), dtype)
    scores = jnp.asarray(rng.random(x.shape[:2] + (e,)), jnp.float32)
    ids = jax.lax.top_k(scores, k)[1].astype(jnp.int32)
    weights = jnp.asarray(rng.random(ids.shape), jnp.float32)
    experts = ExpertWeights(jnp.asarray(rng.normal(size=(e, d, 2 * f)) / np.sqrt(d), dtype),
                            jnp.asarray(rng.normal(size=(e, f, d)) / np.sqrt(f), dtype))
    return x, Routing(ids, weights, scores), experts


def layer_step(path: str, routing):
    from turbo_moe.model import moe_path_fn

    fn = moe_path_fn(path, 1.25)
    return jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(fn(x, routing, w)[0].astype(jnp.float32) ** 2),
                                      argnums=(0, 1)))


def check_path() -> dict:
    """The pallas path in bf16 against the ragged path in float32: output and gradients."""
    x, routing, experts = layer_problem(1, 2048, jnp.float32, **LAYER)
    half = lambda t: jax.tree.map(lambda a: a.astype(jnp.bfloat16), t)
    (_, got), (_, want) = layer_step("pallas", routing)(*half((x, experts))), layer_step("ragged", routing)(x, experts)
    return {name: rel_err(a, b) for name, a, b in zip(("d_x", "d_w_gate_up", "d_w_down"),
                                                      jax.tree.leaves(got), jax.tree.leaves(want))}


def time_layer(path: str, args) -> dict:
    x, routing, experts = layer_problem(2, args.tokens, jnp.bfloat16, **LAYER)
    step = layer_step(path, routing)
    try:
        jax.block_until_ready(step(x, experts))  # compile + warm-up
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            jax.block_until_ready(step(x, experts))
            times.append(time.perf_counter() - start)
    except Exception as error:  # e.g. ragged out of memory: a row with the error, not the end
        return {"path": path, "status": "error", "error": f"{type(error).__name__}: {str(error)[:300]}"}
    ms = statistics.median(times) * 1e3
    flops = 3 * 2 * 3 * args.tokens * LAYER["k"] * LAYER["d"] * LAYER["f"]  # fwd + 2 bwd; gate, up, down
    return {"path": path, "status": "ok", "fwd_bwd_ms": ms, "tflops": flops / ms / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the timed layer (seq 2048 x batch)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    failures, gemm_rows = [], []
    for i, (name, m, k, n, g, kind) in enumerate(GEMM_CASES):
        row = {"case": name, "M": m, "K": k, "N": n, "G": g, **check_gemm(100 + i, m, k, n, g, kind)}
        ok = max(row["fwd"], row["dgrad"], row["wgrad"]) < TOLERANCE and row["tail_zero"] and row["empty_wgrad_zero"]
        failures += [] if ok else [name]
        gemm_rows.append(row)
        print(("ok  " if ok else "FAIL"), json.dumps(row), flush=True)
    path_errors = check_path()
    path_ok = max(path_errors.values()) < 3 * TOLERANCE  # bf16 end to end vs float32
    failures += [] if path_ok else ["pallas path vs float32 ragged path"]
    print(("ok  " if path_ok else "FAIL"), "path vs float32:", json.dumps(path_errors), flush=True)
    timings = [time_layer(path, args) for path in ("turbo", "pallas", "ragged")]
    for row in timings:
        print(json.dumps(row), flush=True)
    record = {"gemm_checks": gemm_rows, "path_check": path_errors, "timings": timings, "tokens": args.tokens,
              "reps": args.reps, "failures": failures, "provenance": provenance()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pallas_path_check.json").write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {out / 'pallas_path_check.json'}; failures: {failures or 'none'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
