"""Cold compile time of parameter init + train step (the layers run as one scan), by depth.

    python benchmarks/compile_time.py                      # all cases, prints a table, saves CSV + figure
    python benchmarks/compile_time.py --cases reduced,full_4 --out /tmp/ct

Each case compiles in a fresh subprocess with JAX's persistent compilation cache off, so nothing is
reused: "init" is `jit(create).lower(key).compile()` and "train" is the train step lowered on abstract
inputs (`.lower(abstract state, abstract batch).compile()`; with --overlap both compile at once, as
`turbo_moe.train.run` does, and total_s is the wall clock): nothing is allocated, so full-width
slices compile on any machine. Cases: `reduced` (16 layers) and full-width DeepSeek-V3 slices with
4 / 16 / 61 layers (exact widths, 16 routed experts so the graph stays the same size). Results carry
provenance. (The unrolled stack these were once compared with is gone: docs/configuration.md.)
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FULL_WIDTH = dict(n_experts=16, n_groups=8, topk_groups=4, top_k=8)  # exact widths, few experts
CASES = {
    # name: (preset, overrides, per_device_batch, seq_len)
    "reduced": ("reduced", {}, 8, 2048),
    "tiny": ("tiny", {}, 2, 64),  # a smoke test of the script on any machine
    "full_4": ("deepseek_v3_671b", dict(n_layers=4, **FULL_WIDTH), 1, 4096),
    "full_16": ("deepseek_v3_671b", dict(n_layers=16, **FULL_WIDTH), 1, 4096),
    "full_61": ("deepseek_v3_671b", dict(n_layers=61, **FULL_WIDTH), 1, 4096),
}
DEFAULT_RUNS = ["reduced:scan", "full_4:scan", "full_16:scan", "full_61:scan"]


def compile_case(case: str, mode: str, moe_path: str, init_impl: str, warmup: bool, overrides: dict,
                 autotune: int | None, overlap: bool = False, time_steps: int = 0) -> dict:
    """Runs in the child: compile init and train step of one case cold, return the timings."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_compilation_cache", False)
    t0 = time.perf_counter()
    if warmup:  # the process's one-time costs (backend start, first compile), measured apart
        jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile()
    t_warmup = time.perf_counter() - t0
    from turbo_moe.model import get_config
    from turbo_moe.train import TrainConfig
    from turbo_moe.train.step import abstract_batch, build_program, make_mesh, make_optimizer

    preset, preset_overrides, batch, seq = CASES[case]
    cfg = get_config(preset, **{**preset_overrides, **overrides}, moe_path=moe_path)
    tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic", seq_len=seq))
    mesh = make_mesh(jax.devices()[:1])
    t0 = time.perf_counter()
    program = build_program(cfg, tx, mesh, True, autotune)
    t_build = time.perf_counter() - t0
    key = jax.random.key(0, impl=init_impl)

    def timed(fn):
        t0 = time.perf_counter()
        return fn(), time.perf_counter() - t0

    compile_init = lambda: program.init.compile(key)  # noqa: E731  (InitProgram: picks the threefry lowering)
    compile_train = lambda: program.train.lower(program.abstract_state, abstract_batch(batch, seq, mesh)).compile()  # noqa: E731
    t0 = time.perf_counter()
    if overlap:  # as turbo_moe.train.run does: the train step compiles in a thread while init compiles
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(timed, compile_train)
            _, t_init = timed(compile_init)
            train, t_train = pending.result()
    else:
        (_, t_init), (train, t_train) = timed(compile_init), timed(compile_train)
    t_wall = time.perf_counter() - t0
    mem = train.memory_analysis()
    steps = _time_steps(program, train, key, batch, seq, mesh, time_steps, cfg.vocab_size) if time_steps else {}
    return {"case": case, "mode": mode, "moe_path": moe_path, "init_impl": init_impl, "overrides": overrides,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "gpu_autotune_level": autotune, "warmup_s": round(t_warmup, 2), "n_layers": cfg.n_layers,
            "d_model": cfg.d_model, "n_experts": cfg.n_experts, "per_device_batch": batch, "seq_len": seq,
            "build_s": round(t_build, 2), "init_compile_s": round(t_init, 2),
            "train_compile_s": round(t_train, 2), "overlap": overlap, "total_s": round(t_build + t_wall, 2),
            "train_temp_gib": round(getattr(mem, "temp_size_in_bytes", 0) / 2**30, 2) if mem else None,
            "init_lowering": program.init.last_choice.get("lowering"),
            "init_threefry_kernel_mode": program.init.mode, **steps}


