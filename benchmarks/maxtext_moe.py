"""MaxText's own MoE layer against MaxText + turbo and turbo_moe's MoELayer: forward+backward, one device or EP=N.

Contenders (one row each per shape; a contender that fails or does not import is a row with its status):
  maxtext_dense_cf1.25   RoutedMoE, sparse_matmul=False, capacity_factor=1.25 (MaxText's capacity path)
  maxtext_sparse         RoutedMoE, sparse_matmul=True, megablox=False: jax.lax.ragged_dot (MaxText's GPU configs)
  maxtext_sparse_turbo   the same with turbo_moe.integrations.maxtext.enable(): its GEMMs on turbo and, at --ep N > 1,
                         its whole routed body on turbo's dispatch -> experts -> combine (column turbo_body:
                         "ep_exchange"; "gemms_only" where only the GEMMs were swapped, with the reason in turbo_stats)
  maxtext_sparse_turbo_split   the same with enable(ep_weights="split"): at --ep N > 1 the EP body runs MaxText's wi_0 /
                         wi_1 as two grouped GEMMs instead of concatenating them into turbo's fused gate/up each step
  turbo_moe_layer        turbo_moe.model.moe_layer.MoELayer (moe_path="turbo", no shared expert: RoutedMoE has none)
One step = value_and_grad of sum(layer(x) * probe) in the parameters and x, jitted; tokens/s = tokens per step /
median step time (the TGS of a one-layer model), and the step's device memory from the compiled memory analysis
(arguments + outputs + temporaries). Shapes: `reduced` (64 experts, top-6, d 1280, f 512, 8 x 2048 tokens) and
DeepSeek-V3 (256 experts, top-8, d 7168, f 2048, 2 x 2048 tokens, bf16 weights: float32 ones and their gradients
need 90 GB). Each row is appended to <out>.csv / .json as it finishes. Each contender runs in a child process
(--isolate, the default; --point-timeout-s): one that hangs or crashes is a 'timeout' / 'failed' row, not the end.

--ep N: expert parallelism over the first N devices, the batch above per device. MaxText: ici_expert_parallelism=N,
its default exchange (ragged_all_to_all; for maxtext_sparse_turbo* turbo's EP body replaces that exchange and the
GEMMs, MaxText's routing kept; the dense_cf path its own); turbo_moe_layer: a ("data", "expert") = (1, N) mesh, its
default exchange (deepep), the parameters placed by turbo_moe's sharding rule. tokens_per_s is per device (the TGS
of the one-layer model).

    PYTHONPATH=$PWD python benchmarks/maxtext_moe.py --out $OUT/maxtext_moe           # GPU, maxtext installed
    PYTHONPATH=$PWD python benchmarks/maxtext_moe.py --smoke --out /tmp/maxtext_moe   # CPU check
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import jax
import jax.numpy as jnp
from flax import nnx

from turbo_moe.provenance import TABLE_COLUMNS, package_version
from turbo_moe.provenance import collect as collect_provenance
from turbo_moe.shapes import DEEPSEEK_V3, REDUCED

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import Recorder, error_text  # noqa: E402 (one writer of rows for both benchmarks)

CONTENDERS = ("maxtext_dense_cf1.25", "maxtext_sparse", "maxtext_sparse_turbo", "maxtext_sparse_turbo_split",
              "turbo_moe_layer")
FIELDS = [*TABLE_COLUMNS, "shape", "ep", "contender", "tokens", "E", "top_k", "d_model", "d_ff", "dtype", "weight_dtype",
          "status", "step_ms", "tokens_per_s", "step_mib", "temp_mib", "turbo_calls", "turbo_body", "turbo_stats",
          "error"]


@dataclass(frozen=True)
class Shape:
    name: str
    E: int
    top_k: int
    d_model: int
    d_ff: int
    batch: int
    seq: int
    weight_dtype: str  # MaxText weight_dtype / turbo_moe param_dtype


SHAPES = {
    "reduced": Shape("reduced", REDUCED.n_experts, REDUCED.top_k, REDUCED.d_model, REDUCED.moe_ffn_dim, 8, 2048,
                     "float32"),
    "deepseek_v3": Shape("deepseek_v3", DEEPSEEK_V3.n_experts, DEEPSEEK_V3.top_k, DEEPSEEK_V3.d_model,
                         DEEPSEEK_V3.moe_ffn_dim, 2, 2048, "bfloat16"),
    "smoke": Shape("smoke", 8, 2, 32, 24, 2, 16, "float32"),
}


# ---- the layers ----------------------------------------------------------------------------------------------------
def maxtext_layer(shape: Shape, dtype: str, ep: int = 1, **keys):
    """(layer, mesh, axis rules) of MaxText's RoutedMoE at `shape` with config keys `keys`, on `ep` devices."""
    import maxtext  # noqa: PLC0415 (optional: the benchmark records a row where it does not import)
    from maxtext.configs import pyconfig  # noqa: PLC0415
    from maxtext.layers import moe  # noqa: PLC0415
    from maxtext.layers.initializers import nd_dense_init  # noqa: PLC0415
    from maxtext.utils import maxtext_utils  # noqa: PLC0415

    base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
    cfg = pyconfig.initialize(
        [None, base], run_name="maxtext_moe_bench", enable_checkpointing=False, skip_jax_distributed_system=True,
        base_output_directory=tempfile.gettempdir(), num_experts=shape.E, num_experts_per_tok=shape.top_k,
        base_emb_dim=shape.d_model, base_moe_mlp_dim=shape.d_ff, base_mlp_dim=shape.d_ff,
        per_device_batch_size=shape.batch, max_target_length=shape.seq, dtype=dtype, weight_dtype=shape.weight_dtype,
        **({"ici_expert_parallelism": ep} if ep > 1 else {}), **keys)
    devices = np.asarray(jax.devices()[:ep])
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(cfg, devices=devices), cfg.mesh_axes)
    with jax.set_mesh(mesh):
        layer = moe.RoutedMoE(config=cfg, num_experts=shape.E, num_experts_per_tok=shape.top_k, mesh=mesh,
                              kernel_init=nd_dense_init(1.0, "fan_in", "truncated_normal"), kernel_axes=("embed", None),
                              rngs=nnx.Rngs(0), intermediate_dim=cfg.moe_mlp_dim, dtype=cfg.dtype,
                              weight_dtype=cfg.weight_dtype)
    return layer, mesh, cfg.logical_axis_rules


