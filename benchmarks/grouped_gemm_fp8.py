"""FP8 grouped GEMM (DeepSeek-V3 scaling) against our bf16 grouped GEMM, side by side in one process, on one GPU
(not a test).

For each shape x routing (balanced, skewed = Dirichlet(2)) it times, with CUDA events on XLA's stream (warm-up, then
the median of --reps calls; benchmarks/grouped_gemm.py's EventTimer):
  bf16/fwd, bf16/dgrad, bf16/wgrad, bf16/fwd+bwd   ops.grouped_gemm (+ its weight gradient), the baseline;
  fp8/fwd, fp8/dgrad, fp8/wgrad                     the FP8 kernels alone, on operands quantised beforehand;
  fp8_op/fwd, fp8_op/fwd+bwd                        ops.grouped_gemm_fp8 as a user calls it: quantisation included
                                                    (activations 1x128, weights 128x128, gradients 1x128 / 128x1);
and, for balanced routing, the relative Frobenius error of the bf16 and FP8 results (forward, data and weight
gradients) against float32 grouped GEMMs of the same bf16 inputs (G=256: on the first 32 groups). TFLOP/s count
2*M*K*N per GEMM (3 GEMMs for fwd+bwd). Writes <out>/grouped_gemm_fp8_<device>.csv and .json (rows +
provenance), rewritten after each case.

    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/grouped_gemm_fp8.py --out DIR [--quick]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import write_table_and_record
from grouped_gemm import EventTimer, Shape, routing_sizes

from turbo_moe import ops
from turbo_moe.shapes import DEEPSEEK_V3, REDUCED
from turbo_moe.ops.grouped_gemm_fp8 import (
    quantize_blocks,
    quantize_group_columns,
    quantize_rows,
    rows_product,
    weight_grad_product,
)

REPO = Path(__file__).resolve().parents[1]


def shapes(which: str, quick: bool) -> list[Shape]:
    # DeepSeek-V3: 8192 tokens x top-8 routed rows over 32 local experts (EP=8) or all 256.
    v3, red, m = DEEPSEEK_V3, REDUCED, 8192 * DEEPSEEK_V3.top_k
    dsv3 = {g: [Shape(f"dsv3_gate_up_G{g}_M{m}", m, v3.d_model, v3.moe_ffn_dim, g),
                Shape(f"dsv3_down_G{g}_M{m}", m, v3.moe_ffn_dim, v3.d_model, g)]
            for g in (v3.local_experts(8), v3.n_experts)}
    # `reduced`: 8 x 2048 tokens, fused gate_up
    m, g = 8 * 2048 * red.top_k, red.n_experts
    reduced = [Shape(f"reduced_gate_up_G{g}_M{m}", m, red.d_model, 2 * red.moe_ffn_dim, g),
               Shape(f"reduced_down_G{g}_M{m}", m, red.moe_ffn_dim, red.d_model, g)]
    out = ((dsv3[32] if which in ("all", "dsv3") else []) + (reduced if which in ("all", "reduced") else [])
           + (dsv3[256] if which in ("all", "dsv3") else []))  # the G=256 cases last: largest, slowest
    if quick:
        out = [s for s in out if s.name in ("dsv3_gate_up_G32_M65536", "dsv3_down_G32_M65536",
                                            "reduced_gate_up_G64_M98304")]
    return out


def bf16_fns():
    def fwd_bwd(x, w, dy, gs):
        out, vjp = jax.vjp(lambda a, b: ops.grouped_gemm(a, b, gs), x, w)
        return (out,) + vjp(dy)
    return {"fwd": lambda x, w, dy, gs: ops.grouped_gemm(x, w, gs),
            "dgrad": lambda x, w, dy, gs: ops.grouped_gemm(dy, w, gs, transpose_rhs=True),
            "wgrad": lambda x, w, dy, gs: ops.grouped_gemm_weight_grad(x, dy, gs),
            "fwd+bwd": fwd_bwd}


def fp8_op_fns():
    def fwd_bwd(x, w, dy, gs):
        out, vjp = jax.vjp(lambda a, b: ops.grouped_gemm_fp8(a, b, gs), x, w)
        return (out,) + vjp(dy)
    return {"fwd": lambda x, w, dy, gs: ops.grouped_gemm_fp8(x, w, gs), "fwd+bwd": fwd_bwd}


def fp8_kernel_cases(x, w, dy, gs):
    """The FP8 kernels alone: {op: (fn, quantised operands)}; the quantisation runs once, outside the timing."""
    m = x.shape[0]
    lq, ls = jax.jit(quantize_rows)(x)
    wq_t, ws = jax.jit(lambda a: quantize_blocks(a, transpose=True))(w)
    dq, ds = jax.jit(quantize_rows)(dy)
    wq = jnp.swapaxes(wq_t, 1, 2)
    lq_t, ls_t = jax.jit(quantize_group_columns)(x, gs)
    dq_t, ds_t = jax.jit(quantize_group_columns)(dy, gs)
    bf16 = jnp.bfloat16
    return {"fwd": (lambda *a: rows_product(*a, out_dtype=bf16), (lq, ls, wq_t, ws, gs)),
            "dgrad": (lambda *a: rows_product(*a, out_dtype=bf16), (dq, ds, wq, jnp.swapaxes(ws, 1, 2), gs)),
            "wgrad": (lambda *a: weight_grad_product(*a, m, out_dtype=bf16), (lq_t, ls_t, dq_t, ds_t, gs))}


def measure(timer, fn, inputs, shape, gemms, args, row):
    try:
        ms, temp = timer.time_ms(fn, inputs, args.warmup, args.reps)
        return row | dict(ms=round(ms, 4), tflops=round(gemms * shape.flops / ms / 1e9, 1),
                          extra_mib=round(temp, 1), status="ok")
    except Exception as e:  # recorded, never fatal: the other cases still run
        return row | dict(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def rel_err(got, want) -> float:
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.linalg.norm((got - want).ravel()) / jnp.maximum(jnp.linalg.norm(want.ravel()), 1e-30))


def errors(x, w, dy, gs) -> dict:
    """Relative Frobenius errors of bf16 and FP8 forward/dgrad/wgrad against float32 grouped GEMMs of the same
    inputs (the float32 products run the portable float32 kernels)."""
    f32 = lambda a: a.astype(jnp.float32)
    ref = {"fwd": jax.jit(ops.grouped_gemm)(f32(x), f32(w), gs),
           "dgrad": jax.jit(lambda a, b, g: ops.grouped_gemm(a, b, g, transpose_rhs=True))(f32(dy), f32(w), gs),
           "wgrad": jax.jit(ops.grouped_gemm_weight_grad)(f32(x), f32(dy), gs)}
    out = {}
    for name, fns in (("bf16", bf16_fns()), ("fp8", fp8_op_fns())):
        got = jax.jit(fns["fwd+bwd"])(x, w, dy, gs)
        for op, value in zip(("fwd", "dgrad", "wgrad"), got):
            out[f"err_{name}_{op}"] = round(rel_err(value, ref[op]), 5)
        del got
    return out


ERROR_GROUPS = 32  # the float32 references of more groups than this do not fit next to the inputs (G=256: 15 GB each)


def error_subset(inputs, sizes):
    """The first ERROR_GROUPS groups (their rows and weights) of a larger problem: the errors are per-element
    statistics of the same distributions, so a subset measures them."""
    x, w, dy, gs = inputs
    if w.shape[0] <= ERROR_GROUPS:
        return inputs
    rows = int(np.sum(sizes[:ERROR_GROUPS]))
    return x[:rows], w[:ERROR_GROUPS], dy[:rows], gs[:ERROR_GROUPS]


def run(timer, args, rows, table):
    key = jax.random.PRNGKey(0)
    for shape in shapes(args.shapes, args.quick):
        k1, k2, k3 = jax.random.split(jax.random.fold_in(key, shape.M * shape.N + shape.G), 3)
        x = jax.random.normal(k1, (shape.M, shape.K), jnp.bfloat16)
        chunk = min(shape.G, 32)  # tile 32 drawn experts (drawing G*K*N random bits at once is tens of GB)
        w = jax.random.normal(k2, (chunk, shape.K, shape.N), jnp.bfloat16) / math.sqrt(shape.K)
        w = jnp.tile(w, (shape.G // chunk, 1, 1)) if shape.G > chunk else w
        dy = jax.random.normal(k3, (shape.M, shape.N), jnp.bfloat16)
        base = dict(shape=shape.name, M=shape.M, K=shape.K, N=shape.N, G=shape.G)
        for routing in ("balanced", "skewed"):
            gs = jnp.asarray(routing_sizes(routing, shape.M, shape.G))
            inputs = (x, w, dy, gs)
            for op, fn in bf16_fns().items():
                rows.append(measure(timer, fn, inputs, shape, 3 if op == "fwd+bwd" else 1, args,
                                    base | dict(routing=routing, impl="bf16", op=op)))
            try:
                kernel_cases = fp8_kernel_cases(*inputs)
            except Exception as e:
                kernel_cases = {}
                rows.append(base | dict(routing=routing, impl="fp8", op="quantise",
                                        status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            for op, (fn, quantised) in kernel_cases.items():
                rows.append(measure(timer, fn, quantised, shape, 1, args, base | dict(routing=routing, impl="fp8",
                                                                                     op=op)))
            del kernel_cases
            for op, fn in fp8_op_fns().items():
                rows.append(measure(timer, fn, inputs, shape, 3 if op == "fwd+bwd" else 1, args,
                                    base | dict(routing=routing, impl="fp8_op", op=op)))
            if routing == "balanced" and not args.skip_errors:
                try:
                    rows.append(base | dict(routing=routing, impl="error_vs_f32", op="all", status="ok")
                                | errors(*error_subset(inputs, routing_sizes(routing, shape.M, shape.G))))
                except Exception as e:
                    rows.append(base | dict(routing=routing, impl="error_vs_f32", op="all",
                                            status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            done = [r for r in rows if r.get("shape") == shape.name and r.get("routing") == routing]
            print(f"[{shape.name} {routing}] " + "  ".join(
                f"{r['impl']}/{r['op']}={r.get('tflops', r.get('status'))}" for r in done if "tflops" in r or
                r.get("status") != "ok"), flush=True)
            write(rows, table, args)
        del x, w, dy


def summarize(rows) -> list[str]:
    ok = [r for r in rows if r.get("status") == "ok" and "tflops" in r]
    def get(impl, op, s, routing):
        key = (impl, op, s, routing)
        return next((r["tflops"] for r in ok if (r["impl"], r["op"], r["shape"], r["routing"]) == key), None)
    lines = ["FP8 / bf16 TFLOP/s (target >= 1.6 at DeepSeek-V3 shapes):"]
    for s in dict.fromkeys(r["shape"] for r in ok):
        for routing in ("balanced", "skewed"):
            parts = []
            for impl, op in (("fp8", "fwd"), ("fp8", "dgrad"), ("fp8", "wgrad"), ("fp8_op", "fwd"),
                             ("fp8_op", "fwd+bwd")):
                a, b = get(impl, op, s, routing), get("bf16", op, s, routing)
                parts.append(f"{impl}/{op}={a / b:.2f}x" if a and b else f"{impl}/{op}=-")
            lines.append(f"  {s:30s} {routing:8s} " + "  ".join(parts))
    for r in rows:
        if r.get("impl") == "error_vs_f32" and r.get("status") == "ok":
            errs = "  ".join(f"{k[4:]}={v}" for k, v in r.items() if k.startswith("err_"))
            lines.append(f"  error vs f32 {r['shape']}: {errs}")
    return lines


def write(rows, table: Path, args) -> None:
    write_table_and_record(rows, table, f"warmup={args.warmup} reps={args.reps} median; skewed=Dirichlet(2) seed 0; "
                                        "timer=cuda events on XLA stream; inputs bf16 N(0,1), w N(0,1/K)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "results")
    ap.add_argument("--shapes", choices=("all", "dsv3", "reduced"), default="all")
    ap.add_argument("--quick", action="store_true", help="three shapes only")
    ap.add_argument("--skip-errors", action="store_true", help="no float32 reference products")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if jax.devices()[0].platform != "gpu":
        raise SystemExit("benchmarks/grouped_gemm_fp8.py needs a GPU (JAX_PLATFORMS=cuda)")
    args.out.mkdir(parents=True, exist_ok=True)
    device = jax.devices()[0].device_kind.replace(" ", "_")
    table = args.out / f"grouped_gemm_fp8_{device}.csv"
    rows: list[dict] = []
    run(EventTimer(), args, rows, table)
    print("\n".join(summarize(rows)))
    print(f"wrote {table} and {table.with_suffix('.json')}")


if __name__ == "__main__":
    main()
