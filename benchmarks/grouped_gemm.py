"""Grouped GEMM and permute/unpermute benchmark on one GPU (not a test).

For each shape x routing it times, with CUDA events recorded on XLA's own stream (warm-up, then
the median of many calls), the forward, dgrad and wgrad of
  turbo       turbo_moe.ops (the CUDA FFI kernels),
  pallas      jax.experimental.pallas.ops.gpu ragged_dot_mgpu / transposed_ragged_dot_mgpu,
  ragged_dot  jax.lax.ragged_dot (a few shapes only: it expands densely and is slow),
  dense       one cuBLAS GEMM with the same FLOPs (the practical ceiling),
with the extra device memory from the compiled memory analysis (turbo's workspace is a result there),
and permute/unpermute bandwidth against a device-to-device copy. Writes
experiments/results/kernels_<device>.csv with provenance columns and prints a short table.

    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/grouped_gemm.py [--quick]
"""
from __future__ import annotations

import argparse
import ctypes
import csv
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import jax
import jax.numpy as jnp

from turbo_moe import ops
from turbo_moe.provenance import TABLE_COLUMNS
from turbo_moe.provenance import collect as collect_provenance
from turbo_moe.ops import _ffi
from turbo_moe.shapes import DEEPSEEK_V2_LITE, DEEPSEEK_V3, REDUCED

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shape:
    name: str
    M: int
    K: int
    N: int
    G: int

    @property
    def flops(self) -> float:
        return 2.0 * self.M * self.K * self.N


def deepseek_shapes(quick: bool) -> list[Shape]:
    shapes = []
    v3, lite, red = DEEPSEEK_V3, DEEPSEEK_V2_LITE, REDUCED
    for G in (v3.local_experts(8), v3.n_experts):  # expert parallelism 8, and every expert on one device
        for M in (4096 * v3.top_k, 8192 * v3.top_k):
            shapes += [Shape(f"dsv3_gate_up_G{G}_M{M}", M, v3.d_model, v3.moe_ffn_dim, G),
                       Shape(f"dsv3_fused_gate_up_G{G}_M{M}", M, v3.d_model, 2 * v3.moe_ffn_dim, G),
                       Shape(f"dsv3_down_G{G}_M{M}", M, v3.moe_ffn_dim, v3.d_model, G)]
    M = 65536
    shapes.append(Shape(f"dsv2_lite_G{lite.n_experts}_M{M}", M, lite.d_model, lite.moe_ffn_dim, lite.n_experts))
    # `reduced`: batch 8 x 2048 and 4 x 2048 tokens, fused gate_up
    for M in (8 * 2048 * red.top_k, 4 * 2048 * red.top_k):
        shapes += [Shape(f"reduced_gate_up_G{red.n_experts}_M{M}", M, red.d_model, 2 * red.moe_ffn_dim, red.n_experts),
                   Shape(f"reduced_down_G{red.n_experts}_M{M}", M, red.moe_ffn_dim, red.d_model, red.n_experts)]
    if quick:
        shapes = [s for s in shapes if s.name in ("dsv3_gate_up_G32_M32768", "dsv3_down_G256_M32768",
                                                  "dsv2_lite_G64_M65536")]
    return shapes


