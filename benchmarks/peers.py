"""turbo's grouped GEMM against the kernels a JAX user could pick instead: one process, one GPU, the same inputs.

Contenders (each a row per shape x routing x mode; one that cannot run is a row with its status and reason):
  turbo                  turbo_moe.ops.grouped_gemm (gradients through its transpose rules: turbo kernels)
  turbo_fp8              turbo_moe.ops.grouped_gemm_fp8 as a user calls it (E4M3, DeepSeek-V3's 1x128 / 128x128
                         scales, quantisation included); ours, so not a peer in "turbo / fastest peer"; where K, N
                         are multiples of 128; held to --fp8-tol, not --tol
  tokamax_mosaic         tokamax.ragged_dot(implementation="mosaic"): the Pallas Mosaic-GPU kernel (sm90), default
  tokamax_triton         tokamax.ragged_dot(implementation="triton"), default config (needs jax_triton)
  tokamax_*_tuned        the same after tokamax.autotune on these inputs (a second pass, while time is left)
  te_grouped_gemm        transformer-engine-jax's grouped GEMM, where it is installed
  ragged_dot             jax.lax.ragged_dot (XLA; skipped where its dense expansion is too large)
  dense                  one cuBLAS GEMM (jnp.matmul) of the same FLOPs: the ceiling, not a MoE kernel
Modes: fwd (y = x @ w[g]) and fwd_bwd (y and the gradients of both operands, for a given dy).
Correctness: each MoE contender's y (and dx, dw) against a float32 reference on a sample of groups (max error
relative to the largest reference value), recorded with the row; a contender off by more than --tol is 'wrong'.
Each finished row is appended to <out>.csv and <out>.json (with provenance) at once; then a table (with
turbo / fastest peer) and a seaborn figure <out>.png.

    PYTHONPATH=$PWD python benchmarks/peers.py --out $OUT/peers            # GPU
    PYTHONPATH=$PWD python benchmarks/peers.py --smoke --out /tmp/peers    # CPU check: tiny shapes
"""
from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

import jax
import jax.numpy as jnp

from turbo_moe import ops
from turbo_moe.shapes import DEEPSEEK_V3, GPT_OSS_120B, MIXTRAL_8X7B, QWEN3_30B_A3B, REDUCED
from turbo_moe.provenance import TABLE_COLUMNS, package_version
from turbo_moe.provenance import collect as collect_provenance

TE_UNAVAILABLE = ("transformer-engine-jax 2.20.2 is published on PyPI as an sdist only (it compiles against the TE "
                  "core, whose transformer-engine-cu13 2.20.2 wheel is 264 MiB: over the 64 MiB a GPU call carries; "
                  "the GPU machine has no internet)")
MOE_CONTENDERS = ("turbo", "turbo_fp8", "tokamax_mosaic", "tokamax_triton", "te_grouped_gemm", "ragged_dot")
OURS = ("turbo", "turbo_fp8", "dense")  # not peers: "turbo / fastest peer" compares turbo with the others
FP8_BLOCK = 128
RAGGED_DOT_MAX_TFLOP = 8.0  # jax.lax.ragged_dot expands densely on GPUs (G x the FLOPs, GBs of temporaries): skip past this
FIELDS = [*TABLE_COLUMNS, "shape", "model", "G", "M", "K", "N", "routing", "mode", "contender", "status", "ms",
          "tflops", "rel_err", "extra_mib", "tune_s", "error"]


@dataclass(frozen=True)
class Shape:
    name: str
    model: str
    G: int
    M: int  # rows = tokens x top_k
    K: int
    N: int

    def flops(self, mode: str) -> float:
        return (2.0 if mode == "fwd" else 6.0) * self.M * self.K * self.N


