"""The FP8 expert path with its quantisation fused into the permute, against bf16 and the un-fused FP8 op, side by side
in one process on one GPU (not a test).

Units timed (CUDA events on XLA's stream, warm-up then the median of --reps; benchmarks/grouped_gemm.py's EventTimer),
each forward ("fwd") and forward + backward ("fwd+bwd", the cotangent given; gradients for tokens and weights):
  permute+GEMM, tokens (T, K) routed top-k to G experts, (T*k, K) x (G, K, N):
    bf16        ops.permute + ops.grouped_gemm (the baseline)
    fp8_old     ops.permute + the FP8 op as it was before the fusion: XLA quantises the rows and the weights each call,
                the backward quantises the weights again (a copy of the old VJP rules, here)
    fp8_op      ops.permute + ops.grouped_gemm_fp8 (weights quantised once per call, their blocks saved for the data
                gradient; rows quantised by XLA)
    fp8_fused   ops.permute_fp8 (rows quantised in the permute's copy) + ops.grouped_gemm_fp8_quantized; its backward
                is expert_block's: the bf16 rows rebuilt by permute_rows, the FP8 op's VJP, unpermute
    permute / permute_fp8 alone (fwd), the copy each GEMM path starts with
  quantize group columns, the weight gradient's 128x1 quantiser of (M, C) rows, C = K (the activations) and C = N
  (the output gradient): "jnp" (XLA's gather, reduction and transpose) against "kernel" (ops.quantize_group_columns),
  and how many FP8 codes the two give differently on the GPU (XLA's GPU quantiser may differ by one code at ties)
  the whole expert block (permute -> gate/up -> SwiGLU -> down -> unpermute, fwd+bwd), `ops.expert_block` with the
  GEMM sets "turbo" (bf16, fused SwiGLU kernels), "fp8" (weight gradients by the per-shape rule) and "fp8" with them
  forced to FP8 / bf16 ("fp8_wgrad_fp8" / "fp8_wgrad_bf16"); "fp8_prepared*": the same on `ops.fp8_weights` made
  beforehand, and "fp8_prepared_quantize_after": the fp8 set with its rows quantised by `quantize_rows` after their
  bf16 producers (the A/B of the producer-written FP8 rows; `--block-impls` picks). Those weights are made
  beforehand (not timed: once per optimizer step in training); and the block in a 2-layer jax.lax.scan (no remat; the
  forward and backward loops are separate computations, as in training), "turbo", "fp8" (weights quantised in every
  layer's forward and backward) and "fp8_prepared" (all layers' FP8 weights made once before the scan, timed).
TFLOP/s count 2*M*K*N per GEMM (3 GEMMs for fwd+bwd; the block: 6*M*D*F forward). Shapes: DeepSeek-V3 G=32 (T=8192,
top-8, K=7168, N=2048; block D=7168, F=2048), `reduced` (T=16384, top-6, G=64, K=1280, N=1024; block D=1280,
F=512) and Qwen3-30B-A3B at expert parallelism 2 (T=8192, top-8, G=64, D=2048, F=768); balanced routing (equal group sizes, tokens' experts shuffled). Writes <out>/fp8_expert_path_<device>.csv and
.json (rows + provenance), rewritten after each unit; a failed unit is a row with its error.

    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/fp8_expert_path.py --out DIR
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import write_table_and_record
from grouped_gemm import EventTimer, routing_sizes

from turbo_moe import ops
from turbo_moe.shapes import DEEPSEEK_V3, QWEN3_30B_A3B, REDUCED
from turbo_moe.ops.fp8_scaling import fp8_weights
from turbo_moe.ops.gemm_sets import gradients_by_autodiff
from turbo_moe.ops.grouped_gemm_fp8 import (
    quantize_blocks,
    quantize_group_columns_xla,
    quantize_rows,
    rows_product,
    weight_grad_product,
)
from turbo_moe.ops.permute import _permute_call, permute_rows_call
from turbo_moe.ops.permute_fp8 import permute_fp8_call
from turbo_moe.ops.unpermute import unpermute_call

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    T: int  # tokens
    k: int  # experts per token
    K: int  # the GEMM's contraction (d_model)
    N: int  # the GEMM's output width
    G: int  # experts
    F: int  # the block's moe_ffn_dim

    @property
    def M(self) -> int:
        return self.T * self.k


CASES = [Case("dsv3_G32", 8192, DEEPSEEK_V3.top_k, DEEPSEEK_V3.d_model, DEEPSEEK_V3.moe_ffn_dim,
              DEEPSEEK_V3.local_experts(8), DEEPSEEK_V3.moe_ffn_dim),  # expert parallelism 8, gate and up apart
         Case("reduced_G64", 16384, REDUCED.top_k, REDUCED.d_model, 2 * REDUCED.moe_ffn_dim, REDUCED.n_experts,
              REDUCED.moe_ffn_dim),  # fused gate_up
         Case("qwen3_G64", 8192, QWEN3_30B_A3B.top_k, QWEN3_30B_A3B.d_model, 2 * QWEN3_30B_A3B.moe_ffn_dim,
              QWEN3_30B_A3B.local_experts(2), QWEN3_30B_A3B.moe_ffn_dim)]  # expert parallelism 2, fused gate_up


# ---- the FP8 op before the fusion (its VJP rules as they were), for the side-by-side row ---------------------------

@jax.custom_vjp
def old_fp8_gemm(lhs, rhs, group_sizes):
    return _old_fwd(lhs, rhs, group_sizes)[0]


def _old_fwd(lhs, rhs, group_sizes):
    lq, ls = quantize_rows(lhs)
    wq_t, ws = quantize_blocks(rhs, transpose=True)
    return rows_product(lq, ls, wq_t, ws, group_sizes, out_dtype=lhs.dtype), (lhs, rhs, group_sizes)


def _old_bwd(res, d_out):
    lhs, rhs, group_sizes = res
    dq, ds = quantize_rows(d_out)
    wq, ws = quantize_blocks(rhs)  # the weights quantised again
    d_lhs = rows_product(dq, ds, wq, jnp.swapaxes(ws, 1, 2), group_sizes, out_dtype=lhs.dtype)
    lq_t, ls_t = quantize_group_columns_xla(lhs, group_sizes)
    dq_t, ds_t = quantize_group_columns_xla(d_out, group_sizes)
    d_rhs = weight_grad_product(lq_t, ls_t, dq_t, ds_t, group_sizes, lhs.shape[0], out_dtype=rhs.dtype)
    return d_lhs, d_rhs, None


old_fp8_gemm.defvjp(_old_fwd, _old_bwd)


# ---- permute + GEMM units -----------------------------------------------------------------------------------------

def permuted(gemm):
    """x (T, K), ids (T, k), w (G, K, N) -> permute then gemm(rows, w, group_sizes)."""
    def fn(x, ids, w):
        rows, gs, _ = ops.permute(x, ids, w.shape[0])
        return gemm(rows, w, gs)
    return fn


@jax.custom_vjp
def fused_fp8(x, ids, w):
    return _fused_fwd(x, ids, w)[0]


def _fused_fwd(x, ids, w):
    q, scale, gs, row_index = permute_fp8_call(x, ids, w.shape[0])
    return ops.grouped_gemm_fp8_quantized(q, scale, w, gs), (x, w, gs, row_index)


def _fused_bwd(res, d_out):  # expert_block's recipe: rebuild the bf16 rows, the FP8 op's VJP, unpermute
    x, w, gs, row_index = res
    rows = permute_rows_call(x, row_index, gs)
    _, vjp = jax.vjp(lambda r, b: ops.grouped_gemm_fp8(r, b, gs), rows, w)
    d_rows, d_w = vjp(d_out)
    return unpermute_call(d_rows, row_index, jnp.ones(row_index.shape, jnp.float32)), None, d_w


fused_fp8.defvjp(_fused_fwd, _fused_bwd)

UNITS = {
    "bf16": permuted(lambda r, w, gs: ops.grouped_gemm(r, w, gs)),
    "fp8_old": permuted(old_fp8_gemm),
    "fp8_op": permuted(lambda r, w, gs: ops.grouped_gemm_fp8(r, w, gs)),
    "fp8_fused": fused_fp8,
}


def fwd_bwd(fn):
    def run(x, ids, w, dy):
        out, vjp = jax.vjp(lambda a, b: fn(a, ids, b), x, w)
        return (out,) + vjp(dy)
    return run


def block_fwd_bwd(gemms):
    def run(x, ids, combine_w, w_gate_up, w_down, dy):
        def f(a, c, wg, wd):
            return ops.expert_block(a, ids, c, wg, wd, gemms=gemms)[0]
        out, vjp = jax.vjp(f, x, combine_w, w_gate_up, w_down)
        return (out,) + vjp(dy)
    return run


def block_prepared_fwd_bwd(gemms):
    """The block on `fp8_weights` made beforehand (once per optimizer step in training, outside the timing); the
    gradients are the weights' own (the Fp8Weights' master leaves)."""
    def run(x, ids, combine_w, w8_gate_up, w8_down, dy):
        def f(a, c, wg, wd):
            return ops.expert_block(a, ids, c, w8_gate_up._replace(master=wg), w8_down._replace(master=wd),
                                    gemms=gemms)[0]
        out, vjp = jax.vjp(f, x, combine_w, w8_gate_up.master, w8_down.master)
        return (out,) + vjp(dy)
    return run


def with_weight_grad(weight_grad: str):
    """The fp8 set with its weight gradients forced to one product ("fp8" or "bf16") instead of the per-shape rule."""
    def forward(r, w, gs, zero_tail=True):
        return ops.grouped_gemm_fp8(r, w, gs, weight_grad=weight_grad)
    data_grad, weight_grad_fn = gradients_by_autodiff(forward)
    return dataclasses.replace(ops.GEMM_SETS["fp8"], forward=forward, data_grad=data_grad, weight_grad=weight_grad_fn)


# The fp8 set as it was before its FP8 rows were written by their producers: SwiGLU by XLA then quantize_rows, the
# backward's row gather and SwiGLU's backward in bf16, each read again by quantize_rows (the A/B of that change).
FP8_QUANTIZE_AFTER = dataclasses.replace(ops.GEMM_SETS["fp8"], producer_quantized=None)


def block_scan_fwd_bwd(gemms, prepared: bool = False):
    """The block in a jax.lax.scan over stacked weights (L, G, ...): y of one layer is the next layer's tokens."""
    def run(x, ids, combine_w, w_gate_up, w_down, dy):
        def f(a, c, wg, wd):
            def layer(tokens, w):
                return ops.expert_block(tokens, ids, c, w[0], w[1], gemms=gemms)[0], None
            if prepared:  # all layers' FP8 blocks made once, before the scan, as a training step would
                wg, wd = fp8_weights(wg), fp8_weights(wd)
            return jax.lax.scan(layer, a, (wg, wd))[0]
        out, vjp = jax.vjp(f, x, combine_w, w_gate_up, w_down)
        return (out,) + vjp(dy)
    return run


