"""Does XLA:GPU run a collective beside compute that does not depend on it? The schedule and the time, on >= 2 GPUs.

    python benchmarks/overlap_probe.py --out DIR [--flag-sets default,lhs,stream] [--cases ...] [--small]

The expert-parallel step showed no kernel inside any collective's window (docs/expert-parallel.md). This asks the
same question of programs with nothing else in them, under `shard_map` over every device: in each case a collective
of `a` and a matmul of `b` that do not depend on each other, so any scheduler may overlap them.
  ppermute, all_to_all, all_gather   one collective beside one matmul
  two_chains                          two micro-batches, each all_to_all -> matmul -> all_to_all (the EP pattern)
Each case is compiled five ways (a child process each, since XLA reads its flags once):
  default   the flags as inherited
  lhs       --xla_gpu_enable_latency_hiding_scheduler=true
  group     lhs, and the collective and the matmul to overlap carry one `_scheduling_group_id` (XLA's scheduling
            annotations, set with jax.experimental.xla_metadata): the scheduler is told to run them together
  nocb      lhs, with XLA's command buffers (CUDA graphs) off: --xla_gpu_enable_command_buffer=
  stream    lhs plus --xla_gpu_experimental_stream_annotation=true, the matmuls inside
            `compute_on2(compute_type="gpu_stream:1")` (XLA runs an annotated call on a second stream, async)
A row: the collectives with and without kernels inside their start/done window (benchmarks/hlo_schedule.py on the
compiled module), and wall times (median of --reps) of the collective alone, the matmul alone and both:
overlap = (t_comm + t_compute - t_both) / min(t_comm, t_compute), 1 = the shorter one fully hidden, 0 = serial.
<DIR>/overlap_probe.csv and .json with provenance, rewritten after each flag set. A case that fails is a row.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _records import median_ms, write_table_and_record
from hlo_schedule import parse, windows

FLAG_SETS = {
    "default": "",
    "lhs": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "group": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "nocb": "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_enable_command_buffer=",
    "stream": "--xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_experimental_stream_annotation=true",
}
CASES = ("ppermute", "all_to_all", "all_gather", "two_chains")


def _collective(kind: str, a, axis: str, n: int):
    import jax
    if kind == "ppermute":
        return jax.lax.ppermute(a, axis, [(i, (i + 1) % n) for i in range(n)])
    if kind == "all_gather":
        return jax.lax.all_gather(a, axis, tiled=True)
    return jax.lax.all_to_all(a, axis, 0, 0, tiled=True)


def _matmul(b, w, on_stream: bool):
    import jax
    if not on_stream:
        return b @ w
    from jax.experimental.compute_on import compute_on2
    return compute_on2(lambda x, y: x @ y, compute_type="gpu_stream:1",
                       out_memory_spaces=jax.memory.Space.Device)(b, w)


def _together(group: int | None):
    """Scheduling group `group` for the ops traced inside (None: no annotation)."""
    import contextlib
    if group is None:
        return contextlib.nullcontext()
    from jax.experimental.xla_metadata import set_xla_metadata
    return set_xla_metadata(_scheduling_group_id=str(group))


def programs(case: str, mesh, flag_set: str) -> dict:
    """{'comm': f, 'compute': f, 'both': f}, each jitted over (a, b, w) sharded on the mesh's one axis."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P
    n = mesh.size
    on_stream, grouped = flag_set == "stream", flag_set == "group"
    spec = P("x")
    shard = partial(jax.shard_map, mesh=mesh, in_specs=(spec, spec, P()), out_specs=spec)
    a2a = partial(_collective, "all_to_all", axis="x", n=n)
    mm = partial(_matmul, on_stream=on_stream)

    if case == "two_chains":  # micro-batch 1's dispatch beside 0's matmul, 0's combine beside 1's matmul
        def both(a, b, w):
            half = a.shape[0] // 2
            h0 = a2a(a[:half])
            with _together(0 if grouped else None):
                h1, m0 = a2a(a[half:]), mm(h0, w)
            with _together(1 if grouped else None):
                o0, m1 = a2a(m0), mm(h1, w)
            return jnp.concatenate([o0, a2a(m1)]) + 0 * b[:1, :1].sum()

        def comm(a, b, w):
            half = a.shape[0] // 2
            return jnp.concatenate([a2a(a2a(a[:half])), a2a(a2a(a[half:]))])

        def compute(a, b, w):
            half = a.shape[0] // 2
            return jnp.concatenate([mm(a[:half], w), mm(a[half:], w)])
        return {k: jax.jit(shard(f)) for k, f in (("comm", comm), ("compute", compute), ("both", both))}

    def both(a, b, w):
        with _together(0 if grouped else None):
            y, z = _collective(case, a, "x", n), mm(b, w)
        return y.sum() + z.sum().astype(y.dtype) + 0 * a[:1]

    def comm(a, b, w):
        return _collective(case, a, "x", n).sum() + 0 * a[:1]

    def compute(a, b, w):
        return mm(b, w).sum().astype(a.dtype) + 0 * a[:1]
    return {k: jax.jit(shard(f)) for k, f in (("comm", comm), ("compute", compute), ("both", both))}


