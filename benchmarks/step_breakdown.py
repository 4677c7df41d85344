"""Where a training step's time goes: device time per model part (forward / backward / remat), gaps, MFU.

    # on the machine to measure (GPU or CPU; jax + numpy + stdlib only):
    python3 benchmarks/step_breakdown.py collect --out DIR --model reduced --moe-path turbo \\
        --per-device-batch 8 --seq-len 2048 [--model-overrides '{"n_layers": 2}'] [--warmup 3 --steps 3] \
        [--train-overrides '{"moments_dtype": "bfloat16"}']
    # here (reads DIR; writes experiments/results/step_breakdown_<device>_<config>.csv (+ _ops.csv) and
    # experiments/figures/step_breakdown_<device>_<config>.png):
    python3 benchmarks/step_breakdown.py analyze DIR

collect: builds the train step as `turbo_moe.train.run` does (program_for, AOT compile), runs --warmup
steps, times --steps steps untraced, --steps under `jax.profiler`, --steps untraced again (host clock, every
step waited for), and writes into DIR, each file as soon as it exists: meta.json (parameters, provenance, compile
time, memory, step times), compiled_hlo.txt.gz (`compiled.as_text()`), cost_analysis.json,
device_events.csv.gz (the trace reduced to its device op events: process, line, kernel name, hlo_op,
hlo_module, label, start, duration) and trace.json.gz (the profiler's perfetto trace, only if < 15 MB).

analyze: maps each device event to its HLO instruction (args.hlo_op), the instruction to its
metadata op_name (fusions without metadata: the majority op_name of what they call), the op_name to a
category by the model's named scopes and to a phase (fwd: `jvp(`, bwd: `transpose(`, bwd_remat:
`rematted_computation` under `transpose(`, update: optimizer). Time on one line goes to the innermost
event; time where several streams/threads are busy is split equally, so categories sum to the union of
device busy time; gaps = traced host step time - busy time. Categories + gaps = traced step time exactly;
the report also compares the traced step time with the untraced one (profiler overhead).
"""
from __future__ import annotations

import argparse
import collections
import csv
import datetime
import gzip
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _trace_categories as tcat  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MAX_FILE_BYTES = 15 * 2**20


# ============================================================================ collect (jax, numpy, stdlib)
def _write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def _cost_analysis(compiled) -> dict:
    try:
        cost = compiled.cost_analysis()
    except Exception as error:  # noqa: BLE001 — recorded, not fatal
        return {"error": f"{type(error).__name__}: {error}"}
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    # keep the totals; per-operand entries ("bytes accessed0{}", "utilization3{}") are noise
    return {k: float(v) for k, v in (cost or {}).items() if "{" not in k}