BLOCK_IMPLS = ("turbo", "fp8", "fp8_wgrad_fp8", "fp8_wgrad_bf16", "fp8_prepared", "fp8_prepared_quantize_after",
               "fp8_prepared_wgrad_bf16", "fp8_prepared_wgrad_fp8", "scan2_turbo", "scan2_fp8", "scan2_fp8_prepared")


def balanced_ids(case: Case) -> np.ndarray:
    sizes = routing_sizes("balanced", case.M, case.G)
    ids = np.repeat(np.arange(case.G, dtype=np.int32), sizes)
    return np.random.default_rng(0).permutation(ids).reshape(case.T, case.k)


def measure(timer, fn, args, flops, row, reps):
    try:
        ms, temp = timer.time_ms(fn, args, reps[0], reps[1])
        return row | dict(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1) if flops else None,
                          extra_mib=round(temp, 1), status="ok")
    except Exception as e:  # recorded, never fatal: the other units still run
        return row | dict(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")


def run_case(timer, case: Case, args, rows, table):
    keys = jax.random.split(jax.random.PRNGKey(case.M + case.G), 6)
    x = jax.random.normal(keys[0], (case.T, case.K), jnp.bfloat16)
    ids = jnp.asarray(balanced_ids(case))
    w = jax.random.normal(keys[1], (case.G, case.K, case.N), jnp.bfloat16) / float(np.sqrt(case.K))
    dy = jax.random.normal(keys[2], (case.M, case.N), jnp.bfloat16)
    base = dict(case=case.name, T=case.T, k=case.k, M=case.M, K=case.K, N=case.N, G=case.G, routing="balanced")
    reps = (args.warmup, args.reps)
    gemm = 2.0 * case.M * case.K * case.N
    if "permute_gemm" in args.units:
        permute_gemm_units(timer, case, args, rows, table, (x, ids, w, dy), base, reps, gemm, keys[0])
    del w, dy
    if "expert_block" in args.units:
        block_units(timer, case, args, rows, table, x, ids, base, reps, keys)
    done = [r for r in rows if r.get("case") == case.name]
    print(f"[{case.name}] " + "  ".join(f"{r['unit']}/{r['impl']}/{r['op']}={r.get('ms', r.get('same', r['status']))}"
                                        for r in done), flush=True)


def permute_gemm_units(timer, case: Case, args, rows, table, inputs, base, reps, gemm, key):
    x, ids, w, dy = inputs
    rows.append(measure(timer, lambda a, i: _permute_call(a, i, case.G)[0], (x, ids), 0,
                        base | dict(unit="permute_gemm", impl="permute", op="fwd"), reps))
    rows.append(measure(timer, lambda a, i: permute_fp8_call(a, i, case.G)[:2], (x, ids), 0,
                        base | dict(unit="permute_gemm", impl="permute_fp8", op="fwd"), reps))
    for impl, fn in UNITS.items():
        rows.append(measure(timer, fn, (x, ids, w), gemm, base | dict(unit="permute_gemm", impl=impl, op="fwd"), reps))
        rows.append(measure(timer, fwd_bwd(fn), (x, ids, w, dy), 3 * gemm,
                            base | dict(unit="permute_gemm", impl=impl, op="fwd+bwd"), reps))
        write(rows, table, args)
    try:  # the fused forward is the op's forward bit for bit (the CPU tests prove it on the emulated path)
        same = bool(jnp.array_equal(jax.jit(UNITS["fp8_fused"])(x, ids, w), jax.jit(UNITS["fp8_op"])(x, ids, w)))
        rows.append(base | dict(unit="permute_gemm", impl="fp8_fused", op="fwd_equals_fp8_op", status="ok",
                                same=same))
    except Exception as e:
        rows.append(base | dict(unit="permute_gemm", impl="fp8_fused", op="fwd_equals_fp8_op",
                                status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"))
    quantize_group_columns_units(timer, case, rows, base, reps, key)
    write(rows, table, args)


def block_weights(case: Case, keys):
    """The whole expert block's inputs beside tokens and ids: D = K, gate/up (G, D, 2F), down (G, F, D), combine
    weights (T, k) and the output's cotangent (T, D)."""
    w_gate_up = jax.random.normal(keys[3], (case.G, case.K, 2 * case.F), jnp.bfloat16) / float(np.sqrt(case.K))
    w_down = jax.random.normal(keys[4], (case.G, case.F, case.K), jnp.bfloat16) / float(np.sqrt(case.F))
    combine_w = jax.nn.softmax(jax.random.normal(keys[5], (case.T, case.k)), axis=-1)
    return w_gate_up, w_down, combine_w, jnp.ones((case.T, case.K), jnp.bfloat16)


def block_units(timer, case: Case, args, rows, table, x, ids, base, reps, keys):
    w_gate_up, w_down, combine_w, dy = block_weights(case, keys)
    block_flops = 3 * 6.0 * case.M * case.K * case.F
    sets = {"turbo": "turbo", "fp8": "fp8", "fp8_wgrad_fp8": with_weight_grad("fp8"),
            "fp8_wgrad_bf16": with_weight_grad("bf16")}
    for impl, gemms in sets.items():
        if impl in args.block_impls:
            rows.append(measure(timer, block_fwd_bwd(gemms), (x, ids, combine_w, w_gate_up, w_down, dy), block_flops,
                                base | dict(unit="expert_block", impl=impl, op="fwd+bwd", F=case.F), reps))
            write(rows, table, args)
    prepared = (x, ids, combine_w, jax.jit(fp8_weights)(w_gate_up), jax.jit(fp8_weights)(w_down), dy)
    for impl, gemms in (("fp8_prepared", "fp8"), ("fp8_prepared_quantize_after", FP8_QUANTIZE_AFTER),
                        ("fp8_prepared_wgrad_bf16", with_weight_grad("bf16")),
                        ("fp8_prepared_wgrad_fp8", with_weight_grad("fp8"))):
        if impl in args.block_impls:
            rows.append(measure(timer, block_prepared_fwd_bwd(gemms), prepared, block_flops,
                                base | dict(unit="expert_block", impl=impl, op="fwd+bwd", F=case.F), reps))
            write(rows, table, args)
    del prepared
    layers = 2
    stacked = (jnp.stack([w_gate_up] * layers), jnp.stack([w_down] * layers))
    del w_gate_up, w_down
    for impl, gemms, prepared in (("turbo", "turbo", False), ("fp8", "fp8", False), ("fp8_prepared", "fp8", True)):
        if f"scan2_{impl}" not in args.block_impls:
            continue
        rows.append(measure(timer, block_scan_fwd_bwd(gemms, prepared), (x, ids, combine_w, *stacked, dy),
                            layers * block_flops,
                            base | dict(unit="expert_block_scan2", impl=impl, op="fwd+bwd", F=case.F), reps))
        write(rows, table, args)
    del stacked


def quantize_group_columns_units(timer, case: Case, rows, base, reps, key):
    sizes = jnp.asarray(routing_sizes("balanced", case.M, case.G), jnp.int32)
    for width in (case.K, case.N):
        x = jax.random.normal(key, (case.M, width), jnp.bfloat16)
        row = base | dict(unit="quantize_group_columns", op="fwd", C=width)
        for impl, fn in (("jnp", quantize_group_columns_xla), ("kernel", ops.quantize_group_columns)):
            rows.append(measure(timer, fn, (x, sizes), 0, row | dict(impl=impl), reps))
        try:
            (q, s), (q_ref, s_ref) = jax.jit(ops.quantize_group_columns)(x, sizes), jax.jit(quantize_group_columns_xla)(
                x, sizes)
            differ = np.asarray(q).view(np.uint8) != np.asarray(q_ref).view(np.uint8)
            rows.append(row | dict(impl="kernel", op="codes_differing_from_jnp", status="ok",
                                   same=f"{int(differ.sum())}/{differ.size}",
                                   scales_equal=bool(jnp.array_equal(s, s_ref))))
        except Exception as e:
            rows.append(row | dict(impl="kernel", op="codes_differing_from_jnp",
                                   status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"))
        del x


def summarize(rows) -> list[str]:
    ok = {(r["case"], r["unit"], r["impl"], r["op"]): r for r in rows if r.get("status") == "ok" and "ms" in r}
    lines = ["ms (speed-up against bf16):"]
    for case in dict.fromkeys(r["case"] for r in rows):
        for unit, op in (("permute_gemm", "fwd"), ("permute_gemm", "fwd+bwd"), ("expert_block", "fwd+bwd"),
                         ("expert_block_scan2", "fwd+bwd")):
            base = ok.get((case, unit, "turbo" if unit.startswith("expert_block") else "bf16", op))
            parts = []
            for (c, u, impl, o), r in ok.items():
                if (c, u, o) == (case, unit, op):
                    parts.append(f"{impl}={r['ms']:.3f}" + (f" ({base['ms'] / r['ms']:.2f}x)" if base else ""))
            lines.append(f"  {case:12s} {unit:13s} {op:8s} " + "  ".join(parts))
        for r in rows:
            if (r.get("case"), r.get("unit"), r.get("impl"), r.get("op")) == (case, "quantize_group_columns", "kernel",
                                                                                "fwd") and r.get("status") == "ok":
                jnp_row = next((j for j in rows if j.get("case") == case and j.get("unit") == r["unit"]
                                and j.get("impl") == "jnp" and j.get("C") == r["C"] and j.get("status") == "ok"), None)
                vs = f"  ({jnp_row['ms'] / r['ms']:.2f}x the jnp one's speed)" if jnp_row else ""
                jnp_ms = f"jnp={jnp_row['ms']:.3f}  " if jnp_row else ""
                lines.append(f"  {case:12s} quantize_group_columns C={r['C']:<5d} {jnp_ms}kernel={r['ms']:.3f}{vs}")
    return lines


def write(rows, table: Path, args) -> None:
    write_table_and_record(rows, table, f"warmup={args.warmup} reps={args.reps} median; balanced routing, shuffled; "
                                        "timer=cuda events on XLA stream; inputs bf16 N(0,1), w N(0,1/K)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "experiments" / "results")
    ap.add_argument("--cases", default=",".join(c.name for c in CASES), help="comma-separated: " +
                    ", ".join(c.name for c in CASES))
    ap.add_argument("--units", default="permute_gemm,expert_block", help="comma-separated: permute_gemm (with the "
                    "quantisers), expert_block (with the 2-layer scan)")
    ap.add_argument("--block-impls", default=",".join(BLOCK_IMPLS), help="comma-separated, of the expert_block "
                    f"unit: {', '.join(BLOCK_IMPLS)}")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    args.block_impls = args.block_impls.split(",")
    if set(args.block_impls) - set(BLOCK_IMPLS):
        raise SystemExit(f"--block-impls: unknown {sorted(set(args.block_impls) - set(BLOCK_IMPLS))}; expected some "
                         f"of {list(BLOCK_IMPLS)}")
    if jax.devices()[0].platform != "gpu":
        raise SystemExit("benchmarks/fp8_expert_path.py needs a GPU (JAX_PLATFORMS=cuda)")
    wanted = args.cases.split(",")
    unknown = set(wanted) - {c.name for c in CASES}
    if unknown:
        raise SystemExit(f"--cases: unknown {sorted(unknown)}; expected some of {[c.name for c in CASES]}")
    args.out.mkdir(parents=True, exist_ok=True)
    table = args.out / f"fp8_expert_path_{jax.devices()[0].device_kind.replace(' ', '_')}.csv"
    rows: list[dict] = []
    timer = EventTimer()
    for case in CASES:
        if case.name in wanted:
            run_case(timer, case, args, rows, table)
    print("\n".join(summarize(rows)))
    print(f"wrote {table} and {table.with_suffix('.json')}")


if __name__ == "__main__":
    main()
