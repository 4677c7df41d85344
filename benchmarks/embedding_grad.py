"""Embedding backward (the (V, D) gradient of table[ids]) by method, on uniform and Zipf-distributed ids (not a test).

    python benchmarks/embedding_grad.py --out experiments/results/embedding_grad_h200.csv

For each vocab size and id distribution, times jit(grad) of sum(lookup(table, ids) * g) with
turbo_moe.model.embedding.lookup(grad="scatter" | "matmul" | "segment") (median of --reps after a warm-up) and checks each against
the scatter. Zipf ids (exponent --zipf) stand in for real text's token frequencies. One CSV row per case, with provenance.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import provenance  # noqa: E402
from _records import median_ms, write_csv  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--d-model", type=int, default=1280)
    ap.add_argument("--vocabs", default="8192,32768,129280")
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--methods", default=None, help="comma-separated subset of the backwards (default: all)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from turbo_moe.model.embedding import EMBEDDING_GRADS, lookup

    methods = EMBEDDING_GRADS if args.methods is None else tuple(args.methods.split(","))
    unknown = set(methods) - set(EMBEDDING_GRADS)
    if unknown:
        ap.error(f"--methods: {sorted(unknown)} not among {EMBEDDING_GRADS}")
    meta = {k: v for k, v in provenance().items() if not isinstance(v, dict)}
    rng = np.random.default_rng(0)
    g = jnp.asarray(rng.standard_normal((args.tokens, args.d_model)), jnp.bfloat16)
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        table = jnp.asarray(rng.standard_normal((vocab, args.d_model)) * 0.02, jnp.bfloat16)
        ids_by = {"uniform": rng.integers(0, vocab, args.tokens),
                  "zipf": np.minimum(rng.zipf(args.zipf, args.tokens) - 1, vocab - 1)}
        for dist, ids in ids_by.items():
            ids = jnp.asarray(ids, jnp.int32)
            grads = {}
            for method in methods:
                fn = jax.jit(jax.grad(lambda t, i, m=method: jnp.sum(lookup(t, i, m).astype(jnp.float32)
                                                                      * g.astype(jnp.float32))))
                grads[method] = np.asarray(fn(table, ids), np.float32)  # compiles it, untimed
                ms = median_ms(fn, table, ids, reps=args.reps)
                top = float(np.bincount(np.asarray(ids)).max()) / args.tokens
                rows.append({"vocab": vocab, "ids": dist, "method": method, "ms": round(ms, 4), "tokens": args.tokens,
                             "d_model": args.d_model, "zipf": args.zipf, "top_id_share": round(top, 4), **meta})
                print(f"V={vocab} {dist} {method}: {ms:.3f} ms (top id {top:.1%} of tokens)", flush=True)
                write_csv(rows, Path(args.out))
            for method in (m for m in methods if m != "scatter" and "scatter" in grads):
                diff = np.abs(grads[method] - grads["scatter"]).max() / (np.abs(grads["scatter"]).max() + 1e-30)
                print(f"V={vocab} {dist}: {method} vs scatter max rel diff {diff:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
