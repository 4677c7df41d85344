"""Router forward time with ModelConfig.router_topk_impl "xla" vs "kernel" (turbo_moe.ops.router_topk), alternated.

    python benchmarks/router_topk.py --out experiments/results/router_topk_h200.csv

Times one `Router` of the `reduced` preset (its sequence load penalty and chunk unless --cases says otherwise) on a
(batch, seq, d_model) bfloat16 input, jitted, for each (impl, penalty, chunk) case, alternating the cases `--rounds`
times (each time the median of `--reps` calls), and checks that both impls pick the same experts. One row per case
and round, with provenance; the same measurement as benchmarks/router_cost.py (gate matmul and sigmoid included).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import provenance  # noqa: E402
from _records import write_csv  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="CSV path")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cases", default="xla:0.1:128,kernel:0.1:128,xla:0:128,kernel:0:128",
                    help="comma list of impl:penalty:chunk")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from turbo_moe.model import get_config
    from turbo_moe.model.router import Router

    x = jax.random.normal(jax.random.key(0), (args.batch, args.seq, get_config("reduced").d_model), jnp.bfloat16)
    cases, picks = [], {}
    for item in args.cases.split(","):
        impl, penalty, chunk = item.split(":")
        cfg = get_config("reduced", router_topk_impl=impl, router_seq_load_penalty=float(penalty),
                         router_seq_load_chunk=int(chunk), max_seq_len=max(args.seq, 1))
        graphdef, state = nnx.split(Router(cfg, nnx.Rngs(0)))  # same key: the same gate for every impl
        fn = jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x).expert_ids)
        ids = np.asarray(fn(state, x))  # compile outside the timed rounds
        picks.setdefault((float(penalty), int(chunk)), []).append((impl, ids))
        cases.append((impl, float(penalty), int(chunk), fn, state))
    for key, runs in picks.items():
        for impl, ids in runs[1:]:
            differ = float((ids != runs[0][1]).any(-1).mean())
            print(f"penalty {key[0]:g} chunk {key[1]}: {impl} vs {runs[0][0]}: {differ:.2e} of tokens pick differently")
    meta = {k: v for k, v in provenance().items() if not isinstance(v, dict)}
    rows = []
    for r in range(args.rounds):
        for impl, penalty, chunk, fn, state in cases:
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn(state, x).block_until_ready()
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            rows.append({"impl": impl, "penalty": penalty, "chunk": chunk, "round": r, "batch": args.batch,
                         "seq": args.seq, "router_fwd_ms": round(ms, 4), "reps": args.reps, **meta})
            print(f"{impl} penalty {penalty:g} chunk {chunk}: {ms:.3f} ms (round {r})", flush=True)
            write_csv(rows, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