def full_shapes() -> list[Shape]:
    """Expert GEMMs of public MoE models (gate and up are separate GEMMs of width N unless fused)."""
    v3, qwen, gpt, mixtral, red = DEEPSEEK_V3, QWEN3_30B_A3B, GPT_OSS_120B, MIXTRAL_8X7B, REDUCED
    return [
        Shape("dsv3_gate_G256", f"DeepSeek-V3 ({v3.n_experts} experts, top-{v3.top_k}, 4096 tokens)", v3.n_experts,
              4096 * v3.top_k, v3.d_model, v3.moe_ffn_dim),
        Shape("dsv3_down_G256", "DeepSeek-V3 down proj", v3.n_experts, 4096 * v3.top_k, v3.moe_ffn_dim, v3.d_model),
        Shape("dsv3_gate_ep8_G32", f"DeepSeek-V3, EP=8: {v3.local_experts(8)} local experts", v3.local_experts(8),
              4096 * v3.top_k, v3.d_model, v3.moe_ffn_dim),
        Shape("qwen3_30b_gate_G128", f"Qwen3-30B-A3B ({qwen.n_experts} experts, top-{qwen.top_k})", qwen.n_experts,
              4096 * qwen.top_k, qwen.d_model, qwen.moe_ffn_dim),
        Shape("qwen3_30b_down_G128", "Qwen3-30B-A3B down proj", qwen.n_experts, 4096 * qwen.top_k, qwen.moe_ffn_dim,
              qwen.d_model),
        Shape("gpt_oss_120b_gate_up_G128", f"gpt-oss-120b ({gpt.n_experts} experts, top-{gpt.top_k}; fused gate_up "
              f"2x{gpt.moe_ffn_dim})", gpt.n_experts, 4096 * gpt.top_k, gpt.d_model, 2 * gpt.moe_ffn_dim),
        Shape("mixtral_8x7b_gate_G8", f"Mixtral 8x7B ({mixtral.n_experts} experts, top-{mixtral.top_k})",
              mixtral.n_experts, 4096 * mixtral.top_k, mixtral.d_model, mixtral.moe_ffn_dim),
        Shape("reduced_gate_up_G64", f"turbo_moe `reduced` preset (fused gate_up 2x{red.moe_ffn_dim}, top-{red.top_k})",
              red.n_experts, 4 * 2048 * red.top_k, red.d_model, 2 * red.moe_ffn_dim),
        Shape("reduced_down_G64", "turbo_moe `reduced` down proj", red.n_experts, 4 * 2048 * red.top_k,
              red.moe_ffn_dim, red.d_model),
        Shape("odd_G16", "odd sizes: K, N not multiples of 64", 16, 10000, 1000, 1500),
    ]


def smoke_shapes() -> list[Shape]:
    return [Shape("smoke_G4", "smoke", 4, 64, 32, 48), Shape("smoke_odd_G3", "smoke, odd", 3, 50, 20, 36),
            Shape("smoke_fp8_G3", "smoke, FP8 widths", 3, 40, 128, 256)]


def routing_sizes(routing: str, M: int, G: int, seed: int = 0) -> np.ndarray:
    """int32 group sizes summing to M. skewed: Zipf (exponent 1) over a random order of the experts."""
    if routing == "balanced":
        p = np.full(G, 1.0 / G)
    elif routing == "skewed":
        rng = np.random.default_rng(seed)
        p = 1.0 / np.arange(1, G + 1)
        p = rng.permutation(p / p.sum())
    else:
        raise ValueError(f"--routings: unknown routing {routing!r} (expected balanced or skewed)")
    sizes = np.floor(p * M).astype(np.int64)
    sizes[np.argmax(sizes)] += M - sizes.sum()
    return sizes.astype(np.int32)


# ---- contenders: fn(x, w, gs, sizes) -> y, with `sizes` the static host copy of gs ---------------------------------
def _tokamax(implementation: str):
    import tokamax  # noqa: PLC0415  (optional peer)

    def fn(x, w, gs, sizes):
        group_sizes = tokamax.RaggedDotGroupSizes(gs, [int(s) for s in sizes])  # the real distribution, for tuning
        return tokamax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype, implementation=implementation)
    return fn


def contenders(platform: str) -> dict[str, tuple[Callable | None, str]]:
    """name -> (fn, '') or (None, reason it cannot run here)."""
    out: dict[str, tuple[Callable | None, str]] = {
        "turbo": (lambda x, w, gs, sizes: ops.grouped_gemm(x, w, gs), ""),
        "turbo_fp8": (lambda x, w, gs, sizes: ops.grouped_gemm_fp8(x, w, gs), ""),
        "ragged_dot": (lambda x, w, gs, sizes: jax.lax.ragged_dot(x, w, gs), ""),
    }
    try:
        import tokamax  # noqa: F401, PLC0415
        from tokamax._src.ops.ragged_dot import api as tokamax_api  # noqa: PLC0415
        impls = set(tokamax_api.IMPLEMENTATIONS)
    except Exception as e:  # noqa: BLE001 (an optional peer that does not import is a row, not a crash)
        impls, err = set(), f"tokamax does not import: {type(e).__name__}: {e}"
    else:
        err = ""
    for name, impl, needs in (("tokamax_mosaic", "mosaic", "mosaic_gpu"), ("tokamax_triton", "triton", "triton")):
        if err:
            out[name] = (None, err)
        elif platform != "gpu":
            out[name] = (None, f"tokamax's {impl} kernel needs an NVIDIA GPU (platform here: {platform})")
        elif needs not in impls:
            hint = " (jax_triton missing?)" if impl == "triton" else ""
            out[name] = (None, f"tokamax {package_version('tokamax')} has no {needs} implementation here{hint}: "
                               f"{sorted(impls)}")
        else:
            out[name] = (_tokamax(impl), "")
    try:
        import transformer_engine.jax  # noqa: F401, PLC0415
        out["te_grouped_gemm"] = (None, "transformer_engine.jax imports, but peers.py has no wiring for its grouped "
                                        "GEMM yet")
    except Exception:  # noqa: BLE001
        out["te_grouped_gemm"] = (None, TE_UNAVAILABLE)
    return out