def routing_sizes(routing: str, M: int, G: int, seed: int = 0) -> np.ndarray:
    """Group sizes summing to M."""
    if routing == "balanced":
        sizes = np.full(G, M // G, np.int64)
    elif routing == "skewed":  # Dirichlet(alpha=2): a few experts take most rows
        p = np.random.default_rng(seed).dirichlet(np.ones(G) * 2.0)
        sizes = np.floor(p * M).astype(np.int64)
    elif routing == "one_group":
        sizes = np.zeros(G, np.int64)
    elif routing == "half_empty":
        sizes = np.zeros(G, np.int64)
        sizes[::2] = M // len(sizes[::2])
    else:
        raise ValueError(f"unknown routing {routing!r}")
    sizes[0] += M - sizes.sum()
    return sizes.astype(np.int32)


# ---- timing with CUDA events on XLA's stream ------------------------------------------------------
BENCH_LIBRARY = "libturbo_moe_cuda_bench.so"  # kernels/cuda/bench_timer.cu, built beside the CUDA kernels


class EventTimer:
    """Brackets a jitted region with turbo_moe_bench_event markers (kernels/cuda/bench_timer.cu)."""

    def __init__(self):
        path = _ffi.find_library(BENCH_LIBRARY)
        if path is None:
            searched = ", ".join(str(d) for d in _ffi.library_dirs())
            raise RuntimeError(f"{BENCH_LIBRARY} not found (searched: {searched}): build the CUDA kernels with nvcc "
                               f"present (`make cuda` puts it in build/cuda/lib beside libturbo_moe_cuda.so)")
        self.lib = ctypes.CDLL(str(path))
        self.lib.turbo_moe_bench_elapsed_ms.restype = ctypes.c_float
        for name in ("turbo_moe_bench_event", "turbo_moe_bench_copy"):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(self.lib, name)), platform="CUDA")

    def _mark(self, anchor, slot):
        call = jax.ffi.ffi_call("turbo_moe_bench_event", jax.ShapeDtypeStruct((1,), jnp.int32),
                                has_side_effect=True)
        return call(anchor, slot=np.int64(slot))

    def timed_jit(self, fn):
        def region(*args):
            start = self._mark(args[0], 0)
            start, args = jax.lax.optimization_barrier((start, args))  # fn's inputs wait for `start`
            out = fn(*args)
            leaves = jax.lax.optimization_barrier(jax.tree.leaves(out))  # `end` waits for every output
            end = self._mark(leaves[0], 1)
            return out, start, end
        return jax.jit(region)

    def time_ms(self, fn, args, warmup: int, reps: int) -> tuple[float, float]:
        """(median ms, temporaries in MiB) of fn(*args); one compile serves both."""
        compiled = self.timed_jit(fn).lower(*args).compile()
        temp_mib = compiled.memory_analysis().temp_size_in_bytes / 2**20
        samples = []
        for i in range(warmup + reps):
            out = compiled(*args)
            jax.block_until_ready(out)  # raises if the run failed (e.g. out of memory): no stale events
            ms = self.lib.turbo_moe_bench_elapsed_ms(0, 1)
            if ms < 0:
                raise RuntimeError(f"event timing failed ({ms})")
            if i >= warmup:
                samples.append(ms)
            del out
        return float(np.median(samples)), temp_mib

    def copy(self, x):
        """A device-to-device cudaMemcpyAsync of x (kernels/cuda/bench_timer.cu)."""
        return jax.ffi.ffi_call("turbo_moe_bench_copy", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


# ---- implementations -------------------------------------------------------------------------------
def turbo_fns():
    return {"fwd": lambda x, w, dy, gs: ops.grouped_gemm(x, w, gs),
            "dgrad": lambda x, w, dy, gs: ops.grouped_gemm(dy, w, gs, transpose_rhs=True),
            "wgrad": lambda x, w, dy, gs: ops.grouped_gemm_weight_grad(x, dy, gs)}


def pallas_fns():
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    cfg = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=8)
    return {"fwd": lambda x, w, dy, gs: ragged_dot_mgpu.ragged_dot(x, w, group_sizes=gs, **cfg),
            "dgrad": lambda x, w, dy, gs: ragged_dot_mgpu.ragged_dot(dy, w, group_sizes=gs, transpose_rhs=True,
                                                                     **cfg),
            "wgrad": lambda x, w, dy, gs: transposed_ragged_dot_mgpu.transposed_ragged_dot(
                x, dy, group_sizes=gs, **cfg)}


def ragged_fns():
    return {"fwd": lambda x, w, dy, gs: jax.lax.ragged_dot(x, w, gs)}


def dense_fns():
    # Same FLOPs as the grouped op: one (M, K) x (K, N) GEMM and its two transposed products.
    # w0 is one expert's (K, N) weight, passed in place of the grouped weights.
    return {"fwd": lambda x, w0, dy, gs: x @ w0,
            "dgrad": lambda x, w0, dy, gs: dy @ w0.T,
            "wgrad": lambda x, w0, dy, gs: x.T @ dy}


# Where jax.lax.ragged_dot runs: it expands to G x the FLOPs and a G x-sized temporary.
RAGGED_DOT_CASES = {("dsv2_lite_G64_M65536", "balanced"), ("dsv2_lite_G64_M65536", "skewed"),
                    ("dsv3_gate_up_G32_M32768", "skewed")}


def min_bytes(shape: Shape, op: str) -> float:
    """bf16 bytes an op must move at least: each input read once, the output written once."""
    M, K, N, G = shape.M, shape.K, shape.N, shape.G
    return 2.0 * {"fwd": M * K + G * K * N + M * N, "dgrad": M * N + G * K * N + M * K,
                  "wgrad": M * K + M * N + G * K * N}[op]