def collect(args) -> Path:
    import jax
    import numpy as np

    from turbo_moe.data import BatchIterator, load_dataset
    from turbo_moe.model import count_params, flops_per_token
    from turbo_moe.train import metrics as M
    from turbo_moe.train.config import TrainConfig
    from turbo_moe.train.step import abstract_batch, device_batch, make_mesh, program_for

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = dict(json.loads(args.model_overrides or "{}"))
    if args.moe_path:
        overrides["moe_path"] = args.moe_path
    explicit = dict(model=args.model, model_overrides=overrides, dataset=args.dataset,
                    per_device_batch=args.per_device_batch, seq_len=args.seq_len, steps=args.warmup + 3 * args.steps,
                    warmup_steps=0, remat_policy=args.remat_policy, expert_parallel=args.expert_parallel,
                    eval_batches=0, progress=False, seed=args.seed)
    train_overrides = train_overrides_arg(args.train_overrides, explicit)
    tc = TrainConfig.from_dict({**explicit, **train_overrides})
    cfg = tc.model_config()
    seq = tc.resolved_seq_len
    dataset = load_dataset(tc.dataset, seq_len=seq, vocab_size=cfg.vocab_size, data_dir=tc.data_dir)
    params = {"model": args.model, "model_overrides": overrides, "train_overrides": train_overrides,
              "moe_path": cfg.moe_path,
              "per_device_batch": tc.per_device_batch, "seq_len": seq, "dataset": tc.dataset,
              "remat_policy": cfg.remat_policy, "expert_parallel": tc.expert_parallel,
              "warmup_steps": args.warmup, "timed_steps": args.steps, "seed": args.seed,
              "command": " ".join(sys.argv)}
    meta = {"params": params, "provenance": M.provenance(tc.to_dict(), cfg.to_dict(), dataset.info),
            "tokens_per_device": tc.per_device_batch * seq, "params_count": count_params(cfg),
            "model_flops_per_token": flops_per_token(cfg, seq)}
    meta["peak_flops"], meta["peak_flops_source"] = M.peak_flops(meta["provenance"]["device_kind"],
                                                                 meta["provenance"]["platform"])
    _write_json(out / "meta.json", meta)
    print(f"[collect] {cfg.moe_path} {args.model} b={tc.per_device_batch} s={seq} on "
          f"{jax.device_count()} x {jax.devices()[0].device_kind}", flush=True)

    mesh = make_mesh(expert_parallel=tc.expert_parallel)
    program = program_for(tc, cfg, mesh)
    state = jax.block_until_ready(program.init(jax.random.key(tc.seed)))
    global_batch = tc.per_device_batch * jax.device_count()
    start = time.perf_counter()
    compiled = program.train.lower(state, abstract_batch(global_batch, seq, mesh)).compile()
    meta["compile_time_s"] = time.perf_counter() - start
    meta["compiled_memory"] = M.compiled_memory(compiled)
    meta["cost_analysis"] = _cost_analysis(compiled)
    _write_json(out / "cost_analysis.json", meta["cost_analysis"])
    with gzip.open(out / "compiled_hlo.txt.gz", "wt") as fp:
        fp.write(compiled.as_text())
    _write_json(out / "meta.json", meta)
    print(f"[collect] compiled in {meta['compile_time_s']:.1f} s; HLO and cost analysis written", flush=True)

    batches = BatchIterator(dataset.train, global_batch, seed=tc.seed, process_index=jax.process_index(),
                            process_count=jax.process_count())
    staged = [device_batch(batches.batch_at(i), mesh) for i in range(tc.steps)]  # host prep out of the timing

    def run_steps(first: int, n: int) -> list[float]:
        nonlocal state
        times = []
        for i in range(first, first + n):
            t0 = time.perf_counter()
            state, metrics = compiled(state, staged[i])
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t0)
        return times

    meta["warmup_step_times_s"] = run_steps(0, args.warmup)
    meta["untraced_step_times_s"] = run_steps(args.warmup, args.steps)
    trace_dir = Path(args.trace_dir) if args.trace_dir else Path(tempfile.mkdtemp(prefix="step_breakdown_"))
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python function events: overhead and size, no device information
    jax.profiler.start_trace(str(trace_dir), create_perfetto_trace=True, profiler_options=options)
    try:
        meta["traced_step_times_s"] = run_steps(args.warmup + args.steps, args.steps)
    finally:
        jax.profiler.stop_trace()
    # untraced again after the trace: drift (clocks, other load) shows as a difference between the two sets
    meta["untraced_after_step_times_s"] = run_steps(args.warmup + 2 * args.steps, args.steps)
    meta["step_time_s_untraced"] = float(np.mean(meta["untraced_step_times_s"] + meta["untraced_after_step_times_s"]))
    meta["step_time_s_traced"] = float(np.mean(meta["traced_step_times_s"]))
    _write_json(out / "meta.json", meta)

    traces = sorted(trace_dir.rglob("perfetto_trace.json.gz")) or sorted(trace_dir.rglob("*.trace.json.gz"))
    if not traces:
        raise SystemExit(f"no trace json under {trace_dir}")
    raw = traces[-1]
    events = tcat.device_events(tcat.load_trace_json(raw))
    tcat.write_events_csv(events, out / "device_events.csv.gz")
    meta["files"] = {"device_events": "device_events.csv.gz", "hlo": "compiled_hlo.txt.gz",
                     "raw_trace_bytes": raw.stat().st_size, "n_device_events": len(events)}
    if raw.stat().st_size < MAX_FILE_BYTES:
        shutil.copyfile(raw, out / "trace.json.gz")
        meta["files"]["trace"] = "trace.json.gz"
    if not args.trace_dir:
        shutil.rmtree(trace_dir, ignore_errors=True)
    _write_json(out / "meta.json", meta)
    print(f"[collect] step {meta['step_time_s_untraced'] * 1e3:.2f} ms untraced, "
          f"{meta['step_time_s_traced'] * 1e3:.2f} ms traced; {len(events)} device events", flush=True)
    for path in sorted(out.iterdir()):
        if path.stat().st_size > MAX_FILE_BYTES:
            print(f"[collect] WARNING {path.name} is {path.stat().st_size / 2**20:.1f} MiB (> 15 MiB)", flush=True)
    return out