def with_grads(fn):
    """(x, w, gs, dy) -> (y, dx, dw) of fn, for a given output cotangent dy."""
    def fwd_bwd(x, w, gs, dy, sizes):
        y, vjp = jax.vjp(lambda a, b: fn(a, b, gs, sizes), x, w)
        return (y, *vjp(dy))
    return fwd_bwd


def timed_fn(fn, mode: str, sizes):
    """The function a measurement jits: (x, w, gs) -> y for fwd, (x, w, gs, dy) -> (y, dx, dw) for fwd_bwd."""
    if mode == "fwd":
        return lambda x, w, gs: fn(x, w, gs, sizes)
    grads = with_grads(fn)
    return lambda x, w, gs, dy: grads(x, w, gs, dy, sizes)


def dense_fns():
    """One (M, K) x (K, N) GEMM and its two gradient products: the FLOPs of the grouped op (w0 = one expert)."""
    def fwd(x, w0):
        return x @ w0

    def fwd_bwd(x, w0, dy):
        y, vjp = jax.vjp(fwd, x, w0)
        return (y, *vjp(dy))
    return fwd, fwd_bwd


# ---- timing ------------------------------------------------------------------------------------------------------
class Timer:
    """Compiles fn once, runs it warmup + reps times; returns (median ms, temporaries MiB, the first call's outputs)
    so the correctness check needs no second compile. On GPUs the time is CUDA events on XLA's stream
    (benchmarks/grouped_gemm.py EventTimer); elsewhere the wall clock around block_until_ready."""

    def __init__(self, platform: str):
        self.events = None
        if platform == "gpu":
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from grouped_gemm import EventTimer  # noqa: PLC0415
            self.events = EventTimer()

    def run(self, fn, args, warmup: int, reps: int):
        compiled = (self.events.timed_jit(fn) if self.events else jax.jit(fn)).lower(*args).compile()
        mem = compiled.memory_analysis()
        temp = mem.temp_size_in_bytes / 2**20 if mem else 0.0
        samples, first = [], None
        for i in range(warmup + reps):
            t0 = time.perf_counter()
            out = compiled(*args)
            jax.block_until_ready(out)  # raises if the run failed (e.g. out of memory)
            ms = (time.perf_counter() - t0) * 1e3
            if self.events:
                out, ms = out[0], self.events.lib.turbo_moe_bench_elapsed_ms(0, 1)
                if ms < 0:
                    raise RuntimeError(f"event timing failed ({ms})")
            if i == 0:
                first = out
            del out
            if i >= warmup:
                samples.append(ms)
        return float(np.median(samples)), temp, first