def bound_tflops(shape: Shape, op: str, dense_tflops: float, copy_gbps: float) -> float:
    """Roofline of the grouped op: the dense GEMM's rate, or moving min_bytes at copy bandwidth."""
    floor_ms = max(shape.flops / dense_tflops / 1e9, min_bytes(shape, op) / copy_gbps / 1e6)
    return shape.flops / floor_ms / 1e9


def copy_bandwidth(timer, args) -> float:
    """GB/s (bytes read + written) of a 4 GiB device-to-device copy."""
    y = jnp.zeros((2**31,), jnp.bfloat16) + 1
    ms, _ = timer.time_ms(timer.copy, (y,), args.warmup, args.reps)
    return 2 * y.size * 2 / ms / 1e6


def run_gemms(timer, shapes, routings, args, rows):
    key = jax.random.PRNGKey(0)
    copy_gbps = copy_bandwidth(timer, args)
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s", flush=True)
    for shape in shapes:
        k1, k2, k3 = jax.random.split(jax.random.fold_in(key, shape.M * shape.N + shape.G), 3)
        x = jax.random.normal(k1, (shape.M, shape.K), jnp.bfloat16)
        # Draw 32 experts and tile them: drawing all 256 at once materialises G*K*N uint32 random
        # bits (30 GB for the fused G=256 shape), more than an H100 has to spare.
        chunk = min(shape.G, 32)
        w = jax.random.normal(k2, (chunk, shape.K, shape.N), jnp.bfloat16) * 0.02
        w = jnp.tile(w, (shape.G // chunk, 1, 1)) if shape.G > chunk else w
        dy = jax.random.normal(k3, (shape.M, shape.N), jnp.bfloat16)
        base = dict(shape=shape.name, M=shape.M, K=shape.K, N=shape.N, G=shape.G)
        w0, gs = w[0], jnp.asarray(routing_sizes("balanced", shape.M, shape.G))
        dense_rate = {}
        for op, fn in dense_fns().items():  # routing-independent
            rows.append(measure(timer, fn, (x, w0, dy, gs), shape, args, base | dict(routing="-", op=op,
                                                                                      impl="dense")))
            dense_rate[op] = rows[-1].get("tflops")
        for routing in routings:
            gs = jnp.asarray(routing_sizes(routing, shape.M, shape.G))
            inputs = (x, w, dy, gs)
            for op, fn in turbo_fns().items():
                dense = dense_rate.get(op)
                bound = round(bound_tflops(shape, op, dense, copy_gbps), 1) if dense else ""
                rows.append(measure(timer, fn, inputs, shape, args,
                                    base | dict(routing=routing, op=op, impl="turbo", bound_tflops=bound)))
            if routing in ("balanced", "skewed") and not args.skip_pallas:
                for op, fn in pallas_fns().items():
                    rows.append(measure(timer, fn, inputs, shape, args,
                                        base | dict(routing=routing, op=op, impl="pallas")))
            for op, fn in ragged_fns().items():
                row = base | dict(routing=routing, op=op, impl="ragged_dot")
                if (shape.name, routing) in RAGGED_DOT_CASES and not args.skip_ragged:
                    rows.append(measure(timer, fn, inputs, shape, args, row, reps=max(3, args.reps // 4)))
                else:
                    rows.append(row | dict(status="skipped: dense expansion needs ~G x the FLOPs and a "
                                                  "G x-sized temporary (slow / OOM); timed on 3 cases only"))
            print_progress(rows, shape.name, routing)
        del x, w, w0, dy


def measure(timer, fn, inputs, shape, args, row, reps=None):
    try:
        ms, temp = timer.time_ms(fn, inputs, args.warmup, reps or args.reps)
        return row | dict(ms=round(ms, 4), tflops=round(shape.flops / ms / 1e9, 1),
                          extra_mib=round(temp, 3), status="ok")
    except Exception as e:  # a baseline that does not run on this shape is recorded, not fatal
        return row | dict(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}")


def print_progress(rows, shape, routing):
    done = [r for r in rows if r.get("shape") == shape and r.get("routing") == routing and r.get("status") == "ok"]
    txt = "  ".join(f"{r['impl']}/{r['op']}={r['tflops']}" for r in done)
    print(f"[{shape} {routing}] {txt}", flush=True)


# ---- permute / unpermute bandwidth -------------------------------------------------------------------
def run_permute(timer, args, rows):
    for T, shape in ((32768, DEEPSEEK_V3), (65536, DEEPSEEK_V2_LITE), (16384, REDUCED)):
        H, k, E = shape.d_model, shape.top_k, shape.n_experts
        kx, ki, kw = jax.random.split(jax.random.PRNGKey(T + H), 3)
        x = jax.random.normal(kx, (T, H), jnp.bfloat16)
        ids = jax.random.randint(ki, (T, k), 0, E, jnp.int32)
        wts = jax.random.uniform(kw, (T, k), jnp.float32)
        _, _, handle = jax.jit(ops.permute, static_argnums=2)(x, ids, E)
        y_sorted = jax.random.normal(kx, (T * k, H), jnp.bfloat16)
        esize = 2
        base = dict(shape=f"T{T}_H{H}_k{k}_E{E}", M=T * k, K=H, N=k, G=E, routing="uniform")
        # Fewest bytes each op must move (inputs read once, outputs written once).
        cases = {
            "permute": (lambda a, i: ops.permute(a, i, E), (x, ids), (T + T * k) * H * esize),
            "unpermute": (lambda y, r, w: ops.unpermute(y, ops.PermuteHandle(r), w), (y_sorted, handle.row_index, wts),
                          (T * k + T) * H * esize),
            "unpermute_bwd": (lambda y, r, w, g: jax.vjp(lambda a, b: ops.unpermute(a, ops.PermuteHandle(r), b), y, w)[1](g),
                              (y_sorted, handle.row_index, wts, x), (T + 2 * T * k) * H * esize),
            "copy": (timer.copy, (y_sorted,), 2 * T * k * H * esize),
        }
        for op, (fn, inputs, nbytes) in cases.items():
            row = base | dict(op=op, impl="copy" if op == "copy" else "turbo")
            try:
                ms, temp = timer.time_ms(fn, inputs, args.warmup, args.reps)
                rows.append(row | dict(ms=round(ms, 4), gbps=round(nbytes / ms / 1e6, 1),
                                       extra_mib=round(temp, 3), status="ok"))
            except Exception as e:
                rows.append(row | dict(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"))
        print(f"[permute {base['shape']}] " + "  ".join(f"{r['op']}={r.get('gbps')}GB/s" for r in rows[-4:]),
              flush=True)


# ---- report ----------------------------------------------------------------------------------------------
def provenance(args) -> dict:
    """The table columns of the package's provenance schema, which grouped GEMM the library holds, and
    how this benchmark timed."""
    prov = collect_provenance()
    return {**{k: prov[k] for k in TABLE_COLUMNS}, "grouped_gemm": prov["grouped_gemm"],
            "params": f"bf16 warmup={args.warmup} reps={args.reps} median; skewed=Dirichlet(2) seed 0; "
                      "timer=cuda events on XLA stream"}


def geomean(xs):
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def summarize(rows) -> list[str]:
    ok = [r for r in rows if r.get("status") == "ok" and "tflops" in r]
    get = lambda impl, op, shape, routing: next((r["tflops"] for r in ok if r["impl"] == impl and r["op"] == op and
                                                 r["shape"] == shape and r["routing"] == routing), None)
    ds = sorted({r["shape"] for r in ok if r["shape"].startswith("dsv3")})
    lines = ["target summary (bf16, DeepSeek-V3 shapes, balanced routing, geomean):"]
    for op, target in (("fwd", 0.90), ("dgrad", 0.90), ("wgrad", 0.80)):
        ratios = [get("turbo", op, s, "balanced") / get("dense", op, s, "-") for s in ds
                  if get("turbo", op, s, "balanced") and get("dense", op, s, "-")]
        pallas = [get("turbo", op, s, "balanced") / get("pallas", op, s, "balanced") for s in ds
                  if get("turbo", op, s, "balanced") and get("pallas", op, s, "balanced")]
        skew = [get("turbo", op, s, "skewed") / get("turbo", op, s, "balanced") for s in ds
                if get("turbo", op, s, "skewed") and get("turbo", op, s, "balanced")]
        bound = [r["tflops"] / r["bound_tflops"] for r in ok if r["impl"] == "turbo" and r["op"] == op
                 and r["routing"] == "balanced" and r["shape"] in ds and r.get("bound_tflops")]
        lines.append(f"  {op:6s} turbo/dense={geomean(ratios):.3f} (target {target})  turbo/roofline={geomean(bound):.3f}  "
                     f"turbo/pallas={geomean(pallas):.2f} "
                     f"(target 1.5)  skewed/balanced={geomean(skew):.3f} (target >= 0.9)")
    temps = [r["extra_mib"] for r in ok if r["impl"] == "turbo" and "extra_mib" in r and r["op"] in ("fwd", "dgrad", "wgrad")]
    if temps:
        lines.append(f"  turbo temporaries: max {max(temps):.3f} MiB (target <= 1 MiB)")
    perm = {(r["shape"], r["op"]): r.get("gbps") for r in rows if r.get("status") == "ok" and "gbps" in r}
    for shape in sorted({s for s, _ in perm}):
        c = perm.get((shape, "copy"))
        if c:
            lines.append(f"  {shape}: permute/copy={perm.get((shape, 'permute'), 0) / c:.2f} "
                         f"unpermute/copy={perm.get((shape, 'unpermute'), 0) / c:.2f} "
                         f"unpermute_bwd/copy={perm.get((shape, 'unpermute_bwd'), 0) / c:.2f} (target 0.8; copy {c} GB/s)")
    return lines


def print_table(rows):
    ok = [r for r in rows if r.get("status") == "ok" and "tflops" in r]
    print(f"\n{'shape':32s} {'routing':10s} {'op':6s} {'turbo':>7s} {'dense':>7s} {'pallas':>7s} {'ragged':>7s} "
          f"{'t/dense':>7s} {'bound':>7s} {'t/bound':>7s} {'tmpMiB':>7s}")
    keys = sorted({(r["shape"], r["routing"], r["op"]) for r in ok if r["impl"] == "turbo"})
    for shape, routing, op in keys:
        val = lambda impl, rt=routing: next((r for r in ok if r["impl"] == impl and r["op"] == op and r["shape"] == shape
                                             and r["routing"] == rt), None)
        t, d, p, g = val("turbo"), val("dense", "-"), val("pallas"), val("ragged_dot")
        fmt = lambda r: f"{r['tflops']:7.1f}" if r else f"{'-':>7s}"
        ratio = f"{t['tflops'] / d['tflops']:7.3f}" if t and d else f"{'-':>7s}"
        b = t.get("bound_tflops")
        rb = f"{t['tflops'] / b:7.3f}" if b else f"{'-':>7s}"
        bs = f"{b:7.1f}" if b else f"{'-':>7s}"
        print(f"{shape:32s} {routing:10s} {op:6s} {fmt(t)} {fmt(d)} {fmt(p)} {fmt(g)} {ratio} {bs} {rb} "
              f"{t['extra_mib']:7.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three shapes only")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--routings", default="balanced,skewed,one_group,half_empty")
    parser.add_argument("--skip-pallas", action="store_true")
    parser.add_argument("--skip-ragged", action="store_true")
    parser.add_argument("--skip-permute", action="store_true")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    parser.add_argument("--out", default=None, help="CSV path (default experiments/results/kernels_<device>.csv)")
    args = parser.parse_args()

    if "CUDA" not in ops.ensure_registered():
        raise SystemExit("no CUDA device / CUDA kernels: this benchmark runs on a GPU machine")
    timer = EventTimer()
    prov = provenance(args)
    print(prov, flush=True)
    rows: list[dict] = []
    t0 = time.time()
    shapes = deepseek_shapes(args.quick)
    if args.shapes:
        shapes = [s for s in shapes if s.name in args.shapes.split(",")]
    run_gemms(timer, shapes, args.routings.split(","), args, rows)
    if not args.skip_permute:
        run_permute(timer, args, rows)
    device_tag = prov["device_kind"].lower().replace(" ", "_").replace("nvidia_", "")
    out = Path(args.out) if args.out else REPO / "experiments" / "results" / f"kernels_{device_tag}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = [*TABLE_COLUMNS, "grouped_gemm", "params", "shape", "M", "K", "N", "G", "routing", "op", "impl",
              "ms", "tflops", "bound_tflops", "gbps", "extra_mib", "status"]
    with open(out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for r in rows:
            writer.writerow({f: (prov | r).get(f, "") for f in fields})
    print_table(rows)
    print("\n".join(summarize(rows)))
    print(f"wrote {out} ({len(rows)} rows, {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