# ============================================================================ analyze (stdlib; matplotlib)
def breakdown(run_dir: Path) -> dict:
    """{meta, rows: [(category, phase, detail, ms/step)], ops: [...], busy_ms, step_ms, ...} of a collect DIR."""
    meta = json.loads((run_dir / "meta.json").read_text())
    with gzip.open(run_dir / "compiled_hlo.txt.gz", "rt") as fp:
        hlo_text = fp.read()
    hlo = tcat.parse_hlo(hlo_text)
    if (run_dir / "device_events.csv.gz").exists():
        events = tcat.read_events_csv(run_dir / "device_events.csv.gz")
    else:
        events = tcat.device_events(tcat.load_trace_json(run_dir / "trace.json.gz"))
    # Several devices (expert parallelism): each runs the same program; one device's events, not their mix
    devices = sorted({e["process"] for e in events if e["process"].startswith("/device:")},
                     key=lambda name: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)])
    if len(devices) > 1:
        events = [e for e in events if e["process"] == devices[0]]
    module = tcat.main_module(events)
    foreign = collections.Counter(e["hlo_module"] for e in events if e["hlo_module"] not in ("", module))
    events = [e for e in events if e["hlo_module"] in ("", module)]
    n_steps = len(meta["traced_step_times_s"])
    for e in events:
        e["key"] = tcat.resolve_instruction(e, hlo)
    times, union = tcat.exclusive_times(events, key=lambda e: e["key"])
    kernels = collections.defaultdict(collections.Counter)
    for e in events:
        kernels[e["key"]][e["name"]] += 1
    labels = {e["key"]: e["label"] for e in events}
    agg = collections.Counter()
    ops = []
    unmatched = 0.0
    for key, us in times.items():
        instr = hlo.get(key)
        if instr is None:  # no such instruction: try the event's own label (e.g. a GPU "name=" annotation)
            unmatched += us
            category, phase, detail = tcat.categorize(labels.get(key, ""))
            if category == "other":
                detail = "not_in_hlo"
            op_name, opcode = labels.get(key, ""), ""
        else:
            op_name, opcode = instr.op_name, instr.opcode
            category, phase, detail = tcat.categorize(op_name, opcode)
            if category == "other" and detail == "unlabelled":
                detail = "scan_loop" if "while" in op_name else ("no_metadata" if not op_name else "unscoped")
        ms = us / 1e3 / n_steps
        agg[(category, phase, detail)] += ms
        ops.append({"hlo_op": key, "category": category, "phase": phase, "detail": detail, "ms_per_step": ms,
                    "opcode": opcode, "op_name": op_name,
                    "kernels": ";".join(f"{k}x{n // n_steps or n}" for k, n in kernels[key].most_common(3))})
    ops.sort(key=lambda r: -r["ms_per_step"])
    category_of = {r["hlo_op"]: r["category"] for r in ops}
    custom_calls = collections.Counter(m.group(1) for m in re.finditer(r'custom_call_target="([^"]+)"', hlo_text))
    return {"meta": meta, "module": module, "foreign_modules": dict(foreign), "n_steps": n_steps,
            "device_shown": devices[0] if devices else "", "devices_traced": len(devices),
            "rows": [(c, p, d, ms) for (c, p, d), ms in agg.items()], "ops": ops,
            "busy_ms": union / 1e3 / n_steps, "unmatched_ms": unmatched / 1e3 / n_steps,
            "step_ms": meta["step_time_s_traced"] * 1e3, "step_ms_untraced": meta["step_time_s_untraced"] * 1e3,
            "span_ms": ((max(e["ts_us"] + e["dur_us"] for e in events) - min(e["ts_us"] for e in events))
                        / 1e3 / n_steps) if events else 0.0,
            "custom_calls": dict(custom_calls),
            "collectives": {k: v / 1e3 / n_steps for k, v in tcat.collective_overlap(events).items()},
            "gaps_before": _gaps_before(events, lambda e: category_of.get(e["key"], "other"), n_steps)}