# ---- correctness: float32 reference on a sample of groups --------------------------------------------------------
def sample_groups(sizes: np.ndarray, n: int = 6) -> list[int]:
    nonempty = np.flatnonzero(sizes > 0)
    order = nonempty[np.argsort(sizes[nonempty])]
    picks = {int(order[0]), int(order[-1]), int(order[len(order) // 2])}
    picks |= {int(g) for g in np.random.default_rng(1).choice(nonempty, min(n, len(nonempty)), replace=False)}
    return sorted(picks)[:n + 3]


def relative_error(outs, x, w, dy, sizes) -> float:
    """max |got - ref| / max |ref| over y (rows of sampled groups) and, given, dx and dw (whole sampled groups)."""
    hi = jax.lax.Precision.HIGHEST
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    errs, scales = [], []
    for g in sample_groups(sizes):
        s, e = int(starts[g]), int(starts[g] + sizes[g])
        rows = np.unique([s, (s + e) // 2, e - 1])
        wg = w[g].astype(jnp.float32)
        pairs = [(outs[0][rows], jnp.matmul(x[rows].astype(jnp.float32), wg, precision=hi))]
        if len(outs) == 3:
            pairs.append((outs[1][rows], jnp.matmul(dy[rows].astype(jnp.float32), wg.T, precision=hi)))
            pairs.append((outs[2][g], jnp.matmul(x[s:e].astype(jnp.float32).T, dy[s:e].astype(jnp.float32),
                                                 precision=hi)))
        for got, ref in pairs:
            errs.append(float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref))))
            scales.append(float(jnp.max(jnp.abs(ref))))
    return max(errs) / max(max(scales), 1e-30)


# ---- the run -----------------------------------------------------------------------------------------------------
class Recorder:
    """Appends each row to <out>.csv and rewrites <out>.json (provenance + rows) as it goes."""

    def __init__(self, out: Path, prov: dict, fields=tuple(FIELDS)):
        self.csv, self.json, self.prov, self.rows = out.with_suffix(".csv"), out.with_suffix(".json"), prov, []
        self.fields = list(fields)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(self.csv, "w", newline="") as fh:
            csv.DictWriter(fh, fieldnames=self.fields).writeheader()

    def add(self, row: dict) -> dict:
        row = {k: self.prov.get(k, "") for k in TABLE_COLUMNS} | row
        self.rows.append(row)
        with open(self.csv, "a", newline="") as fh:
            csv.DictWriter(fh, fieldnames=self.fields, extrasaction="ignore").writerow(row)
        self.json.write_text(json.dumps({"provenance": self.prov, "rows": self.rows}, indent=1, default=str))
        shown = {k: row.get(k) for k in self.fields if k not in TABLE_COLUMNS}
        print(" ".join(f"{k}={v}" for k, v in shown.items() if v not in (None, "")), flush=True)
        return row


def error_text(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def inputs_for(shape: Shape, seed: int = 0):
    kx, kw, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (shape.M, shape.K), jnp.bfloat16)
    chunk = min(shape.G, 32)  # tile 32 drawn experts: drawing G*K*N bits at once costs 4x the weights in memory
    w = (jax.random.normal(kw, (chunk, shape.K, shape.N), jnp.float32) / math.sqrt(shape.K)).astype(jnp.bfloat16)
    w = jnp.tile(w, (-(-shape.G // chunk), 1, 1))[:shape.G]
    dy = jax.random.normal(kd, (shape.M, shape.N), jnp.bfloat16)
    return x, w, dy


class Bench:
    def __init__(self, args, rec: Recorder, timer, peers):
        self.args, self.rec, self.timer, self.peers = args, rec, timer, peers
        self.deadline = time.monotonic() + args.budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def measure(self, base: dict, shape: Shape, mode: str, fn, args, check=None, tune=None, tol=None) -> dict:
        """Times fn(*args); `check(outs)` gives the relative error; `tune()` returns a context (autotuned configs)."""
        if self.left() <= 0:
            return self.rec.add(base | dict(status="skipped", error="time budget (--budget-s) spent"))
        row = dict(base)
        try:
            ctx, tune_s = None, None
            if tune is not None:
                t0 = time.monotonic()
                ctx = tune()
                tune_s = round(time.monotonic() - t0, 1)
            with ctx if ctx is not None else _null():
                ms, temp, outs = self.timer.run(fn, args, self.args.warmup, self.args.reps)
            row |= dict(ms=round(ms, 4), tflops=float(f"{shape.flops(mode) / ms / 1e9:.4g}"), extra_mib=round(temp, 2),
                        tune_s=tune_s, status="ok")
            if check:
                outs = outs if isinstance(outs, tuple) else (outs,)
                err = check(outs)
                row["rel_err"] = float(f"{err:.3g}")
                if not err <= (self.args.tol if tol is None else tol):
                    row["status"] = "wrong"
            del outs
        except Exception as e:  # noqa: BLE001 (a contender that fails is recorded; the run goes on)
            row |= dict(status="failed", error=error_text(e))
            if self.args.verbose:
                traceback.print_exc()
        return self.rec.add(row)

    def shape(self, shape: Shape, routings, tuned: bool):
        x, w, dy = inputs_for(shape)
        dense_fwd, dense_fwd_bwd = dense_fns()
        base = dict(shape=shape.name, model=shape.model, G=shape.G, M=shape.M, K=shape.K, N=shape.N)
        if not tuned:
            w0 = w[0]
            self.measure(base | dict(routing="-", mode="fwd", contender="dense"), shape, "fwd", dense_fwd, (x, w0))
            self.measure(base | dict(routing="-", mode="fwd_bwd", contender="dense"), shape, "fwd_bwd",
                         dense_fwd_bwd, (x, w0, dy))
            del w0
        for routing in routings[:1] if tuned else routings:  # the autotuned pass: the first routing only
            sizes = routing_sizes(routing, shape.M, shape.G)
            gs = jnp.asarray(sizes)
            for name, (fn, reason) in self.peers.items():
                if tuned and not name.startswith("tokamax"):
                    continue
                label = f"{name}_tuned" if tuned else name
                for mode in self.args.modes:
                    row = base | dict(routing=routing, mode=mode, contender=label)
                    if fn is None:
                        self.rec.add(row | dict(status="unavailable", error=reason))
                        continue
                    if name == "turbo_fp8" and (shape.K % FP8_BLOCK or shape.N % FP8_BLOCK):
                        self.rec.add(row | dict(status="unavailable", error=f"K={shape.K}, N={shape.N}: the FP8 "
                                                f"scales need multiples of {FP8_BLOCK}"))
                        continue
                    if name == "ragged_dot" and shape.G * shape.flops(mode) / 1e12 > RAGGED_DOT_MAX_TFLOP:
                        self.rec.add(row | dict(status="skipped", error=f"G x FLOPs > {RAGGED_DOT_MAX_TFLOP} TFLOP "
                                                "(XLA may expand it densely)"))
                        continue
                    f, args = timed_fn(fn, mode, sizes), ((x, w, gs) if mode == "fwd" else (x, w, gs, dy))
                    check = functools.partial(relative_error, x=x, w=w, dy=dy, sizes=sizes)
                    tol = self.args.fp8_tol if name == "turbo_fp8" else self.args.tol
                    tune = functools.partial(_autotune, f, args, self.left()) if tuned else None
                    self.measure(row, shape, mode, f, args, check, tune, tol)
        del x, w, dy


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _autotune(fn, args, seconds_left: float):
    """tokamax's own autotuning of every tokamax op in fn on these inputs; the result is a context manager."""
    import tokamax  # noqa: PLC0415
    if seconds_left < 30:
        raise TimeoutError("under 30 s of the time budget left: not autotuned")
    return tokamax.autotune(fn, *args, progress_bar=False, timeout=min(60.0, seconds_left / 4))


# ---- report ------------------------------------------------------------------------------------------------------
def summary_lines(rows: list[dict]) -> list[str]:
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tflops")]
    keys = sorted({(r["shape"], r["routing"], r["mode"]) for r in ok if r["contender"] == "turbo"})
    names = sorted({r["contender"] for r in ok if r["contender"] not in OURS})
    head = f"{'shape':27s} {'routing':8s} {'mode':7s} {'turbo':>7s} " + " ".join(f"{n[:14]:>14s}" for n in names)
    lines = [head + f" {'dense':>7s} {'t/peer':>6s} {'t/dense':>7s} {'fp8':>7s} {'fp8/t':>5s}  (TFLOP/s)"]
    for shape, routing, mode in keys:
        get = lambda c, rt=routing, sh=shape, md=mode: next(  # noqa: E731
            (r["tflops"] for r in ok if r["contender"] == c and r["shape"] == sh and r["routing"] == rt
             and r["mode"] == md), None)
        turbo, dense, fp8 = get("turbo"), get("dense", "-"), get("turbo_fp8")
        peers = {n: get(n) for n in names}
        best = max((v for v in peers.values() if v), default=None)
        fmt = lambda v, w: f"{v:{w}.4g}" if v else f"{'-':>{w}s}"  # noqa: E731
        lines.append(f"{shape:27s} {routing:8s} {mode:7s} {fmt(turbo, 7)} "
                     + " ".join(fmt(peers[n], 14) for n in names) + f" {fmt(dense, 7)} "
                     + (f"{turbo / best:6.2f}" if best else f"{'-':>6s}") + " "
                     + (f"{turbo / dense:7.2f}" if dense else f"{'-':>7s}") + " " + fmt(fp8, 7) + " "
                     + (f"{fp8 / turbo:5.2f}" if fp8 else f"{'-':>5s}"))
    bad = [r for r in rows if r.get("status") in ("failed", "wrong", "unavailable")]
    for r in {(r["contender"], r["status"], r.get("error", "")): r for r in bad}.values():
        lines.append(f"  {r['contender']}: {r['status']}: {r.get('error') or 'rel_err=' + str(r.get('rel_err'))}")
    return lines


def figure(rows: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import pandas as pd  # noqa: PLC0415
    import seaborn as sns  # noqa: PLC0415
    df = pd.DataFrame([r for r in rows if r.get("status") == "ok" and r.get("tflops")])
    if df.empty:
        return
    dense = df[df.contender == "dense"]
    df = pd.concat([df[df.contender != "dense"]] + [dense.assign(routing=rt) for rt in sorted(set(df.routing) - {"-"})],
                   ignore_index=True)
    grid = sns.catplot(df, kind="bar", x="tflops", y="shape", hue="contender", col="mode", row="routing",
                       height=4.5, aspect=1.1, sharex=False)
    grid.set_axis_labels("TFLOP/s (useful FLOPs; higher is better)", "")
    grid.figure.suptitle(f"Grouped GEMM vs peers, {rows[0].get('device_kind')} (bf16; turbo_fp8: E4M3)", y=1.02)
    grid.savefig(path, dpi=110, bbox_inches="tight")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/peers", help="path stem: writes .csv, .json and .png")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU check of the script)")
    parser.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    parser.add_argument("--routings", default="balanced,skewed")
    parser.add_argument("--modes", default="fwd,fwd_bwd")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tol", type=float, default=2e-2, help="largest relative error counted correct (bf16)")
    parser.add_argument("--contenders", default=None,
                        help=f"comma-separated subset of {MOE_CONTENDERS} (default: all; dense always runs)")
    parser.add_argument("--fp8-tol", type=float, default=0.1,
                        help="largest relative error counted correct for turbo_fp8 (E4M3 rounds to 2^-4 relative)")
    parser.add_argument("--tune-shapes", default="reduced_gate_up_G64,dsv3_gate_ep8_G32,qwen3_30b_gate_G128",
                        help="shapes of the autotuned tokamax pass ('' for none); it runs after everything else")
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop starting new measurements after this")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if bad := set(args.modes) - {"fwd", "fwd_bwd"}:
        parser.error(f"--modes: unknown {sorted(bad)} (expected fwd, fwd_bwd)")

    ops.ensure_registered()
    platform = jax.devices()[0].platform
    if platform != "gpu" and not args.smoke:
        parser.error(f"no GPU here (platform {platform}): run with --smoke for the CPU check")
    shapes = smoke_shapes() if args.smoke else full_shapes()
    if args.shapes:
        wanted = args.shapes.split(",")
        if unknown := set(wanted) - {s.name for s in shapes}:
            parser.error(f"--shapes: unknown {sorted(unknown)}; known: {[s.name for s in shapes]}")
        shapes = [s for s in shapes if s.name in wanted]
    prov = collect_provenance() | {"tokamax_version": package_version("tokamax"),
                                   "params": f"bf16; warmup={args.warmup} reps={args.reps} median; skewed=Zipf(1); "
                                             f"timer={'cuda events' if platform == 'gpu' else 'wall clock'}"}
    print({k: prov.get(k) for k in (*TABLE_COLUMNS, "grouped_gemm", "tokamax_version")}, flush=True)
    rec = Recorder(Path(args.out), prov)
    peers = contenders(platform)
    if args.contenders:
        wanted = args.contenders.split(",")
        if unknown := set(wanted) - set(peers):
            parser.error(f"--contenders: unknown {sorted(unknown)}; known: {sorted(peers)}")
        peers = {name: peers[name] for name in wanted}
    bench = Bench(args, rec, Timer(platform), peers)
    routings = args.routings.split(",")
    for shape in shapes:
        bench.shape(shape, routings, tuned=False)
    tune_names = set(filter(None, args.tune_shapes.split(",")))
    if any(fn for name, (fn, _) in bench.peers.items() if name.startswith("tokamax")):
        for shape in (s for s in shapes if s.name in tune_names or args.smoke):
            bench.shape(shape, routings, tuned=True)
    print("\n".join(summary_lines(rec.rows)))
    try:
        figure(rec.rows, Path(args.out).with_suffix(".png"))
    except Exception as e:  # noqa: BLE001 (the numbers are written already)
        print(f"figure not drawn: {error_text(e)}")
    print(f"wrote {rec.csv}, {rec.json} ({len(rec.rows)} rows)")


if __name__ == "__main__":
    main()