def turbo_layer(shape: Shape, dtype: str, ep: int = 1):
    """(layer, mesh or None) of turbo_moe's MoELayer; with ep > 1 on a (1, ep) mesh, parameters sharded."""
    from turbo_moe.model.config import get_config  # noqa: PLC0415
    from turbo_moe.model.moe_layer import MoELayer  # noqa: PLC0415
    cfg = get_config("tiny", d_model=shape.d_model, moe_ffn_dim=shape.d_ff, n_experts=shape.E, top_k=shape.top_k,
                     n_shared_experts=0, n_groups=1, topk_groups=1, moe_path="turbo", dtype=dtype,
                     param_dtype=shape.weight_dtype, max_seq_len=shape.seq)
    if ep == 1:
        return MoELayer(cfg, nnx.Rngs(0)), None
    from turbo_moe.model.mesh import make_mesh  # noqa: PLC0415
    from turbo_moe.model.sharding import state_shardings  # noqa: PLC0415
    mesh = make_mesh(jax.devices()[:ep], expert_parallel=ep)
    with jax.set_mesh(mesh):
        layer = MoELayer(cfg, nnx.Rngs(0))
        graphdef, state = nnx.split(layer)
        state = jax.device_put(state, state_shardings(state, mesh))
    return nnx.merge(graphdef, state), mesh


