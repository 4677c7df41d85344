"""Router forward time with and without the causal sequence load penalty (issue 13 part 10), alternated.

    python benchmarks/router_cost.py --out experiments/results/router_cost_h200.csv

Times one `Router` of the `reduced` preset on a (batch, seq, d_model) bfloat16 input, jitted, for each
(penalty, chunk) case, alternating the cases `--rounds` times (each time the median of `--reps` calls), and
writes one row per case and round with provenance. Speed lives here, never in the tests.
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
    ap.add_argument("--cases", default="0:128,0.1:128,0.1:256,0.1:64", help="comma list of penalty:chunk")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from turbo_moe.model import get_config
    from turbo_moe.model.router import Router

    x = jax.random.normal(jax.random.key(0), (args.batch, args.seq, get_config("reduced").d_model), jnp.bfloat16)
    cases = []
    for item in args.cases.split(","):
        penalty, _, chunk = item.partition(":")
        cfg = get_config("reduced", router_seq_load_penalty=float(penalty), router_seq_load_chunk=int(chunk))
        graphdef, state = nnx.split(Router(cfg, nnx.Rngs(0)))
        fn = jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x).expert_ids)
        fn(state, x).block_until_ready()  # compile outside the timed rounds
        cases.append((float(penalty), int(chunk), fn, state))
    meta = {k: v for k, v in provenance().items() if not isinstance(v, dict)}
    rows = []
    for r in range(args.rounds):
        for penalty, chunk, fn, state in cases:
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn(state, x).block_until_ready()
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
            rows.append({"penalty": penalty, "chunk": chunk, "round": r, "batch": args.batch, "seq": args.seq,
                         "router_fwd_ms": round(ms, 4), "reps": args.reps, **meta})
            print(f"penalty {penalty:g} chunk {chunk}: {ms:.3f} ms (round {r})", flush=True)
            write_csv(rows, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