def _time_steps(program, train, key, batch: int, seq: int, mesh, n: int, vocab: int) -> dict:
    """Run init and n train steps on synthetic tokens after the cold compile: what the compiled program
    runs at (the XLA flags under test change the GEMM tiles). Median of the steps after the first 2."""
    import jax
    import numpy as np

    from turbo_moe.train.step import device_batch

    rng = np.random.default_rng(0)
    state = jax.block_until_ready(program.init(key))
    tokens = rng.integers(0, vocab, size=(batch, seq + 1), dtype=np.int32)  # vocab: the config's
    data = device_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        state, metrics = train(state, data)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    step_s = float(np.median(times[2:] if n > 3 else times))
    return {"timed_steps": n, "step_ms": round(1e3 * step_s, 2), "tgs": round(batch * seq / step_s, 1)}


def run_child(case: str, mode: str, args) -> dict:
    moe_path, timeout_s = args.moe_path, args.timeout_s
    cmd = [sys.executable, __file__, "--child", f"{case}:{mode}", "--moe-path", moe_path,
           "--init-impl", args.init_impl, "--overrides", args.overrides, "--autotune-level", args.autotune_level] + (["--warmup"] if args.warmup else []) + (
        ["--overlap"] if args.overlap else []) + ["--time-steps", str(args.time_steps)]
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": ""}
    if args.init_threefry_kernel:
        env["TURBO_MOE_INIT_THREEFRY_KERNEL"] = args.init_threefry_kernel
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"case": case, "mode": mode, "moe_path": moe_path, "status": f"timeout > {timeout_s:.0f} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        return {"case": case, "mode": mode, "moe_path": moe_path,
                "status": f"error rc={out.returncode}: {out.stderr.strip().splitlines()[-1:]}"}
    return {**json.loads(lines[-1]), "status": "ok"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="case:mode list (mode: scan)")
    ap.add_argument("--moe-path", default="turbo")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per case; a timeout is a result row")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    ap.add_argument("--init-impl", default="threefry2x32", help="PRNG of the init key (threefry2x32|rbg)")
    ap.add_argument("--warmup", action="store_true", help="compile a trivial program first, timed apart")
    ap.add_argument("--overrides", default="{}", help="ModelConfig overrides as JSON, e.g. '{\"mtp_depth\": 0}'")
    ap.add_argument("--autotune-level", default="xla", help="build_program's gpu_autotune_level (0-4, or xla)")
    ap.add_argument("--overlap", action="store_true",
                    help="compile the train step in a thread while init compiles (total_s = wall clock)")
    ap.add_argument("--tag", default="", help="suffix of the CSV name (variants of one device)")
    ap.add_argument("--init-threefry-kernel", default=None, choices=(None, "auto", "on", "off"),
                    help="TURBO_MOE_INIT_THREEFRY_KERNEL for the child (default: its environment, else auto)")
    ap.add_argument("--time-steps", type=int, default=0,
                    help="after the cold compile, run init + N train steps and report step_ms/tgs (allocates)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        case, mode = args.child.split(":")
        print(json.dumps(compile_case(case, mode, args.moe_path, args.init_impl, args.warmup,
                                      json.loads(args.overrides),
                                      None if args.autotune_level == "xla" else int(args.autotune_level),
                                      args.overlap, args.time_steps)),
              flush=True)
        return

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _provenance import provenance  # noqa: E402
    from _records import write_csv  # noqa: E402

    prov = provenance()
    device = prov["device_kind"].lower().replace(" ", "_")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = out / f"compile_time_{device}{args.tag}.csv"
    rows = []
    for run in args.runs.split(","):
        case, mode = run.split(":")
        if case not in CASES or mode != "scan":
            raise SystemExit(f"--runs: {run!r} is not case:mode with case in {sorted(CASES)}, mode scan")
        row = {**run_child(case, mode, args), **prov}
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_csv(rows, table)
    print(f"\n{'case':10} {'mode':9} {'layers':>6} {'init s':>8} {'train s':>8} {'total s':>8}  status")
    for r in rows:
        print(f"{r['case']:10} {r['mode']:9} {r.get('n_layers', ''):>6} {r.get('init_compile_s', ''):>8} "
              f"{r.get('train_compile_s', ''):>8} {r.get('total_s', ''):>8}  {r['status']}")
    ok = {(r["case"], r["mode"]): r for r in rows if r["status"] == "ok"}
    if ("full_4", "scan") in ok and ("full_61", "scan") in ok:
        ratio = ok[("full_61", "scan")]["total_s"] / ok[("full_4", "scan")]["total_s"]
        print(f"61 layers / 4 layers (scan): {ratio:.2f}x (target <= 1.5x)")
    print(f"saved {table}")


if __name__ == "__main__":
    main()