def _gaps_before(events: list[dict], category, n_steps: int) -> dict:
    """Device idle time (ms/step) by the category of the kernel that ends it; idle stretches over 1 ms apart under
    "between_steps" (the host between two traced steps)."""
    gaps = collections.Counter()
    ordered = sorted(events, key=lambda e: e["ts_us"])
    end = ordered[0]["ts_us"] + ordered[0]["dur_us"] if ordered else 0.0
    for e in ordered[1:]:
        idle = e["ts_us"] - end
        if idle > 0:
            gaps["between_steps" if idle > 1000 else category(e)] += idle / 1e3 / n_steps
        end = max(end, e["ts_us"] + e["dur_us"])
    return dict(gaps.most_common())


def _table(b: dict) -> list[dict]:
    """One row per category (+ gaps, total): ms per step by phase, total, % of the traced step."""
    by_cat = collections.defaultdict(collections.Counter)
    for c, p, _, ms in b["rows"]:
        by_cat[c][p] += ms
    step = b["step_ms"]
    rows = []
    for c in tcat.CATEGORIES:
        if c in by_cat:
            total = sum(by_cat[c].values())
            rows.append({"category": c, **{p: by_cat[c][p] for p in tcat.PHASES}, "total_ms": total,
                         "pct_of_step": 100 * total / step})
    gaps = step - b["busy_ms"]
    rows.append({"category": "gaps", **{p: 0.0 for p in tcat.PHASES}, "total_ms": gaps, "pct_of_step": 100 * gaps / step})
    total = sum(r["total_ms"] for r in rows)
    rows.append({"category": "total", **{p: sum(r[p] for r in rows) for p in tcat.PHASES}, "total_ms": total,
                 "pct_of_step": 100 * total / step})
    return rows


