"""Router forward time by router implementation and sequence load penalty (issues 13 part 10, 14), alternated.

    python benchmarks/router_cost.py --out experiments/results/router_cost_h200.csv
    python benchmarks/router_cost.py --out experiments/results/router_topk_h200.csv \
        --cases xla:0.1:128,kernel:0.1:128,xla:0:128,kernel:0:128

Times one `Router` of the `reduced` preset (gate matmul and sigmoid included) on a (batch, seq, d_model) bfloat16
input, jitted, for each case `[impl:]penalty:chunk` (impl: ModelConfig.router_topk_impl, "xla" when left out),
alternating the cases `--rounds` times (each time the median of `--reps` calls); every impl of a (penalty, chunk)
is checked to pick what the first one picks. One row per case and round, with provenance. Speed lives here,
never in the tests. (Until 2026-11-25 the impl comparison was benchmarks/router_topk.py, folded in here.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import provenance  # noqa: E402
from _records import median_ms, write_csv  # noqa: E402


def parse_case(item: str) -> tuple[str, float, int]:
    """'kernel:0.1:128' -> ('kernel', 0.1, 128); 'penalty:chunk' means the xla router."""
    parts = item.split(":")
    if len(parts) == 2:
        parts = ["xla", *parts]
    if len(parts) != 3:
        raise ValueError(f"--cases: expected [impl:]penalty:chunk, got {item!r}")
    return parts[0], float(parts[1]), int(parts[2])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="CSV path")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--cases", default="0:128,0.1:128,0.1:256,0.1:64", help="comma list of [impl:]penalty:chunk")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    cases_wanted = [parse_case(item) for item in args.cases.split(",")]

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from turbo_moe.model import get_config
    from turbo_moe.model.router import Router

    x = jax.random.normal(jax.random.key(0), (args.batch, args.seq, get_config("reduced").d_model), jnp.bfloat16)
    cases, picks = [], {}
    for impl, penalty, chunk in cases_wanted:
        cfg = get_config("reduced", router_topk_impl=impl, router_seq_load_penalty=penalty,
                         router_seq_load_chunk=chunk, max_seq_len=max(args.seq, 1))
        graphdef, state = nnx.split(Router(cfg, nnx.Rngs(0)))  # same key: the same gate for every case
        fn = jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x).expert_ids)
        picks.setdefault((penalty, chunk), []).append((impl, np.asarray(fn(state, x))))  # compiles it, untimed
        cases.append((impl, penalty, chunk, fn, state))
    for (penalty, chunk), runs in picks.items():
        for impl, ids in runs[1:]:
            differ = float((ids != runs[0][1]).any(-1).mean())
            print(f"penalty {penalty:g} chunk {chunk}: {impl} vs {runs[0][0]}: {differ:.2e} of tokens pick differently")
    meta = {k: v for k, v in provenance().items() if not isinstance(v, dict)}
    rows = []
    for r in range(args.rounds):
        for impl, penalty, chunk, fn, state in cases:
            ms = median_ms(fn, state, x, reps=args.reps)
            rows.append({"impl": impl, "penalty": penalty, "chunk": chunk, "round": r, "batch": args.batch,
                         "seq": args.seq, "router_fwd_ms": round(ms, 4), "reps": args.reps, **meta})
            print(f"{impl} penalty {penalty:g} chunk {chunk}: {ms:.3f} ms (round {r})", flush=True)
            write_csv(rows, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
