"""Measured vs predicted memory per device: XLA's buffer assignment of the train step against
`turbo_moe.experiments.accounting` (the target: within 10%).

    python benchmarks/memory_check.py --out DIR                       # the default cases
    python benchmarks/memory_check.py --out DIR --cases 'reduced:turbo:8:2048:{"remat_policy":"full"}'
    python benchmarks/memory_check.py --out DIR --cases \
        'reduced:turbo:8:2048:{"loss_chunk_tokens":4096}'

Each case lowers the train step on abstract inputs and compiles it (nothing is allocated, so cases larger
than the device still report what they would need): measured = arguments + temporaries + outputs not
aliased to an argument (the peak XLA plans for; `turbo_moe.train.run` reports the same numbers as
`compiled_*`). The prediction is `accounting.memory_prediction` for a one-device mesh. One CSV row per
case, written as each case finishes. A case's overrides are ModelConfig fields, except `moments_dtype`
(TrainConfig's: given to the optimizer and to the prediction). `--autotune-level 0` (default)
skips GEMM autotuning so a case compiles in ~10 s instead of ~25 s; `--autotune-level xla` checks that the
choice moves the numbers.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FULL_SLICE = dict(n_layers=2, n_dense_layers=1, n_experts=32, n_groups=8, topk_groups=4, top_k=8)
DEFAULT_CASES = [
    "reduced:turbo:8:2048", "reduced:turbo:4:2048", "reduced:turbo:2:2048",
    "reduced:dense_cf:8:2048", "reduced:dense_cf:4:2048",
    'reduced:turbo:8:2048:{"remat_policy":"full"}', 'reduced:turbo:4:2048:{"remat_policy":"none"}',
    "reduced:ragged:2:2048",
    "deepseek_v3_671b:turbo:1:4096:" + json.dumps(FULL_SLICE),
    "deepseek_v3_671b:dense_cf:1:4096:" + json.dumps(FULL_SLICE),
    "deepseek_v3_671b:turbo:2:4096:" + json.dumps({**FULL_SLICE, "remat_policy": "dots_no_batch"}),
]


def parse_case(text: str) -> tuple[str, str, int, int, dict]:
    parts = text.split(":", 4)
    if len(parts) < 4:
        raise SystemExit(f"--cases: {text!r} is not preset:path:batch:seq[:json overrides]")
    overrides = json.loads(parts[4]) if len(parts) == 5 else {}
    return parts[0], parts[1], int(parts[2]), int(parts[3]), overrides


def measure(preset: str, path: str, batch: int, seq: int, overrides: dict, autotune: int | None) -> dict:
    import jax

    from turbo_moe.experiments.accounting import GIB, memory_prediction
    from turbo_moe.model import get_config
    from turbo_moe.train import TrainConfig
    from turbo_moe.train.step import abstract_batch, build_program, make_mesh, make_optimizer

    model_overrides = {k: v for k, v in overrides.items() if k != "moments_dtype"}
    mu_dtype = nu_dtype = overrides.get("moments_dtype")
    cfg = get_config(preset, **{"capacity_factor": 1.25, **model_overrides}, moe_path=path)
    tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic", seq_len=seq, moments_dtype=mu_dtype))
    mesh = make_mesh(jax.devices()[:1])
    program = build_program(cfg, tx, mesh, True, autotune)
    t0 = time.perf_counter()
    compiled = program.train.lower(program.abstract_state, abstract_batch(batch, seq, mesh)).compile()
    mem = compiled.memory_analysis()
    args, temp = mem.argument_size_in_bytes, mem.temp_size_in_bytes
    outputs = max(mem.output_size_in_bytes - mem.alias_size_in_bytes, 0)
    measured = args + temp + outputs
    predicted = memory_prediction(cfg, batch, seq, adam_mu_dtype=mu_dtype, adam_nu_dtype=nu_dtype)
    row = {"preset": preset, "moe_path": path, "per_device_batch": batch, "seq_len": seq,
           "overrides": json.dumps(overrides), "remat_policy": cfg.remat_policy, "gpu_autotune_level": autotune,
           "compile_s": round(time.perf_counter() - t0, 2), "arguments_gib": args / GIB, "temp_gib": temp / GIB,
           "unaliased_outputs_gib": outputs / GIB, "measured_gib": measured / GIB,
           "predicted_gib": sum(predicted.values()) / GIB,
           **{f"predicted_{k.replace(' ', '_')}_gib": v / GIB for k, v in predicted.items()}}
    row["predicted_over_measured"] = row["predicted_gib"] / row["measured_gib"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="preset:path:batch:seq[:json overrides]")
    ap.add_argument("--autotune-level", default="0", help="XLA GPU autotune level (0-4) or xla (its default)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _provenance import provenance  # noqa: E402
    from _records import write_csv  # noqa: E402

    autotune = None if args.autotune_level == "xla" else int(args.autotune_level)
    prov = provenance()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = out / f"memory_check_{prov['device_kind'].lower().replace(' ', '_')}.csv"
    rows = []
    for text in args.cases:
        case = parse_case(text)
        try:
            row = {**measure(*case, autotune), "status": "ok"}
        except Exception as error:  # noqa: BLE001 - a failed case is a row, never the end of the list
            row = {"preset": case[0], "moe_path": case[1], "per_device_batch": case[2], "seq_len": case[3],
                   "overrides": json.dumps(case[4]), "status": f"error: {type(error).__name__}: {str(error)[:300]}"}
        rows.append({**row, **prov})
        print(json.dumps(rows[-1], default=str), flush=True)
        write_csv(rows, table)
    print(f"\n{'case':58} {'measured':>9} {'predicted':>9} {'ratio':>6}")
    for r in rows:
        name = f"{r['preset']}:{r['moe_path']}:{r['per_device_batch']}x{r['seq_len']} {r.get('remat_policy', '')}"
        if r["status"] == "ok":
            print(f"{name:58} {r['measured_gib']:9.2f} {r['predicted_gib']:9.2f} {r['predicted_over_measured']:6.2f}")
        else:
            print(f"{name:58} {r['status']}")
    print(f"saved {table}")


if __name__ == "__main__":
    main()