def _mfu_accounting(b: dict) -> list[str]:
    from turbo_moe.model import ModelConfig, count_params
    from turbo_moe.model.accounting import attention_flops_per_token, mtp_active_params

    meta = b["meta"]
    cfg = ModelConfig.from_record(meta["provenance"]["model_config"])
    seq, tokens = meta["params"]["seq_len"], meta["tokens_per_device"]
    counts = count_params(cfg)
    model = meta["model_flops_per_token"]
    attn = attention_flops_per_token(cfg, seq)
    routed = 6.0 * 3 * cfg.d_model * cfg.moe_ffn_dim * cfg.top_k * cfg.n_router_layers
    compiled = meta.get("cost_analysis", {}).get("flops", math.nan) / tokens
    step_s = meta["step_time_s_untraced"]
    peak = meta.get("peak_flops", math.nan)
    lines = [
        f"MFU accounting (per token, per device; {tokens} tokens/device/step):",
        f"  model FLOPs/token (turbo_moe.model.flops_per_token: 6 x matmul params a token uses + attention "
        f"scores/values, causal half, x3 for training): {model:.4g}",
        f"    of which attention scores/values {attn:.4g}, routed experts (6*3*D*F*k per MoE layer incl. MTP) "
        f"{routed:.4g}, other matmuls (dense FFN, attention projections, shared experts, head incl. MTP head) "
        f"{model - attn - routed:.4g}; params total {counts['total']:.4g}, active {counts['active']:.4g}, "
        f"MTP active {mtp_active_params(cfg):.4g}",
        f"  compiled cost_analysis FLOPs/token: {compiled:.4g} (ratio compiled / model {compiled / model:.3f})",
        "    cost_analysis counts what XLA sees: remat recomputation, non-causal-halved attention if computed dense, "
        "elementwise/optimizer work; but custom calls (FFI kernels) count 0 FLOPs"
        + (f" -> missing here: {', '.join(f'{k} x{v}' for k, v in b['custom_calls'].items() if 'turbo_moe' in k)}"
           if any("turbo_moe" in k for k in b["custom_calls"]) else ""),
        f"  MFU (model FLOPs, untraced step {step_s * 1e3:.2f} ms): "
        f"{model * tokens / step_s / peak:.3%} of {meta.get('peak_flops_source', '?')}" if math.isfinite(peak)
        else f"  MFU: peak unknown ({meta.get('peak_flops_source', '?')})",
    ]
    return lines


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_")


def train_overrides_arg(text: str | None, explicit: dict) -> dict:
    """--train-overrides JSON -> dict of TrainConfig fields; a field that collect sets (or has its own
    flag for) is refused, so the recorded parameters say what ran."""
    overrides = json.loads(text or "{}")
    if not isinstance(overrides, dict):
        raise SystemExit(f"--train-overrides: expected a JSON dict of TrainConfig fields, got {text!r}")
    taken = sorted(set(overrides) & set(explicit))
    if taken:
        raise SystemExit(f"--train-overrides: {taken} are set by collect's own flags or fixed by it; "
                         "use the flags (--model-overrides for ModelConfig fields)")
    return overrides


def config_tag(params: dict) -> str:
    over = {k: v for k, v in params["model_overrides"].items() if k != "moe_path"}
    over.update(params.get("train_overrides", {}))  # absent in collects made before the flag existed
    parts = ["".join(w[0] for w in k.split("_")) + str(v) for k, v in sorted(over.items())]
    return "_".join([_slug(params["model"]) + ("-" + "-".join(_slug(p) for p in parts) if parts else ""),
                     params["moe_path"], f"b{params['per_device_batch']}", f"s{params['seq_len']}"])


