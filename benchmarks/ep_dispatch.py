"""Expert-parallel exchange and MoE-layer benchmark on the GPUs of one host (not a test).

For DeepSeek-V3 shapes (4096 tokens/rank, hidden 7168, top-8 of 256 experts) and a reduced shape
(the `reduced` preset's MoE: hidden 1280, top-6 of 64) it times, over an ("expert",) mesh of every
device (EP = device count):
  deepep_<layout>  turbo_moe.ops moe_dispatch + moe_combine (one row per token and destination rank) in
               each layout: dense (all_gather + reduce-scatter, no packing), packed (the pack kernel and
               all_to_alls of worst-case (P, T, H) buffers: the first layout), ragged (pack, then
               only the real rows through ragged_all_to_all); deepep_dense_all_to_all / _permute: the dense
               layout with x moved by all_to_all or collective permutes (`dense_via`) instead of all_gather
  ragged_a2a   the ragged exchange of the `ragged` path there and back (jax.lax.ragged_all_to_all of the
               T*k copies sorted by expert; buffer P*T*k rows), each destination split in the default
               number of updates (64 in ragged_a2a_64chunks); ragged_a2a_1chunk: one update per destination
               (the first version)
  ag_rs_worst  all_gather there and reduce-scatter back of (T, H) per rank: the dense layout's collectives
  permute_worst  P-1 collective permutes of (T, H) there and back: dense_via="permute"'s collectives
  a2a_real     a plain all_to_all there and back of a buffer holding exactly deepep's real rows
  a2a_ragged_real  the same for the ragged exchange's real rows (k copies per token)
  a2a_worst    a plain all_to_all there and back of deepep's worst-case (P, T, H) buffer
and then one MoE layer step (forward + backward) per path with EP. Bytes are the rows that cross
between ranks (rows a rank keeps for itself are not counted). Each exchange is chained `--inner`
times inside one jit (no launch gaps); the median over `--reps` such calls is reported per exchange.
Compiled layer steps are checked for device-to-host transfers (column host_transfers).

    PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false NCCL_NVLS_ENABLE=0 python benchmarks/ep_dispatch.py
    (CPU smoke run: XLA_FLAGS=--xla_force_host_platform_device_count=2 ... --smoke)

Bytes are summed over all ranks (GB/s is the aggregate of the whole expert group). On the lent
2-GPU machine: carry build/ep_lib (libturbo_moe_cpu.so + libturbo_moe_cuda.so) and build/ep_whl
(flax and its pure deps for Python 3.12, installed only if the image lacks flax), then run
    python3 -c "import flax.nnx" 2>/dev/null || { python3 -m pip install -q --no-index --no-deps
      --target /tmp/site build/ep_whl/*.whl && export PYTHONPATH=/tmp/site; }
    export PYTHONPATH=$PWD:$PYTHONPATH TURBO_MOE_LIB_DIR=$PWD/build/ep_lib NCCL_NVLS_ENABLE=0 ...
    timeout 430 python3 benchmarks/ep_dispatch.py --out $OUT/ep_dispatch_h200x2.csv
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks._provenance import provenance  # noqa: E402
from turbo_moe import ops  # noqa: E402
from turbo_moe.model.expert_parallel import ep_moe_path  # noqa: E402
from turbo_moe.model.experts import ExpertWeights  # noqa: E402
from turbo_moe.model.router import Routing  # noqa: E402
from turbo_moe.ops.ragged_exchange import default_impl, exchange_plan, ragged_exchange  # noqa: E402
from turbo_moe.shapes import DEEPSEEK_V3, REDUCED  # noqa: E402

SHAPES = {  # name: (tokens per rank, hidden, top_k, experts, moe_ffn_dim)
    **{name: (4096, s.d_model, s.top_k, s.n_experts, s.moe_ffn_dim) for name, s in (("dsv3", DEEPSEEK_V3),
                                                                                     ("reduced", REDUCED))},
    "smoke": (64, 32, 3, 8, 16),
}
# Device-to-host traffic in compiled HLO: host send/recv, in/outfeed, Python callbacks.
HOST_MARKERS = ("is_host_transfer=true", "outfeed", "infeed", "callback")


def routing_ids(rng, n_tokens, k, n_experts) -> np.ndarray:
    """Distinct uniformly random experts per token (balanced in expectation), int32 (N, k)."""
    return np.argsort(rng.random((n_tokens, n_experts)), axis=1)[:, :k].astype(np.int32)


def remote_rows(ids: np.ndarray, n_ranks: int, n_experts: int) -> tuple[int, int]:
    """(deepep rows, ragged rows) crossing between ranks, summed over source ranks, one direction."""
    per_rank = ids.shape[0] // n_ranks
    dest = ids // (n_experts // n_ranks)  # (N, k)
    deepep = ragged = 0
    for src in range(n_ranks):
        d = dest[src * per_rank:(src + 1) * per_rank]
        for p in range(n_ranks):
            if p != src:
                deepep += int(np.any(d == p, axis=1).sum())
                ragged += int((d == p).sum())
    return deepep, ragged


@contextlib.contextmanager
def env(**values):
    """Environment variables set while a case compiles (XLA/NCCL flags; none of turbo_moe's)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update({key: str(v) for key, v in values.items()})
    try:
        yield
    finally:
        for key, v in saved.items():
            if v is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = v


def compiled_ops(fn, args):
    """(compiled fn, its collectives, custom calls and copies): what XLA made of the exchange."""
    compiled = fn.lower(*args).compile()
    text = compiled.as_text()
    seen = re.findall(r" ([a-z][a-z0-9-]*)\(", text)
    names = ("all-gather-start", "all-gather", "all-to-all", "reduce-scatter", "ragged-all-to-all",
             "all-reduce-start", "all-reduce", "collective-permute-start", "collective-permute", "custom-call",
             "copy-start", "copy")
    return compiled, " ".join(f"{n}={seen.count(n)}" for n in names if seen.count(n))


def timed(fn, args, reps: int, inner: int) -> float:
    """Median seconds per exchange: fn runs `inner` chained exchanges per call."""
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) / inner)
    return float(np.median(times))