def child(flag_set: str, cases: list[str], small: bool, reps: int) -> None:
    """Run every case under this process's XLA flags; one JSON line a case on stdout."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    n = mesh.size
    rows_a, width, rows_b = (n * 64, 128, n * 64) if small else (n * 16384, 8192, n * 4096)
    key_a, key_b, key_w = jax.random.split(jax.random.key(0), 3)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    a = put(jax.random.normal(key_a, (rows_a, width), jnp.bfloat16), P("x"))
    b = put(jax.random.normal(key_b, (rows_b, width), jnp.bfloat16), P("x"))
    w = put(jax.random.normal(key_w, (width, width), jnp.bfloat16), P())
    for case in cases:
        row = {"flag_set": flag_set, "xla_flags": os.environ.get("XLA_FLAGS", ""), "case": case, "devices": n,
               "a_bytes_per_device": rows_a // n * width * 2, "matmul_flop_per_device": 2 * rows_b // n * width * width}
        try:
            fns = programs(case, mesh, flag_set)
            found = windows(parse(fns["both"].lower(a, b, w).compile().as_text()))
            row.update(collectives=len(found), with_kernels_inside=sum(bool(e["inside"]) for e in found),
                       synchronous=sum(e["sync"] for e in found),
                       inside=";".join(sorted({k for e in found for k, _ in e["inside"]}))[:300])
            for name in ("comm", "compute", "both"):
                for _ in range(3):  # compile and warm up
                    jax.block_until_ready(fns[name](a, b, w))
                row[f"{name}_ms"] = round(median_ms(fns[name], a, b, w, reps=reps), 4)
            t_c, t_m, t_b = row["comm_ms"], row["compute_ms"], row["both_ms"]
            row["overlap"] = round((t_c + t_m - t_b) / max(min(t_c, t_m), 1e-9), 3)
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 (a case XLA refuses is data)
            row.update(status="failed", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        print("PROBE_ROW " + json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="folder for overlap_probe.csv/.json")
    ap.add_argument("--flag-sets", default=",".join(FLAG_SETS), help=f"comma list of {list(FLAG_SETS)}")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {list(CASES)}")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--small", action="store_true", help="tiny arrays (a CPU check of the script)")
    ap.add_argument("--timeout-s", type=float, default=240, help="per flag set")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; expected some of {list(CASES)}")
    if args.child:
        child(args.child, cases, args.small, args.reps)
        return
    if args.out is None:
        ap.error("--out is required")
    flag_sets = [f for f in args.flag_sets.split(",") if f]
    if bad := [f for f in flag_sets if f not in FLAG_SETS]:
        ap.error(f"--flag-sets: unknown {bad}; expected some of {list(FLAG_SETS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for flag_set in flag_sets:
        env = dict(os.environ, XLA_FLAGS=" ".join(x for x in (os.environ.get("XLA_FLAGS", ""), FLAG_SETS[flag_set]) if x))
        cmd = [sys.executable, __file__, "--child", flag_set, "--cases", ",".join(cases), "--reps", str(args.reps)]
        try:
            proc = subprocess.run(cmd + (["--small"] if args.small else []), env=env, capture_output=True, text=True, check=False,
                                  timeout=args.timeout_s)
            got = [json.loads(line[len("PROBE_ROW "):]) for line in proc.stdout.splitlines()
                   if line.startswith("PROBE_ROW ")]
            tail = (proc.stderr.strip().splitlines() or [""])[-1][:300]
        except subprocess.TimeoutExpired as e:
            got, tail = [json.loads(line[len("PROBE_ROW "):]) for line in (e.stdout or b"").decode().splitlines()
                         if line.startswith("PROBE_ROW ")], f"timeout after {args.timeout_s} s"
        done = {r["case"] for r in got}
        got += [{"flag_set": flag_set, "case": c, "status": "failed", "error": tail} for c in cases if c not in done]
        rows += got
        for r in got:
            print(f"{flag_set:8s} {r['case']:11s} {r['status']:6s} collectives {r.get('collectives', '-')}, "
                  f"with kernels inside {r.get('with_kernels_inside', '-')}; comm {r.get('comm_ms', '-')} ms, "
                  f"compute {r.get('compute_ms', '-')} ms, both {r.get('both_ms', '-')} ms, "
                  f"overlap {r.get('overlap', '-')} {r.get('error', '')}", flush=True)
        write_table_and_record(rows, args.out / "overlap_probe.csv", json.dumps(vars(args), default=str))


if __name__ == "__main__":
    main()