def _figure(b: dict, table: list[dict], path: Path, title: str, footer: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = [r for r in table if r["category"] != "total"]
    phases = collections.Counter()
    for c, p, _, ms in b["rows"]:
        phases[p] += ms
    phase_rows = [(p, phases[p]) for p in tcat.PHASES if phases[p] > 0] + [("gaps", b["step_ms"] - b["busy_ms"])]
    fig, ax = plt.subplots(figsize=(11, 3.6))
    cmap = plt.get_cmap("tab20")
    for y, items in ((1, [(r["category"], r["total_ms"]) for r in cats]), (0, phase_rows)):
        left = 0.0
        for i, (name, ms) in enumerate(items):
            color = "lightgrey" if name == "gaps" else cmap(i % 20)
            ax.barh(y, ms, left=left, color=color, edgecolor="white", label=name if y == 1 else None)
            if ms > 0.035 * b["step_ms"]:
                ax.text(left + ms / 2, y, f"{name}\n{ms:.1f}", ha="center", va="center", fontsize=7)
            left += ms
    ax.set_yticks([0, 1], ["by phase", "by category"])
    ax.set_xlabel("ms per step (traced)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    fig.text(0.01, 0.01, footer, fontsize=6, color="dimgrey")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def analyze(args) -> dict:
    run_dir = Path(args.run_dir)
    b = breakdown(run_dir)
    meta, params, prov = b["meta"], b["meta"]["params"], b["meta"]["provenance"]
    table = _table(b)
    header = f"{'category':<15}" + "".join(f"{p:>10}" for p in tcat.PHASES) + f"{'total ms':>10}{'% step':>8}"
    print(f"\nstep breakdown: {params['model']} {params['model_overrides']} {params.get('train_overrides', {})} "
          f"b={params['per_device_batch']} "
          f"s={params['seq_len']} on {prov['device_kind']} (jax {prov['jax_version']}, {prov['git_commit']})")
    print(header)
    for r in table:
        print(f"{r['category']:<15}" + "".join(f"{r[p]:>10.3f}" for p in tcat.PHASES)
              + f"{r['total_ms']:>10.3f}{r['pct_of_step']:>7.1f}%")
    untraced, traced = b["step_ms_untraced"], b["step_ms"]
    check = abs(traced - untraced) / untraced
    print(f"measured step: {traced:.3f} ms traced, {untraced:.3f} ms untraced (profiler overhead {check:+.1%}"
          f"{'; > 10%: read the split with care' if check > 0.10 else ''}); device busy {b['busy_ms']:.3f} ms, "
          f"device span {b['span_ms']:.3f} ms, events not found in the HLO {b['unmatched_ms']:.3f} ms")
    if b["foreign_modules"]:
        print(f"excluded events of other modules: {b['foreign_modules']}")
    if b["devices_traced"] > 1:
        print(f"{b['devices_traced']} devices traced; the table is {b['device_shown']}'s")
    other = sorted(((d, ms) for c, p, d, ms in b["rows"] if c in ("other", "mtp")), key=lambda t: -t[1])
    detail = collections.Counter()
    for d, ms in other:
        detail[d] += ms
    print("other/mtp detail (ms/step): " + ", ".join(f"{d} {ms:.3f}" for d, ms in detail.most_common(12)))
    c = b["collectives"]
    print(f"NCCL kernels: {c['collective_us']:.3f} ms/step, {c['collective_beside_compute_us']:.3f} ms of it beside "
          f"another kernel ({c['collective_beside_compute_us'] / max(c['collective_us'], 1e-9):.0%}); other kernels "
          f"{c['compute_us']:.3f} ms/step")
    print("gaps (ms/step) by the kernel category that ends them: "
          + ", ".join(f"{c} {ms:.3f}" for c, ms in list(b["gaps_before"].items())[:10]))
    print("top ops:")
    for op in b["ops"][:args.top]:
        print(f"  {op['ms_per_step']:8.3f} ms {op['category']:<13} {op['phase']:<9} {op['hlo_op']:<40} "
              f"{op['op_name'][-90:]}")
    mfu = _mfu_accounting(b)
    print("\n".join(mfu))

    tag = args.tag or f"{_slug(prov['device_kind'])}_{config_tag(params)}"
    results, figures = Path(args.results_dir), Path(args.figures_dir)
    results.mkdir(parents=True, exist_ok=True)
    figures.mkdir(parents=True, exist_ok=True)
    provenance = {"device_kind": prov["device_kind"], "device_count": prov["device_count"],
                  "platform": prov["platform"], "jax_version": prov["jax_version"],
                  "flax_version": prov.get("flax_version"), "git_commit": prov["git_commit"], "date": prov["date"],
                  "model": params["model"], "model_overrides": json.dumps(params["model_overrides"], sort_keys=True),
                  "train_overrides": json.dumps(params.get("train_overrides", {}), sort_keys=True),
                  "moe_path": params["moe_path"], "per_device_batch": params["per_device_batch"],
                  "seq_len": params["seq_len"], "remat_policy": params["remat_policy"], "traced_steps": b["n_steps"],
                  "step_ms_traced": round(traced, 4), "step_ms_untraced": round(untraced, 4),
                  "busy_ms": round(b["busy_ms"], 4), "analyzed": datetime.date.today().isoformat()}
    csv_path = results / f"step_breakdown_{tag}.csv"
    with open(csv_path, "w", newline="") as fp:
        writer = csv.DictWriter(fp, fieldnames=["category", "phase", "ms_per_step", "pct_of_step", *provenance])
        writer.writeheader()
        for r in table:
            for p in (*tcat.PHASES, "all"):
                ms = r["total_ms"] if p == "all" else r[p]
                if p == "all" or ms:
                    writer.writerow({"category": r["category"], "phase": p, "ms_per_step": round(ms, 5),
                                     "pct_of_step": round(100 * ms / traced, 3), **provenance})
    ops_path = results / f"step_breakdown_{tag}_ops.csv"
    with open(ops_path, "w", newline="") as fp:
        fields = ["hlo_op", "category", "phase", "detail", "ms_per_step", "opcode", "kernels", "op_name"]
        # the run's identity on every row (the overrides stay in the category CSV: 300 copies would bloat this one)
        ops_provenance = {k: provenance[k] for k in ("device_kind", "jax_version", "git_commit", "date", "model",
                                                     "moe_path", "per_device_batch", "seq_len", "step_ms_untraced")}
        writer = csv.DictWriter(fp, fieldnames=[*fields, *ops_provenance])
        writer.writeheader()
        for op in b["ops"][:300]:
            writer.writerow({**{k: op[k] for k in fields}, "ms_per_step": round(op["ms_per_step"], 5),
                             **ops_provenance})
    fig_path = figures / f"step_breakdown_{tag}.png"
    footer = (f"{prov['device_kind']} x{prov['device_count']}, jax {prov['jax_version']}, commit {prov['git_commit']}, "
              f"{prov['date']}; traced {b['n_steps']} steps; untraced step {untraced:.2f} ms; "
              f"benchmarks/step_breakdown.py")
    title = f"step breakdown {config_tag(params)}: {traced:.2f} ms/step traced (categories + gaps = step)"
    _figure(b, table, fig_path, title, footer)
    print(f"wrote {csv_path.relative_to(REPO) if csv_path.is_relative_to(REPO) else csv_path}, {ops_path.name}, "
          f"{fig_path.relative_to(REPO) if fig_path.is_relative_to(REPO) else fig_path}")
    return {"breakdown": b, "table": table, "csv": csv_path, "ops_csv": ops_path, "figure": fig_path}


def main(argv=None) -> None:
    from turbo_moe.model import MOE_PATHS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("collect", help="build, compile, time and trace the train step; write DIR")
    c.add_argument("--out", required=True)
    c.add_argument("--model", default="tiny", help="preset name")
    c.add_argument("--model-overrides", default="{}", help="JSON dict of ModelConfig overrides")
    c.add_argument("--train-overrides", default="{}",
                   help='JSON dict of TrainConfig fields collect does not set, e.g. {"moments_dtype": "bfloat16"}')
    c.add_argument("--moe-path", default=None, choices=(None, *MOE_PATHS))
    c.add_argument("--per-device-batch", type=int, default=2)
    c.add_argument("--seq-len", type=int, default=None)
    c.add_argument("--dataset", default="synthetic")
    c.add_argument("--remat-policy", default=None)
    c.add_argument("--expert-parallel", type=int, default=1)
    c.add_argument("--warmup", type=int, default=3)
    c.add_argument("--steps", type=int, default=3, help="steps timed untraced, then traced, then untraced again")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--trace-dir", default=None, help="keep the raw profiler output here (default: a temp dir)")
    a = sub.add_parser("analyze", help="categorise a collect DIR; print, write CSV + PNG")
    a.add_argument("run_dir")
    a.add_argument("--results-dir", default=str(REPO / "experiments" / "results"))
    a.add_argument("--figures-dir", default=str(REPO / "experiments" / "figures"))
    a.add_argument("--tag", default=None, help="file-name tag (default: <device>_<config>)")
    a.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    if args.mode == "collect":
        collect(args)
    else:
        analyze(args)


if __name__ == "__main__":
    main()