def chained(mesh, body, inner: int, n_in: int):
    """jit(shard_map) running `x = body(x, *rest)` `inner` times (each exchange waits for the last)."""
    def loop(x, *rest):
        return jax.lax.fori_loop(0, inner, lambda _, x: body(x, *rest), x)

    spec = P("expert")
    return jax.jit(jax.shard_map(loop, mesh=mesh, in_specs=(spec,) * n_in, out_specs=spec))


def exchange_rows(mesh, shape_name, reps, inner, impl):
    t, h, k, e, _ = SHAPES[shape_name]
    n_ranks = mesh.shape["expert"]
    rng = np.random.default_rng(0)
    ids_np = routing_ids(rng, n_ranks * t, k, e)
    x = device_normal(mesh, 2, (n_ranks * t, h), scale=1.0)
    ids = jnp.asarray(ids_np)
    w = jnp.asarray(rng.random((n_ranks * t, k)) / k, jnp.float32)
    deepep_rows, ragged_rows = remote_rows(ids_np, n_ranks, e)
    row_bytes = h * 2  # bf16
    meta_bytes = k * 8  # ids int32 + weights f32 travel with each dispatched row

    def deepep(layout, via="all_gather"):
        def body(x, ids, w):
            rx, _, rw, handle = ops.moe_dispatch(x, ids, w, num_experts=e, axis_name="expert", layout=layout,
                                                 impl=impl, dense_via=via)
            return ops.moe_combine(rx * rw.sum(-1, keepdims=True).astype(rx.dtype), handle, axis_name="expert")
        return body

    def ragged(x, ids):
        flat = ids.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        plan, _ = exchange_plan(jnp.bincount(flat, length=e).astype(jnp.int32), "expert")
        copies = x[order // k]  # (T*k, H)
        got = ragged_exchange(copies, plan, n_ranks * t * k, "expert", impl)
        back = ragged_exchange(got, plan.reversed(), t * k, "expert", impl)  # (T*k, H)
        return jnp.zeros_like(x).at[order // k].add(back) * (1.0 / k)

    def a2a_round_trip(buf):  # buf (P*R, H): R rows for each destination
        there = jax.lax.all_to_all(buf.reshape(n_ranks, -1, h), "expert", 0, 0)  # (P, R, H)
        back = jax.lax.all_to_all(there * jnp.asarray(0.5, buf.dtype), "expert", 0, 0)
        return back.reshape(buf.shape)

    def permute_rt(x):  # the dense layout's collective permutes alone (dense_via="permute")
        shifts = range(1, n_ranks)
        perm = lambda s: [((r + s) % n_ranks, r) for r in range(n_ranks)]  # noqa: E731
        there = [jax.lax.ppermute(x, "expert", perm(s)) for s in shifts]
        back = [jax.lax.ppermute(b * jnp.asarray(0.5, x.dtype), "expert", perm(-s)) for s, b in zip(shifts, there)]
        return sum(back[1:], back[0])

    def ag_rs(x):  # the dense layout's two collectives alone
        there = jax.lax.all_gather(x, "expert", tiled=True)  # (P*T, H)
        return jax.lax.psum_scatter(there * jnp.asarray(0.5, x.dtype), "expert", scatter_dimension=0, tiled=True)

    def a2a_buffer(rows_per_dest):  # made on the devices: the ragged-real one is ~0.5 GB at dsv3
        shape = (n_ranks * n_ranks * rows_per_dest, h)
        return jax.jit(lambda: jnp.ones(shape, jnp.bfloat16), out_shardings=NamedSharding(mesh, P("expert")))()

    pairs = n_ranks * (n_ranks - 1)  # (source, remote destination) pairs
    deepep_real = 2 * deepep_rows * (row_bytes + meta_bytes // 2)  # ids/weights go out, not back
    ragged_real = 2 * ragged_rows * row_bytes
    worst = 2 * pairs * t * row_bytes
    meta = 2 * pairs * t * meta_bytes // 2  # ids/weights buffers of every layout: (P, T, k) per rank
    deepep_worst = 2 * pairs * t * row_bytes + meta
    # (name, fn, args, real bytes, bytes moved, env switches, inner): the old variants run fewer times
    # deepep_dense is dense_via="all_gather" (its name before the other two existed)
    deepep_cases = {"deepep_packed": ("packed", "all_gather"), "deepep_dense": ("dense", "all_gather"),
                    "deepep_dense_all_to_all": ("dense", "all_to_all"), "deepep_dense_permute": ("dense", "permute"),
                    "deepep_ragged": ("ragged", "all_gather")}  # packed first: the others are compared with it
    cases = [(name, chained(mesh, deepep(*how), inner, 3), (x, ids, w), deepep_real,
              deepep_worst if how[0] != "ragged" else 2 * deepep_rows * row_bytes + meta, {}, inner)
             for name, how in deepep_cases.items()]
    cases += [
        ("permute_worst", chained(mesh, permute_rt, inner, 1), (x,), worst, worst, {}, inner),
        ("a2a_real", chained(mesh, a2a_round_trip, inner, 1), (a2a_buffer(-(-deepep_rows // pairs)),), deepep_real,
         deepep_real, {}, inner),
        ("a2a_worst", chained(mesh, a2a_round_trip, inner, 1), (a2a_buffer(t),), worst, worst, {}, inner),
        ("ag_rs_worst", chained(mesh, ag_rs, inner, 1), (x,), worst, worst, {}, inner),
        ("ragged_a2a", chained(mesh, ragged, inner, 2), (x, ids), ragged_real, 2 * pairs * t * k * row_bytes, {},
         inner),
        ("a2a_ragged_real", chained(mesh, a2a_round_trip, inner, 1), (a2a_buffer(-(-ragged_rows // pairs)),),
         ragged_real, ragged_real, {}, inner),
    ]
    rows, first_out = [], {}
    for name, fn, args, real, moved, switches, n_inner in cases:
        try:
            with env(**switches):
                compiled, ops_text = compiled_ops(fn, args)
                sec = timed(compiled, args, reps if n_inner == inner else 3, n_inner)
                if name.startswith("deepep_"):  # one exchange round trip's result, to compare layouts
                    first_out[name] = np.asarray(jax.jit(jax.shard_map(
                        deepep(*deepep_cases[name]), mesh=mesh, in_specs=(P("expert"),) * 3,
                        out_specs=P("expert")))(*args).astype(jnp.float32))
        except Exception as err:  # e.g. out of memory: record and go on
            print(f"{shape_name} {name}: failed: {type(err).__name__}: {str(err)[:200]}")
            continue
        diff = ""
        if name in first_out and "deepep_packed" in first_out:
            diff = float(np.max(np.abs(first_out[name] - first_out["deepep_packed"])))
        rows.append(dict(kind="exchange", shape=shape_name, method=name, tokens_per_rank=t, hidden=h, top_k=k,
                         experts=e, ep=n_ranks, time_ms=sec * 1e3, real_bytes=real, buffer_bytes=moved,
                         gbps_real=real / sec / 1e9, gbps_buffer=moved / sec / 1e9, host_transfers="",
                         hlo_ops=ops_text, switches=" ".join(f"{k}={v}" for k, v in switches.items()),
                         max_abs_diff_vs_packed=diff))
        print(f"{shape_name:8s} {name:18s} {sec * 1e3:9.3f} ms  real {real / 1e6:9.1f} MB -> "
              f"{real / sec / 1e9:7.1f} GB/s   buffer {moved / 1e6:9.1f} MB  {ops_text}")
    by = {r["method"]: r for r in rows}
    for ours, ref in (*((name, "a2a_real") for name in deepep_cases), ("permute_worst", "a2a_worst"),
                      ("ag_rs_worst", "a2a_worst"),
                      ("ragged_a2a", "a2a_ragged_real"), ("ragged_a2a_64chunks", "a2a_ragged_real"),
                      ("ragged_a2a_1chunk", "a2a_ragged_real")):
        if ours in by and ref in by:
            by[ours]["vs_a2a_real"] = by[ref]["time_ms"] / by[ours]["time_ms"]
            print(f"{shape_name:8s} {ours} at {by[ours]['vs_a2a_real']:.2f}x the all_to_all bandwidth "
                  "of its real bytes")
    return rows


def device_normal(mesh, seed: int, shape, scale: float = 0.02):
    """bf16 N(0, scale^2) weights drawn on the devices, split over the expert axis. Not numpy: DeepSeek-V3's
    experts are 11.3e9 samples, minutes of host time in float64 (what stopped the dsv3 layer rows twice)."""
    draw = lambda key: jax.random.normal(key, shape, jnp.bfloat16) * jnp.asarray(scale, jnp.bfloat16)  # noqa: E731
    return jax.jit(draw, out_shardings=NamedSharding(mesh, P("expert")))(jax.random.key(seed))


def layer_rows(mesh, shape_name, reps, impl):
    t, h, k, e, f = SHAPES[shape_name]
    n_ranks = mesh.shape["expert"]
    seq = min(t, 2048)
    b = n_ranks * t // seq
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(b, seq, h)), jnp.bfloat16)
    ids = jnp.asarray(routing_ids(rng, b * seq, k, e).reshape(b, seq, k))
    routing = Routing(ids, jnp.asarray(rng.random((b, seq, k)) / k, jnp.float32), jnp.zeros((b, seq, e)))
    experts = ExpertWeights(device_normal(mesh, 0, (e, h, 2 * f)), device_normal(mesh, 1, (e, f, h)))
    rows = []
    cases = [("dense_cf", "deepep", "auto"), ("ragged", "ragged_all_to_all", "auto"),
             ("turbo", "deepep", "auto"), ("turbo", "deepep", "dense"), ("turbo", "deepep", "packed"),
             ("turbo", "deepep", "ragged"), ("turbo", "ragged_all_to_all", "auto")]
    if shape_name == "dsv3":  # XLA's ragged_dot and the dense_cf one-hot einsums are far too slow
        cases = cases[2:]
    for path, exchange, layout in cases:
        ep = ep_moe_path(path, mesh=mesh, capacity_factor=1.25, ep_exchange=exchange, exchange_impl=impl,
                         ep_layout=layout)

        def step(x, w, experts, ep=ep):
            def loss(x, w, experts):
                y, stats = ep(x, routing._replace(weights=w), experts)
                return jnp.sum(y.astype(jnp.float32) ** 2), stats.dropped_fraction
            return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, experts)

        name = f"{path}/{exchange}" if path == "turbo" else path
        name += f"[{layout}]" if exchange == "deepep" and path == "turbo" else ""
        try:
            compiled = jax.jit(step).lower(x, routing.weights, experts).compile()
            hlo = compiled.as_text()
            host = sum(hlo.count(m) for m in HOST_MARKERS)
            sec = timed(compiled, (x, routing.weights, experts), reps, 1)
        except Exception as err:
            print(f"{shape_name} layer {name}: failed: {type(err).__name__}: {str(err)[:200]}")
            continue
        rows.append(dict(kind="layer_fwd_bwd", shape=shape_name, method=name, tokens_per_rank=t, hidden=h, top_k=k,
                         experts=e, ep=n_ranks, time_ms=sec * 1e3, host_transfers=host,
                         switches=f"ep_layout={layout}",
                         custom_calls=" ".join(sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))))))
        print(f"{shape_name:8s} layer {name:34s} {sec * 1e3:9.3f} ms  host transfers in HLO: {host}")
    return rows


def check_rows(mesh, impl):
    """EP (this platform's exchange) against the one-device path, float32, small shape: max |error|."""
    from turbo_moe.model.moe_layer import moe_path_fn

    n_ranks = mesh.shape["expert"]
    b, s, h, f, e, k = 2 * n_ranks, 16, 64, 32, 8 * n_ranks, 3
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(b, s, h)), jnp.float32)
    ids = jnp.asarray(routing_ids(rng, b * s, k, e).reshape(b, s, k))
    routing = Routing(ids, jnp.asarray(rng.random((b, s, k)), jnp.float32), jnp.zeros((b, s, e)))
    experts = ExpertWeights(jnp.asarray(rng.normal(size=(e, h, 2 * f)) / 8, jnp.float32),
                            jnp.asarray(rng.normal(size=(e, f, h)) / 6, jnp.float32))
    rows = []
    cases = [("dense_cf", "deepep", ""), ("ragged", "deepep", "")]
    cases += [("turbo", "deepep", layout) for layout in ("dense", "packed", "ragged")]
    cases += [("turbo", "ragged_all_to_all", "")]
    for path, exchange, layout in cases:
        def loss_grads(fn):
            def loss(x, w, experts):
                return jnp.sum(fn(x, routing._replace(weights=w), experts)[0] ** 2)
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, routing.weights, experts)
        name = (f"{path}/{exchange}" if path == "turbo" else path) + (f"[{layout}]" if layout else "")
        try:
            ref = loss_grads(moe_path_fn(path, 1.25))
            got = loss_grads(ep_moe_path(path, mesh=mesh, capacity_factor=1.25, ep_exchange=exchange,
                                         exchange_impl=impl, ep_layout=layout or "auto"))
        except Exception as err:  # record and go on to the timings
            print(f"check {name}: failed: {type(err).__name__}: {str(err)[:300]}")
            continue
        err = max(float(jnp.max(jnp.abs(a - r)) / (jnp.max(jnp.abs(r)) + 1e-30))
                  for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
        print(f"check EP={n_ranks} {name:30s} max relative error (loss and grads) vs one device: {err:.2e}")
        rows.append(dict(kind="check_vs_one_device", shape="check", method=name, ep=n_ranks, max_rel_error=err))
    return rows


def write_csv(rows, out: Path, prov: dict):
    out.parent.mkdir(parents=True, exist_ok=True)
    fields = sorted({key for row in rows for key in row} | set(prov), key=lambda c: (c in prov, c))
    with out.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **prov})


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="CSV path (default experiments/results/ep_dispatch_<device>.csv)")
    parser.add_argument("--shapes", default="dsv3,reduced", help="comma-separated of " + ",".join(SHAPES))
    parser.add_argument("--layer-shapes", default="reduced,dsv3",
                        help="shapes for the layer step ('' for none; dsv3 runs the turbo paths only)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--skip-checks", action="store_true", help="no EP-vs-one-device checks")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few reps (CPU check of the script)")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.layer_shapes, args.reps, args.inner = "smoke", "smoke", 2, 2
    if jax.device_count() < 2:
        raise SystemExit("needs at least 2 devices")
    mesh = Mesh(np.array(jax.devices()), ("expert",))
    impl = default_impl(jax.devices()[0].platform)
    print("devices:", jax.devices(), "ragged exchange:", impl)
    prov = provenance()
    kind = prov["device_kind"].replace(" ", "_").lower()
    out = Path(args.out or REPO / "experiments" / "results" / f"ep_dispatch_{kind}.csv")
    rows = [] if args.skip_checks else check_rows(mesh, impl)
    write_csv(rows, out, prov)  # after every section: a run cut short keeps what it measured
    for shape in filter(None, args.shapes.split(",")):
        rows += exchange_rows(mesh, shape, args.reps, args.inner, impl)
        write_csv(rows, out, prov)
    for shape in filter(None, args.layer_shapes.split(",")):
        rows += layer_rows(mesh, shape, args.reps, impl)
        write_csv(rows, out, prov)
    print("wrote", out)


if __name__ == "__main__":
    main()