# ---- one measured step ------------------------------------------------------------------------------------------------
def step_fn(layer):
    """jitted (params, rest, x, probe) -> (loss, (d_params, d_x)) and its arguments' parameter split."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def loss(params, x, rest, probe):
        out = nnx.merge(graphdef, params, rest)(x)[0]
        return jnp.sum(out.astype(jnp.float32) * probe)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params, rest


def time_step(step, args, warmup: int, reps: int) -> tuple[float, float, float]:
    """(median ms, step MiB = arguments + outputs + temporaries, temporaries MiB)."""
    compiled = step.lower(*args).compile()
    mem = compiled.memory_analysis()
    temp = mem.temp_size_in_bytes if mem else 0
    total = (mem.argument_size_in_bytes + mem.output_size_in_bytes + temp) if mem else 0
    samples = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        if i >= warmup:
            samples.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(samples)), total / 2**20, temp / 2**20


def run_one(shape: Shape, contender: str, args) -> dict:
    from turbo_moe.integrations import maxtext as turbo_maxtext  # noqa: PLC0415
    x = jax.random.normal(jax.random.PRNGKey(1), (shape.batch * args.ep, shape.seq, shape.d_model), jnp.float32)
    x = x.astype(args.dtype)
    probe = jax.random.normal(jax.random.PRNGKey(2), x.shape, jnp.float32)
    row: dict = {}
    if contender == "turbo_moe_layer":
        layer, mesh = turbo_layer(shape, args.dtype, args.ep)
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            step, params, rest = step_fn(layer)
            ms, total, temp = time_step(step, (params, x, rest, probe), args.warmup, args.reps)
    else:
        from flax.linen import partitioning as nn_partitioning  # noqa: PLC0415
        keys = dict(sparse_matmul=False, capacity_factor=1.25) if contender == "maxtext_dense_cf1.25" else \
            dict(sparse_matmul=True, megablox=False, use_tokamax_gmm=False, capacity_factor=-1.0)
        layer, mesh, rules = maxtext_layer(shape, args.dtype, args.ep, **keys)
        use_turbo = contender.startswith("maxtext_sparse_turbo")
        turbo_maxtext.reset_stats()
        with jax.set_mesh(mesh), nn_partitioning.axis_rules(rules):
            if use_turbo:
                turbo_maxtext.enable(ep_weights="split" if contender.endswith("_split") else "fused")
            try:
                step, params, rest = step_fn(layer)
                ms, total, temp = time_step(step, (params, x, rest, probe), args.warmup, args.reps)
            finally:
                turbo_maxtext.disable()
        if use_turbo:
            stats = turbo_maxtext.stats()
            row["turbo_calls"] = sum(v for k, v in stats.items() if k.startswith("turbo"))
            if not row["turbo_calls"]:
                raise RuntimeError(f"enable() routed no GEMM to turbo: {stats}")
            row.update(turbo_maxtext.body_summary(stats))
    tokens = shape.batch * shape.seq  # per device
    return row | dict(status="ok", step_ms=round(ms, 3), tokens_per_s=round(tokens / ms * 1e3),
                      step_mib=round(total, 1), temp_mib=round(temp, 1))


ROW_TAG = "MAXTEXT_MOE_ROW "


def run_guarded(shape: Shape, contender: str, args) -> dict:
    """run_one, its failure a row: an import error is 'unavailable', anything else (an OOM) 'failed'."""
    try:
        return run_one(shape, contender, args)
    except ImportError as e:
        return dict(status="unavailable", error=error_text(e))
    except Exception as e:  # noqa: BLE001 (an OOM or failure is a row; the run goes on)
        return dict(status="failed", error=error_text(e))


def run_isolated(shape_name: str, contender: str, argv: list[str], budget_s: float, point_timeout_s: float) -> dict:
    """One contender in a child process of this script, so that one which hangs (a device out of memory while the
    other waits at a collective) or crashes is a row and the next contender gets clean devices."""
    import subprocess  # noqa: PLC0415
    keep, skip = [], False
    for a in argv:  # this run's arguments less those the child gets its own of
        if skip:
            skip = False
        elif a in ("--shapes", "--contenders", "--out"):
            skip = True
        elif not a.startswith(("--shapes=", "--contenders=", "--out=", "--isolate", "--no-isolate")):
            keep.append(a)
    cmd = [sys.executable, __file__, *keep, "--no-isolate", "--worker", "--shapes", shape_name,
           "--contenders", contender, "--out", os.path.join(tempfile.mkdtemp(), "row")]
    timeout = max(1.0, min(budget_s, point_timeout_s))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        why = ("the time left of --budget-s" if timeout < point_timeout_s else
               "--point-timeout-s; a hang, e.g. one device out of memory while another waits at a collective?")
        return dict(status="timeout", error=f"no result within {timeout:.0f} s ({why})")
    rows = [json.loads(line[len(ROW_TAG):]) for line in done.stdout.splitlines() if line.startswith(ROW_TAG)]
    if rows:
        return rows[-1]
    tail = " | ".join(line for line in (done.stderr or done.stdout).splitlines()[-3:] if line.strip())
    return dict(status="failed", error=f"worker exit code {done.returncode} without a row: {tail[-300:]}")


def main(argv=None):

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/maxtext_moe", help="path stem: .csv and .json")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape (the CPU check)")
    parser.add_argument("--shapes", default="reduced,deepseek_v3")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--dtype", default="bfloat16", help="compute dtype")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism over the first N devices")
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop starting new contenders after this")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                        help="each contender in a child process (a hang or crash becomes a row); --no-isolate: in "
                             "this process")
    parser.add_argument("--point-timeout-s", type=float, default=240.0, help="a child's time limit (with --isolate)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a child of --isolate
    args = parser.parse_args(argv)
    shape_names = ["smoke"] if args.smoke else args.shapes.split(",")
    if not 1 <= args.ep <= len(jax.devices()):
        parser.error(f"--ep: expected 1..{len(jax.devices())} (the devices here), got {args.ep}")
    if unknown := set(shape_names) - set(SHAPES):
        parser.error(f"--shapes: unknown {sorted(unknown)}; known: {sorted(SHAPES)}")
    contenders = args.contenders.split(",")
    if unknown := set(contenders) - set(CONTENDERS):
        parser.error(f"--contenders: unknown {sorted(unknown)}; known: {list(CONTENDERS)}")

    prov = collect_provenance() | {"maxtext_version": package_version("maxtext"),
                                   "params": f"compute {args.dtype}; ep={args.ep}; warmup={args.warmup} reps={args.reps} median "
                                             "wall clock of a jitted value_and_grad step"}
    print({k: prov.get(k) for k in (*TABLE_COLUMNS, "grouped_gemm", "maxtext_version")}, flush=True)
    rec = Recorder(Path(args.out), prov, FIELDS)
    deadline = time.monotonic() + args.budget_s
    for name in shape_names:
        shape = SHAPES[name]
        base = dict(shape=name, ep=args.ep, tokens=shape.batch * shape.seq, E=shape.E, top_k=shape.top_k,
                    d_model=shape.d_model, d_ff=shape.d_ff, dtype=args.dtype, weight_dtype=shape.weight_dtype)
        for contender in contenders:
            row = base | dict(contender=contender)
            if time.monotonic() > deadline:
                rec.add(row | dict(status="skipped", error="time budget (--budget-s) spent"))
                continue
            if args.isolate:
                rec.add(row | run_isolated(name, contender, argv or sys.argv[1:], deadline - time.monotonic(),
                                           args.point_timeout_s))
                continue
            result = run_guarded(shape, contender, args)
            if args.worker:
                print(ROW_TAG + json.dumps(result), flush=True)
            rec.add(row | result)
    for r in rec.rows:
        print(f"{r['shape']:12s} {r['contender']:22s} {r['status']:8s} {r.get('step_ms', ''):>9} ms "
              f"{r.get('tokens_per_s', ''):>10} tok/s {r.get('step_mib', ''):>9} MiB {r.get('turbo_body', '')} "
              f"{r.get('error', '')}")
    ok = {(r["shape"], r["contender"]): r for r in rec.rows if r["status"] == "ok"}
    for name in shape_names:
        a, b = ok.get((name, "maxtext_sparse_turbo")), ok.get((name, "maxtext_sparse"))
        if a and b:
            print(f"{name}: MaxText+turbo / MaxText sparse = {a['tokens_per_s'] / b['tokens_per_s']:.2f}x tokens/s, "
                  f"{a['step_mib'] / b['step_mib']:.2f}x memory (goal >= 2x at <= 1x)")
    print(f"wrote {rec.csv}, {rec.json} ({len(rec.rows)} rows)")


if __name__ == "__main__":
    main()
