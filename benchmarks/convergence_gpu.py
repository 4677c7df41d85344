"""The drop penalty at scale: turbo against dense_cf's drops, several seeds, one run per GPU, resumable across calls.

Runs (seed-major: every path of seed 0, then seed 1, ...): the dropless turbo path and dense_cf at each capacity
factor. By default the dense_cf runs are turbo with dense_cf's drops (`ModelConfig.drop_tokens`,
`turbo_moe.model.capacity`): the same pairs dropped and the same losses and gradients as dense_cf, at turbo's speed
(dense_cf itself runs ~2.5x slower); `--drops-on dense_cf` runs dense_cf itself. Each run trains `--tokens` tokens
(the LR schedule spans them all) with held-out loss every `--eval-every` steps on one fixed eval set (the first
`--eval-batches` batches of the validation split: the same for every run).

One process per GPU (CUDA_VISIBLE_DEVICES), `--gpus` at a time. A run trains in chunks: each chunk is one
`turbo_moe.train.run` that restores the run's checkpoint (`--state`/<label>/ckpt), trains as many steps as fit before
`--max-seconds` (from the speed this run or this machine measured; a prior by GPU kind before that), evaluates and
saves. A worker still running at `--max-seconds` is killed: its chunk is lost, the checkpoint before it is not. Runs
with the least progress go first, so a call keeps every GPU busy and the last call finishes the runs together. A
run that fails is recorded as failed (its error in the log and the record); the others go on.

Output (--out, written after every chunk, a handful of files as the GPU machine returns at most 8):
  drop_penalty_runs.json   every run's record: spec, status, steps done, eval points, per-step rows, provenance
  summary.md               progress of each run, per-path final eval loss and the penalty with its t-intervals
  log.txt                  the orchestrator's log and the tail of every failed worker's
State (--state, kept on the GPU machine between calls while it stays warm): <label>/{state.json,record.json,ckpt/}.

GPU (4 GPUs, one call of <= 10 minutes; repeat the same command until summary.md says every run is done):
  bash benchmarks/drop_penalty_gpu.sh $OUT
CPU smoke test (`reduced` at toy sizes, 2 worker processes, 24 steps; `--model tiny --dataset synthetic`: quicker):
  python benchmarks/convergence_gpu.py --smoke --out /tmp/dp_smoke --state /tmp/dp_smoke_state
Data: the token cache is built here (with the network) and carried (~21 MB):
  TURBO_MOE_DATA_DIR=build/data_cache python benchmarks/convergence_gpu.py --prepare-data --export build/gpu_data
Analysis (a call's drop_penalty_runs.json into a results campaign, which `turbo-moe report` ingests and draws):
  python benchmarks/convergence_gpu.py --analyze-only --from <call files>/drop_penalty_runs.json \\
      --out experiments/results/drop_penalty_50m_h100 --figure experiments/figures/drop_penalty_50m_h100.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _records import parse_paths  # noqa: E402

SMOKE_SIZES = dict(  # a tiny `reduced`-like model: same routing proportions, CPU-sized
    d_model=64, n_layers=3, n_dense_layers=1, dense_ffn_dim=128, moe_ffn_dim=16, n_heads=2,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    max_seq_len=64, remat_policy="none", dtype="float32", loss_chunk_tokens=0,
)
ROUTER_FIELDS = ("router_recipe", "router_bias_rate", "n_experts", "top_k", "n_groups", "topk_groups",
                 "routed_scaling_factor", "capacity_factor")
STEP_KEYS = ("step", "loss", "ce_loss", "dropped_fraction", "load_max_over_mean", "load_max_over_mean_worst_layer",
             "step_time_s", "lr")
PRIOR_TGS = {"H200": 115_000.0, "H100": 82_000.0}  # tokens/s a chunk is planned with before one was measured here
PRIOR_OVERHEAD_S = 240.0  # set-up, cold compile and a 17 GB save of a `reduced` chunk, before one was measured
MARGIN_S = 30.0  # planned chunks end this long before --max-seconds
SAFETY = 1.1  # estimated step and overhead times are padded by this factor
RUNS_FILE = "drop_penalty_runs.json"


@dataclasses.dataclass(frozen=True)
class RunSpec:
    label: str
    path: str  # the moe_path that runs
    capacity_factor: float | None  # the ModelConfig field (None: the preset's)
    drops_as: float | None  # the dense_cf capacity factor whose drops this run has (None: dropless)
    seed: int

    @property
    def analysis_path(self) -> str:  # what the penalty compares: dense_cf's drops, however they were run
        return self.path if self.drops_as is None else "dense_cf"


def plan(paths: list[tuple[str, float]], seeds: list[int], drops_on: str) -> list[RunSpec]:
    """The runs, seed-major. dense_cf:X runs on `drops_on` ("turbo": turbo with drop_tokens at capacity_factor X)."""
    runs = []
    for seed in seeds:
        for path, cf in paths:
            if path != "dense_cf":
                runs.append(RunSpec(f"{path}_seed{seed}", path, None, None, seed))
            elif drops_on == "dense_cf":
                runs.append(RunSpec(f"dense_cf_cf{cf:g}_seed{seed}", "dense_cf", cf, cf, seed))
            else:
                runs.append(RunSpec(f"{drops_on}_dropcf{cf:g}_seed{seed}", drops_on, cf, cf, seed))
    return runs


def total_steps(args) -> int:
    return max(1, math.ceil(args.tokens / (args.batch * args.seq)))


# ---------------------------------------------------------------------------------------------------- the worker
def train_config(args, spec: RunSpec, until: int, state_dir: Path):
    from turbo_moe.train import TrainConfig

    overrides = {"vocab_size": args.vocab, "moe_path": spec.path, **(SMOKE_SIZES if args.smoke else {})}
    if spec.capacity_factor is not None:
        overrides["capacity_factor"] = spec.capacity_factor
        overrides["drop_tokens"] = spec.path != "dense_cf"  # a dropless path with dense_cf's drops
    for item in args.override:
        key, _, value = item.partition("=")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    ckpt = state_dir / spec.label / "ckpt"
    # a chunk that trains a run from its start to its end saves nothing: its record is the result, and a `reduced`
    # checkpoint is ~17 GB of disk written at the end of the chunk (one a resumed run still restores from)
    needs_ckpt = until < total_steps(args) or ckpt.exists()
    return TrainConfig(model=args.model, model_overrides=overrides, dataset=args.dataset, per_device_batch=args.batch,
                       seq_len=args.seq, steps=until, lr_schedule_steps=total_steps(args), learning_rate=args.lr,
                       warmup_steps=args.warmup, eval_every=args.eval_every, eval_batches=args.eval_batches,
                       seed=spec.seed, checkpoint_dir=str(ckpt) if needs_ckpt else None, checkpoint_every=0,
                       keep_checkpoints=1, resume=needs_ckpt, progress=False)


def eval_points(history: list[dict], tokens_per_step: int, eval_every: int, total: int) -> list[dict]:
    """The eval points at multiples of eval_every and at the end (a chunk's own last step evaluates too: left out,
    so a run cut into chunks has the points of one that was not)."""
    points = []
    for h in history:
        done = h["step"] + 1
        if isinstance(h.get("eval_loss"), float) and math.isfinite(h["eval_loss"]) and (
                done % eval_every == 0 or done == total):
            points.append({"step": done, "tokens": done * tokens_per_step, "eval_loss": h["eval_loss"],
                           "loss": h["loss"], "ce_loss": h["ce_loss"], "dropped_fraction": h["dropped_fraction"],
                           "load_max_over_mean": h["load_max_over_mean"]})
    return points


def step_rows(history: list[dict]) -> dict[str, list]:
    return {k: [h.get(k) for h in history] for k in STEP_KEYS}


def work(args, spec: RunSpec, until: int, state_dir: Path) -> int:
    """One chunk of one run (in this process): train to step `until`, write <label>/record.json."""
    import jax
    from _provenance import provenance

    from turbo_moe.model.capacity import regime
    from turbo_moe.train import run

    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # later chunks and runs load the compiled programs
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    tc = train_config(args, spec, until, state_dir)
    model_cfg = tc.model_config()
    t0 = time.time()
    result = run(tc)
    wall = time.time() - t0
    tokens_per_step = int(result.summary.get("tokens_per_step") or args.batch * args.seq)
    total = total_steps(args)
    steps_done = int(result.history[-1]["step"]) + 1 if result.history else 0
    keep = ("tgs", "step_time_s", "compile_time_s", "phase_seconds", "final_loss", "final_eval_loss",
            "dropped_fraction_mean", "load_max_over_mean_mean", "peak_memory_bytes", "params_total",
            "params_active", "steps_done", "tokens_per_step", "mfu")
    status = result.status if result.status != "ok" else ("ok" if steps_done >= total else "partial")
    record = {
        **dataclasses.asdict(spec), "analysis_path": spec.analysis_path, "regime": regime(model_cfg),
        "capacity_factor": spec.drops_as, "status": status, "error": result.error, "steps_done": steps_done,
        "steps_total": total, "tokens_per_step": tokens_per_step, "train_config": tc.to_dict(),
        "router": {k: model_cfg.to_dict().get(k) for k in ROUTER_FIELDS},
        "evals": eval_points(result.history, tokens_per_step, args.eval_every, total),
        "steps": step_rows(result.history), "final_expert_load": result.expert_load,
        "chunk": {"wall_s": round(wall, 1), "summary": {k: result.summary.get(k) for k in keep}},
        "provenance": {**provenance(), "run": result.provenance},
    }
    _write_json(state_dir / spec.label / "record.json", record)
    return 0 if result.status in ("ok", "nan") else 1


# ---------------------------------------------------------------------------------------------- the orchestrator
def _write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text(json.dumps(value, indent=1, default=str))
    tmp.replace(path)


def _read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return default


def gpu_kind() -> str:
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return next((k for k in PRIOR_TGS if k in names), "gpu" if names.strip() else "cpu")


class Orchestrator:
    """Runs chunks on `slots` workers until every run is done or the time is up; keeps the state on disk."""

    def __init__(self, args, runs: list[RunSpec], state_dir: Path, out: Path, argv: list[str]):
        self.args, self.runs, self.state_dir, self.out, self.argv = args, runs, state_dir, out, argv
        self.start = time.time()
        self.deadline = self.start + args.max_seconds
        self.kind = gpu_kind()
        self.total = total_steps(args)
        self.log_lines: list[str] = []

    def log(self, text: str) -> None:
        line = f"[{time.time() - self.start:6.0f}s] {text}"
        print(line, flush=True)
        self.log_lines.append(line)

    def state(self, spec: RunSpec) -> dict:
        return _read_json(self.state_dir / spec.label / "state.json", {"status": "pending", "steps_done": 0,
                                                                      "chunks": []})

    def step_estimate(self, spec: RunSpec) -> tuple[float, float, bool]:
        """(seconds per step, overhead seconds per chunk, measured) for the next chunk of `spec`: its own measurements,
        else this machine's other runs', else the priors (measured False)."""
        own = [c for c in self.state(spec)["chunks"] if c.get("steps", 0) > 0 and c.get("kind") == self.kind]
        every = own or [c for r in self.runs for c in self.state(r)["chunks"]
                        if c.get("steps", 0) > 0 and c.get("kind") == self.kind]
        if every:
            step_s = max(c["train_s"] / c["steps"] for c in every[-4:])
            overhead = max(c["overhead_s"] for c in every[-4:])
            return step_s, overhead, True
        if self.args.prior_step_s:
            return self.args.prior_step_s, self.args.prior_overhead_s, False
        tgs = PRIOR_TGS.get(self.kind, 60_000.0)
        return self.args.batch * self.args.seq / tgs, self.args.prior_overhead_s, False

    def next_chunk(self, busy: set[str]) -> tuple[RunSpec, int] | None:
        """The unfinished run with the least progress whose chunk still fits, and the step it trains to."""
        left = self.deadline - time.time() - min(MARGIN_S, 0.1 * self.args.max_seconds)
        todo = [r for r in self.runs if r.label not in busy and self.state(r)["status"] in ("pending", "partial")]
        for spec in sorted(todo, key=lambda r: self.state(r)["steps_done"]):
            step_s, overhead, measured = self.step_estimate(spec)
            done = self.state(spec)["steps_done"]
            # a chunk cut at the deadline loses all its steps, one that ends early a few: estimates padded, except
            # to finish a run that fits unpadded (else a few steps left over would cost a chunk of their own)
            steps = int((left - SAFETY * overhead) / (SAFETY * step_s))
            if measured and self.total - done <= (left - overhead) / step_s:
                steps = self.total - done
            steps = min(self.total - done, steps)
            steps = min(steps, self.args.max_chunk_steps or steps)
            if steps >= min(self.args.min_chunk_steps, self.total - done, self.args.max_chunk_steps or math.inf):
                return spec, done + steps
        return None

    def launch(self, spec: RunSpec, until: int, slot: int) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if self.kind != "cpu":
            env["CUDA_VISIBLE_DEVICES"] = str(slot)
        cmd = [sys.executable, __file__, *self.argv, "--worker", spec.label, "--until", str(until)]
        with open(self.state_dir / spec.label / "log.txt", "a") as log:  # the worker keeps its own descriptor
            log.write(f"\n=== chunk to step {until} on slot {slot} at {time.strftime('%H:%M:%S')}\n")
            log.flush()
            # its own process group: a cut kills the worker with everything it started
            return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def finish(self, spec: RunSpec, proc: subprocess.Popen, until: int, started: float, cut: bool) -> None:
        state = self.state(spec)
        record = _read_json(self.state_dir / spec.label / "record.json")
        wall = time.time() - started
        fresh = record is not None and record.get("steps_done", 0) > state["steps_done"] and not cut
        if fresh:
            steps = record["steps_done"] - state["steps_done"]
            phases = record["chunk"]["summary"].get("phase_seconds") or {}
            train_s = float(phases.get("training", 0.0)) + float(phases.get("evaluation", 0.0)) or wall
            state["chunks"].append({"kind": self.kind, "steps": steps, "train_s": train_s,
                                    "overhead_s": max(wall - train_s, 0.0), "wall_s": wall})
            state["steps_done"] = record["steps_done"]
            state["status"] = {"ok": "done", "partial": "partial"}.get(record["status"], "failed")
            state["error"] = record.get("error")
        elif cut:
            state["chunks"].append({"kind": self.kind, "steps": 0, "cut_after_s": wall})
        else:  # the worker died without a new record: a crash, not a result
            state["status"] = "failed"
            tail = (self.state_dir / spec.label / "log.txt").read_text()[-3000:]
            state["error"] = f"worker exited {proc.returncode} without a record; log tail:\n{tail}"
        _write_json(self.state_dir / spec.label / "state.json", state)
        if state["status"] == "done":  # the record is complete; a `reduced` checkpoint is ~17 GB of disk
            shutil.rmtree(self.state_dir / spec.label / "ckpt", ignore_errors=True)
        self.log(f"{spec.label}: {'cut at the deadline' if cut else state['status']} at step {state['steps_done']}/"
                 f"{self.total} ({wall:.0f}s)" + (f"; error: {str(state.get('error'))[:1500]}"
                                                  if state["status"] == "failed" else ""))
        self.write_outputs()

    def run(self) -> int:
        for spec in self.runs:
            (self.state_dir / spec.label).mkdir(parents=True, exist_ok=True)
        self.log(f"{len(self.runs)} runs of {self.total} steps on {self.args.gpus} {self.kind} slot(s); deadline "
                 f"{self.args.max_seconds:g}s")
        running: dict[int, tuple[RunSpec, subprocess.Popen, int, float]] = {}
        try:
            self._loop(running)
        finally:  # an error here must not leave workers training past the call
            for _, proc, _, _ in running.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        self.write_outputs()
        states = [self.state(r)["status"] for r in self.runs]
        self.log(f"done: {states.count('done')}/{len(states)} runs finished, {states.count('failed')} failed")
        return 1 if "failed" in states else 0

    def _loop(self, running: dict) -> None:
        while True:
            for slot in range(self.args.gpus):
                if slot in running:
                    continue
                nxt = self.next_chunk({s.label for s, *_ in running.values()})
                if nxt is None:
                    break
                spec, until = nxt
                self.log(f"{spec.label}: steps {self.state(spec)['steps_done']} -> {until} on slot {slot}")
                running[slot] = (spec, self.launch(spec, until, slot), until, time.time())
            if not running:
                break
            time.sleep(2.0)
            cut = time.time() > self.deadline
            for slot, (spec, proc, until, started) in list(running.items()):
                if cut and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    self.finish(spec, proc, until, started, cut=True)
                    del running[slot]
                elif proc.poll() is not None:
                    self.finish(spec, proc, until, started, cut=False)
                    del running[slot]

    def write_outputs(self) -> None:
        records = []
        for spec in self.runs:
            record = _read_json(self.state_dir / spec.label / "record.json") or {
                **dataclasses.asdict(spec), "analysis_path": spec.analysis_path, "capacity_factor": spec.drops_as,
                "status": "pending", "steps_done": 0, "steps_total": self.total, "evals": []}
            state = self.state(spec)
            record = dict(record, run_state=state)
            if state["status"] == "failed":
                record["status"] = "failed"
            records.append(record)
        self.out.mkdir(parents=True, exist_ok=True)
        _write_json(self.out / RUNS_FILE, records)
        try:
            text = summary_text(records)
        except Exception as error:  # noqa: BLE001 — the records are written; a summary is not worth a run
            text = f"summary not written: {type(error).__name__}: {error}"
        (self.out / "summary.md").write_text(text + "\n")
        (self.out / "log.txt").write_text("\n".join(self.log_lines) + "\n")


# ------------------------------------------------------------------------------------------------------ analysis
def summary_text(records: list[dict]) -> str:
    from turbo_moe.experiments.report import convergence as C

    lines = ["| run | regime | status | steps | last eval loss | dropped (mean) |", "|---|---|---|---|---|---|"]
    for r in records:
        last = r["evals"][-1]["eval_loss"] if r.get("evals") else math.nan
        dropped = [x for x in (r.get("steps") or {}).get("dropped_fraction", []) if x is not None]
        lines.append(f"| {r['label']} | {r.get('regime', '?')} | {r['status']} | {r.get('steps_done', 0)}/"
                     f"{r.get('steps_total', '?')} | {last:.4f} | "
                     f"{max(sum(dropped) / len(dropped), 0.0) if dropped else math.nan:.4f} |")
    finished = [dict(r, status="ok") for r in records if r["status"] == "ok"]
    return "\n".join(lines) + "\n\n" + C.format_summary(C.summarize(finished))


def analyze(out: Path, figure: Path | None, sources: list[Path] | None = None) -> str:
    """runs/<label>.json, evals.csv, summary.md and the figure in `out` (a results campaign folder, which the store
    ingests) from the GPU calls' drop_penalty_runs.json files (`sources`, default <out>/drop_penalty_runs.json).
    Several calls' files merge run by run; a label in two files is refused (which one holds the run is unclear)."""
    import csv

    from turbo_moe.experiments.report import convergence as C

    records: list[dict] = []
    for source in sources or [out / RUNS_FILE]:
        found = _read_json(source)
        if found is None:
            raise FileNotFoundError(f"{source} is missing or not JSON: give a GPU call's {RUNS_FILE} with --from")
        twice = {r["label"] for r in found} & {r["label"] for r in records}
        if twice:
            raise ValueError(f"--from {source}: runs {sorted(twice)} are already in an earlier --from file")
        records += found
    for r in records:
        _write_json(out / "runs" / f"{r['label']}.json", r)
    rows = [{"label": r["label"], "path": C.run_label(r), "seed": r["seed"], **e}
            for r in records if r["status"] in ("ok", "partial") for e in r["evals"]]
    if rows:
        with (out / "evals.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    text = summary_text(records)
    provs = [r["provenance"] for r in records if r.get("provenance")] or [{}]

    def each(key: str, width: int = 0) -> str:  # every distinct value, in run order
        return ", ".join(dict.fromkeys(str(p.get(key, "?"))[:width or None] for p in provs))

    footer = (f"{each('device_kind')} | jax {each('jax_version')} | commit {each('git_commit', 12)} | "
              f"{each('date', 10)} | benchmarks/convergence_gpu.py")
    (out / "summary.md").write_text(f"{footer}\n\n{text}\n")
    (out / "summary.json").write_text(json.dumps(C.summarize([r for r in records if r["status"] == "ok"]),
                                                 indent=1, default=str))
    if figure is not None and rows:
        C.plot_drop_penalty(records, figure, footer=footer)
    return text


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output directory (created)")
    p.add_argument("--state", default=str(REPO / "build" / "conv_ckpt"), help="checkpoints and run state")
    p.add_argument("--paths", default="turbo,dense_cf:1.0,dense_cf:1.25", help="comma list of path[:capacity_factor]")
    p.add_argument("--drops-on", default="turbo", help="the path dense_cf:X runs as ('dense_cf': dense_cf itself)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--only", default="", help="comma list of run labels: run just these of paths x seeds")
    p.add_argument("--model", default="reduced")
    p.add_argument("--dataset", default="pd_english_xl", help="a named dataset or a path (C4-style jsonl.gz, ...)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=float, default=50e6, help="training tokens per run")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=122, help="steps between held-out evals (~2M tokens)")
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--override", action="append", default=[], help="ModelConfig field=value (JSON value)")
    p.add_argument("--gpus", type=int, default=4, help="runs at a time, one a GPU")
    p.add_argument("--max-seconds", type=float, default=540.0, help="wall budget of this call")
    p.add_argument("--min-chunk-steps", type=int, default=50, help="start no chunk shorter than this")
    p.add_argument("--max-chunk-steps", type=int, default=0, help="chunks of at most this many steps (0: no cap)")
    p.add_argument("--prior-step-s", type=float, default=0.0, help="seconds a step before any was measured")
    p.add_argument("--prior-overhead-s", type=float, default=PRIOR_OVERHEAD_S)
    p.add_argument("--figure", default=None, help="--analyze-only: figure path (default <out>/drop_penalty.png)")
    p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: seq 64, batch 2, 24 steps, 2 slots")
    p.add_argument("--prepare-data", action="store_true", help="build the dataset's token cache and exit")
    p.add_argument("--export", help="--prepare-data: copy the prepared tokens into this folder (to carry)")
    p.add_argument("--analyze-only", action="store_true", help="write runs/, evals.csv, summary and figure from --out")
    p.add_argument("--from", dest="sources", type=Path, action="append",
                   help=f"--analyze-only: a call's {RUNS_FILE} (repeat to merge calls; default: the one in --out)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--until", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.seq, args.batch, args.tokens, args.warmup, args.eval_every, args.eval_batches = 64, 2, 24 * 128, 2, 6, 2
        args.gpus, args.min_chunk_steps = min(args.gpus, 2), min(args.min_chunk_steps, 4)
        args.prior_step_s = args.prior_step_s or 0.5
        args.prior_overhead_s = min(args.prior_overhead_s, 60.0)

    if args.prepare_data:
        from turbo_moe.data import load_dataset

        ds = load_dataset(args.dataset, seq_len=args.seq, vocab_size=args.vocab)
        print(json.dumps(ds.info, indent=1))
        print(f"{len(ds.train)} train / {len(ds.val)} validation sequences of {args.seq}; {args.tokens:g} tokens a "
              f"run = {args.tokens / (len(ds.train) * (args.seq + 1)):.2f} epochs")
        if args.export and ds.info.get("prepared"):  # the manifest and its token file: all a GPU machine reads
            manifest = Path(ds.info["prepared"])
            target = Path(args.export) / manifest.parent.name
            target.mkdir(parents=True, exist_ok=True)
            for file in (manifest, manifest.parent / json.loads(manifest.read_text())["token_file"]):
                shutil.copy2(file, target / file.name)
            print(f"exported to {target} (carry {args.export}; TURBO_MOE_DATA_DIR={args.export} there)")
        return 0
    if not args.out and not args.worker:
        p.error("--out is required")
    state_dir = Path(args.state).resolve()  # orbax wants absolute checkpoint paths
    runs = plan(parse_paths(args.paths), [int(s) for s in args.seeds.split(",")], args.drops_on)
    if args.only:
        wanted = [label.strip() for label in args.only.split(",")]
        unknown = sorted(set(wanted) - {r.label for r in runs})
        if unknown:
            p.error(f"--only {unknown} are none of the planned runs {[r.label for r in runs]}")
        runs = [r for r in runs if r.label in wanted]
    if args.worker:
        spec = next((r for r in runs if r.label == args.worker), None)
        if spec is None:
            p.error(f"--worker {args.worker!r} is none of {[r.label for r in runs]}")
        return work(args, spec, args.until, state_dir)
    if args.analyze_only:
        print(analyze(Path(args.out), Path(args.figure) if args.figure else Path(args.out) / "drop_penalty.png",
                      args.sources))
        return 0
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/jax_compilation_cache")
    return Orchestrator(args, runs, state_dir, Path(args.out), argv).run()


if __name__ == "__main__":
    sys.exit(main())
