"""CPU speed of the turbo_moe ops, side by side in one run (a benchmark, not a test).

For each MoE-like shape: grouped GEMM fwd / dgrad / wgrad through turbo_moe against XLA's own CPU
`dot` of the same total FLOPs (the ceiling) and against jax.lax.ragged_dot (which XLA expands
densely: G x the work); permute/unpermute against a plain row gather. Prints a table and writes
experiments/results/cpu_ops_<cpu>.csv with provenance.

    python benchmarks/cpu_ops.py [--quick] [--repeats 7]
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from _provenance import provenance  # noqa: E402

from turbo_moe.ops import grouped_gemm, grouped_gemm_weight_grad, permute, unpermute  # noqa: E402

SHAPES = [  # (M, K, N, G)
    (8192, 512, 1024, 16),
    (4096, 1024, 512, 8),
    (8192, 256, 704, 32),
]
QUICK = [(2048, 256, 512, 8)]


def median_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def balanced_sizes(M, G):
    base = np.full(G, M // G, np.int32)
    base[: M % G] += 1
    return jnp.asarray(base)


def gemm_rows(M, K, N, G, dtype, repeats, with_ragged):
    key = jax.random.key(0)
    lhs = jax.random.normal(key, (M, K), jnp.float32).astype(dtype)
    rhs = jax.random.normal(key, (G, K, N), jnp.float32).astype(dtype)
    d_out = jax.random.normal(key, (M, N), jnp.float32).astype(dtype)
    sizes = balanced_sizes(M, G)
    dense_w = rhs[0]
    flops = 2.0 * M * K * N
    candidates = {
        ("fwd", "turbo"): (jax.jit(lambda a, b, s: grouped_gemm(a, b, s)), (lhs, rhs, sizes)),
        ("dgrad", "turbo"): (jax.jit(lambda g, b, s: grouped_gemm(g, b, s, transpose_rhs=True)), (d_out, rhs, sizes)),
        ("wgrad", "turbo"): (jax.jit(grouped_gemm_weight_grad), (lhs, d_out, sizes)),
        ("fwd", "xla_dot"): (jax.jit(lambda a, w: a @ w), (lhs, dense_w)),
        ("dgrad", "xla_dot"): (jax.jit(lambda g, w: g @ w.T), (d_out, dense_w)),
        ("wgrad", "xla_dot"): (jax.jit(lambda a, g: a.T @ g), (lhs, d_out)),
    }
    if with_ragged:
        candidates[("fwd", "ragged_dot")] = (jax.jit(jax.lax.ragged_dot), (lhs, rhs, sizes))
    rows = []
    for (op, impl), (fn, args) in candidates.items():
        sec = median_time(fn, *args, repeats=repeats)
        rows.append(dict(op=op, impl=impl, M=M, K=K, N=N, G=G, dtype=jnp.dtype(dtype).name,
                         ms=sec * 1e3, gflops=flops / sec / 1e9))
    return rows


def permute_rows(T, H, k, E, repeats):
    x = jax.random.normal(jax.random.key(1), (T, H))
    ids = jax.random.randint(jax.random.key(2), (T, k), 0, E)
    w = jnp.full((T, k), 1.0 / k)
    _, _, handle = permute(x, ids, E)
    moved = 2.0 * T * k * H * 4  # each copy read once and written once
    fns = {
        "permute": (jax.jit(lambda x, i: permute(x, i, E)[0]), (x, ids)),
        "unpermute": (jax.jit(lambda y, h, w: unpermute(y, h, w)), (jnp.repeat(x, k, 0), handle, w)),
        "xla_gather": (jax.jit(lambda x, i: x[i.reshape(-1) % T]), (x, ids)),
    }
    return [dict(op=name, impl="turbo" if name != "xla_gather" else "xla", T=T, H=H, k=k, E=E,
                 dtype="float32", ms=(s := median_time(f, *a, repeats=repeats)) * 1e3, gbps=moved / s / 1e9)
            for name, (f, a) in fns.items()]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one small shape (smoke run)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="CSV path (default experiments/results/cpu_ops_<cpu>.csv)")
    args = p.parse_args()
    prov = provenance()
    rows = []
    for i, (M, K, N, G) in enumerate(QUICK if args.quick else SHAPES):
        for dtype in (jnp.float32, jnp.bfloat16):
            rows += gemm_rows(M, K, N, G, dtype, args.repeats, with_ragged=(i == 0 and dtype == jnp.float32))
    rows += permute_rows(8192 if not args.quick else 1024, 1024, 4, 16, args.repeats)
    df = pd.DataFrame(rows).assign(**prov, repeats=args.repeats)
    gemm = df[df.op.isin(["fwd", "dgrad", "wgrad"])].astype({"M": int, "K": int, "N": int, "G": int})
    table = gemm.pivot_table(index=["M", "K", "N", "G", "dtype", "op"], columns="impl", values="gflops")
    table["turbo/xla_dot"] = table["turbo"] / table["xla_dot"]
    pd.set_option("display.width", 160)
    print(f"GFLOP/s (median of {args.repeats}) on {prov['cpu']} / {prov['device_kind']}, jax {prov['jax_version']}, "
          f"commit {prov['git_commit']}")
    print(table.round(2).to_string())
    print(df[df.op.isin(["permute", "unpermute", "xla_gather"])][["op", "T", "H", "k", "ms", "gbps"]].round(3).to_string(index=False))
    out = Path(args.out) if args.out else (Path(__file__).parents[1] / "experiments" / "results" /
                                           f"cpu_ops_{re.sub(r'[^A-Za-z0-9]+', '_', prov['cpu']).strip('_').lower()}.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(out, index=False)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
