"""FP8 grouped GEMM (DeepSeek-V3 scaling) against our bf16 grouped GEMM, side by side in one process, on one GPU
(not a test).

For each shape x routing (balanced, skewed = Dirichlet(2)) it times, with CUDA events on XLA's stream (warm-up, then
the median of --reps calls; benchmarks/grouped_gemm.py's EventTimer):
  bf16/fwd, bf16/dgrad, bf16/wgrad, bf16/fwd+bwd   ops.grouped_gemm (+ its weight gradient), the baseline;
  fp8/fwd, fp8/dgrad, fp8/wgrad                     the FP8 kernels alone, on operands quantised beforehand;
  fp8_op/fwd, fp8_op/fwd+bwd                        ops.grouped_gemm_fp8 as a user calls it: quantisation included
                                                    (activations 1x128, weights 128x128, gradients 1x128 / 128x1);
  fp8_prepared/fwd, fp8_prepared/fwd+bwd(wgrad=...) the op on `ops.fp8_weights(w)` (weights quantised once per
                                                    optimizer step, outside the timing), activation quantisation
                                                    included; the weight gradient in FP8 and in bf16;
  quant/rows_x, quant/rows_x_kernel, quant/rows_dy, quant/weights, quant/cols_x, quant/cols_dy
                                                    the quantisation passes alone (1x128 activations by XLA's
                                                    jnp passes and by the op's kernel, ops.quantize_rows; the output
                                                    gradient; both weight layouts; the 128x1 group-padded columns);
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
from turbo_moe.shapes import DEEPSEEK_V3, QWEN3_30B_A3B, REDUCED
from turbo_moe.ops.fp8_scaling import fp8_weights
from turbo_moe.ops.grouped_gemm_fp8 import (
    quantize_blocks,
    quantize_group_columns,
    quantize_rows,
    rows_product,
    weight_grad_product,
)

REPO = Path(__file__).resolve().parents[1]


def issue_shapes() -> list[Shape]:
    """The shapes FP8 is judged at: DeepSeek-V3's gate/up and down with 4096 tokens on 32 local experts, Qwen3-30B-A3B's
    gate/up with 8192 tokens on all 128 experts, a 4096-wide model with 1408-wide experts on 64, and `reduced`'s two
    GEMMs at batch 8 x 2048."""
    v3, qw, red = DEEPSEEK_V3, QWEN3_30B_A3B, REDUCED
    m_red = 8 * 2048 * red.top_k
    return [Shape("dsv3_gate_up_G32_M32768", 32768, v3.d_model, 2 * v3.moe_ffn_dim, 32),
            Shape("dsv3_down_G32_M32768", 32768, v3.moe_ffn_dim, v3.d_model, 32),
            Shape("qwen3_gate_up_G128_M65536", 65536, qw.d_model, 2 * qw.moe_ffn_dim, qw.n_experts),
            Shape("d4096_f1408_gate_up_G64_M32768", 32768, 4096, 2 * 1408, 64),
            Shape(f"reduced_gate_up_G{red.n_experts}_M{m_red}", m_red, red.d_model, 2 * red.moe_ffn_dim, red.n_experts),
            Shape(f"reduced_down_G{red.n_experts}_M{m_red}", m_red, red.moe_ffn_dim, red.d_model, red.n_experts)]


def shapes(which: str, quick: bool) -> list[Shape]:
    if which == "issue":
        return issue_shapes()
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


def fp8_prepared_fns():
    """The op on weights quantised beforehand (`w` here is `fp8_weights(w)`), the weight gradient both ways."""
    def fwd_bwd(weight_grad):
        def run(x, w8, dy, gs):
            out, vjp = jax.vjp(lambda a, b: ops.grouped_gemm_fp8(a, b, gs, weight_grad=weight_grad), x, w8)
            d_x, d_w8 = vjp(dy)
            return out, d_x, d_w8.master
        return run
    return {"fwd": lambda x, w8, dy, gs: ops.grouped_gemm_fp8(x, w8, gs),
            "fwd+bwd(wgrad=fp8)": fwd_bwd("fp8"), "fwd+bwd(wgrad=bf16)": fwd_bwd("bf16")}


def quant_fns():
    """The quantisation passes alone, as the op runs them."""
    return {"rows_x": lambda x, w, dy, gs: quantize_rows(x),
            "rows_x_kernel": lambda x, w, dy, gs: ops.quantize_rows(x),
            "rows_dy": lambda x, w, dy, gs: quantize_rows(dy),
            "weights": lambda x, w, dy, gs: fp8_weights(w)[1:],
            "cols_x": lambda x, w, dy, gs: quantize_group_columns(x, gs),
            "cols_dy": lambda x, w, dy, gs: quantize_group_columns(dy, gs)}


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
        return row | dict(ms=round(ms, 4), tflops=round(gemms * shape.flops / ms / 1e9, 1) if gemms else None,
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
        for routing in args.routings.split(","):
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
            prepared = (x, jax.jit(fp8_weights)(w), dy, gs)
            for op, fn in fp8_prepared_fns().items():
                rows.append(measure(timer, fn, prepared, shape, 1 if op == "fwd" else 3, args,
                                    base | dict(routing=routing, impl="fp8_prepared", op=op)))
            del prepared
            for op, fn in quant_fns().items():
                rows.append(measure(timer, fn, inputs, shape, 0, args, base | dict(routing=routing, impl="quant",
                                                                                   op=op)))
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
    """bf16 time over each FP8 variant's (> 1: FP8 faster), then the quantisation passes' ms."""
    ok = [r for r in rows if r.get("status") == "ok" and "ms" in r]

    def ms(impl, op, s, routing):
        return next((r["ms"] for r in ok if (r["impl"], r["op"], r["shape"], r["routing"]) == (impl, op, s, routing)),
                    None)
    variants = (("fp8", "fwd", "fwd"), ("fp8", "dgrad", "dgrad"), ("fp8", "wgrad", "wgrad"),
                ("fp8_op", "fwd", "fwd"), ("fp8_op", "fwd+bwd", "fwd+bwd"), ("fp8_prepared", "fwd", "fwd"),
                ("fp8_prepared", "fwd+bwd(wgrad=fp8)", "fwd+bwd"), ("fp8_prepared", "fwd+bwd(wgrad=bf16)", "fwd+bwd"))
    lines = ["bf16 ms / FP8 ms (fp8 = kernel alone on quantised operands; fp8_op = the op, weights quantised per call;"
             " fp8_prepared = the op on fp8_weights(w)):"]
    for s in dict.fromkeys(r["shape"] for r in ok):
        for routing in dict.fromkeys(r["routing"] for r in ok if r["shape"] == s):
            parts = []
            for impl, op, base in variants:
                a, b = ms(impl, op, s, routing), ms("bf16", base, s, routing)
                parts.append(f"{impl}/{op}={b / a:.2f}x" if a and b else f"{impl}/{op}=-")
            quant = "  ".join(f"{op}={ms('quant', op, s, routing)}" for op in quant_fns())
            lines.append(f"  {s:32s} {routing:8s} " + "  ".join(parts))
            lines.append(f"  {'':32s} {'':8s} quantisation ms: {quant}")
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
    ap.add_argument("--shapes", choices=("all", "dsv3", "reduced", "issue"), default="all",
                    help="issue: the six shapes FP8 is judged at (issue_shapes)")
    ap.add_argument("--routings", default="balanced,skewed", help="comma-separated: balanced, skewed")
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
