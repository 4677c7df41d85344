"""`run(config) -> RunResult`: the one readable training loop around the jitted step.

Timing is honest: the train step is compiled ahead of time (compile time reported separately), each
step is timed from the previous step's completion to its own (host data preparation overlaps the
device work), evaluation and checkpointing are excluded, and the first `metrics.TGS_SKIP_STEPS` steps (half of
a shorter run) are left out of TGS/MFU.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
import traceback
from typing import Any, Callable, Mapping

import jax
import numpy as np

from turbo_moe.data import BatchIterator, Dataset, eval_batches, load_dataset, unigram_log_prior
from turbo_moe.model import ModelConfig, count_params, flops_per_token
from turbo_moe.train import metrics as M
from turbo_moe.train.checkpoint import Checkpointer, ResumeRefused
from turbo_moe.train.compilation_cache import ensure_on as compilation_cache_on
from turbo_moe.train.config import TrainConfig
from turbo_moe.train.determinism import state_digest
from turbo_moe.train.distributed import batch_share
from turbo_moe.train.progress import RunProgress, summary_line
from turbo_moe.train.result import RunResult
from turbo_moe.train.step import (
    abstract_batch, device_batch, device_choices, learning_rate_schedule, make_mesh, program_for, with_head_bias)


class OutOfMemory(MemoryError):
    """The compiled step does not fit the device (found before running it)."""


def run(config: TrainConfig | Mapping[str, Any], *, on_log: Callable[[dict], None] | None = None) -> RunResult:
    """Train per `config`. Bad configs/data paths raise, and so does a checkpoint another run wrote
    (`ResumeRefused`); OOM, NaN/Inf loss and other failures during training come back as `status` "oom" / "nan" /
    "error" with `error` explaining them. `on_log(row)` sees each history row as it is logged (a TensorBoard log)."""
    tc = config if isinstance(config, TrainConfig) else TrainConfig.from_dict(config)
    tc = tc.resolved()  # every "auto" as this device runs it: what the run executes and records
    model_cfg = tc.model_config()
    # Shown from the first second: set-up, initialisation and compilation can take minutes. Under
    # jax.distributed every process runs this; process 0 alone shows it.
    progress = RunProgress(f"train {model_cfg.moe_path}", tc.steps, enabled=tc.progress and jax.process_index() == 0)
    try:
        dataset = load_dataset(tc.dataset, seq_len=tc.resolved_seq_len, vocab_size=model_cfg.vocab_size,
                               data_dir=tc.data_dir, text_field=tc.text_field, val_fraction=tc.val_fraction,
                               tokenizer=tc.tokenizer)
    except BaseException:
        progress.close()
        raise
    result = RunResult(provenance=M.provenance(tc.to_dict(), model_cfg.to_dict(), dataset.info))
    result.provenance["device_choices"] = device_choices(model_cfg, devices=jax.device_count())
    # CPU: compiled programs are kept on disk, so the next run of the same shapes skips XLA's compiler (the
    # summary says whether compile_time_s may be a cache load).
    result.summary["compilation_cache"] = compilation_cache_on() is not None
    trainer = _Trainer(tc, model_cfg, dataset, result, progress, on_log)
    refused = None
    try:
        trainer.train()
    except ResumeRefused as error:  # a config error found in the checkpoint: raised once the run is closed
        refused = error
    except Exception as error:  # noqa: BLE001 — reported in the result, never swallowed silently
        if M.is_oom(error):
            result.status, result.error = "oom", trainer.describe_oom(error)
        else:
            result.status = "error"
            result.error = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=20)}"
    finally:
        trainer.close()
    if refused is not None:
        progress.close()
        raise refused
    result.summary = trainer.summary()
    progress.close(summary_line(result.status, result.error, result.summary, progress.desc))
    return result


class _Trainer:
    """State of one run; `train()` is the loop, `summary()` the run-level figures."""

    def __init__(self, tc: TrainConfig, model_cfg: ModelConfig, dataset: Dataset, result: RunResult,
                 progress: RunProgress | None = None, on_log: Callable[[dict], None] | None = None):
        self.tc, self.model_cfg, self.dataset, self.result = tc, model_cfg, dataset, result
        self.seq_len = tc.resolved_seq_len
        self.n_devices = jax.device_count()
        self.global_batch = tc.per_device_batch * self.n_devices
        self.tokens_per_device = tc.per_device_batch * self.seq_len
        self.schedule = learning_rate_schedule(tc)
        self.phase = "setup"
        self.start_step = 0
        self.step_times: list[float] = []  # this process's steps only
        self.dropped: list[float] = []
        self.compile_time_s = math.nan
        self.init_lowering = None
        self.compiled_mem: dict[str, int] = {}
        self.memory_limit: tuple[int | None, str] = (None, "unknown")
        self.checkpointer = Checkpointer(tc.checkpoint_dir, tc.keep_checkpoints) if tc.checkpoint_dir else None
        self.progress = progress or RunProgress("train", tc.steps, enabled=False)
        self.on_log = on_log
        self.phase_s: dict[str, float] = {}  # wall seconds per phase: where a run's time went
        self._phase_start = time.perf_counter()

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        tc, history = self.tc, self.result.history
        self.peak_memory_at_start = M.peak_memory()[0]  # counters are per process, never reset
        if tc.resume and self.checkpointer is not None:  # another run's checkpoint: refused before any work
            self.checkpointer.check_resume(tc.to_dict())
        mesh = make_mesh(expert_parallel=tc.expert_parallel)
        program = program_for(tc, self.model_cfg, mesh)
        self._check_state_fits(program.abstract_state)
        # The train step compiles on abstract inputs in a second thread while the init program compiles
        # and runs: a cold start waits for the longer of the two, not their sum.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-train-step") as pool:
            pending = pool.submit(self._compile, program.train, program.abstract_state, mesh)
            self._enter("initialisation")
            try:
                state = self._maybe_resume(self._head_prior(program.init(jax.random.key(tc.seed))), program)
            except BaseException:
                pending.cancel()
                raise
            self.init_lowering = program.init.last_choice.get("lowering")  # threefry: kernel | default
            self._enter("compilation")  # what is left of it once the state exists
            compiled = pending.result()
        self._check_fits()
        eval_step = program.evaluate
        if self.start_step >= tc.steps:
            return
        # Every process draws the rows of the global batch its devices hold; together, the batch one process would.
        share, shares = batch_share(mesh, self.global_batch)
        batches = BatchIterator(self.dataset.train, self.global_batch, seed=tc.seed, process_index=share,
                                process_count=shares)
        val = [device_batch(b, mesh) for b in self._local_eval_batches(share, shares)]
        self.progress.start_at(self.start_step)
        self._enter("training")

        def dispatch(state, step):  # the step runs asynchronously; its inputs' state is donated
            return compiled(state, device_batch(batches.batch_at(step), mesh))

        t_prev = time.perf_counter()
        pending = dispatch(state, self.start_step)
        for step in range(self.start_step, tc.steps):
            state, step_metrics = pending
            done = step + 1
            is_last = done == tc.steps
            evaluate = bool(val) and (is_last or bool(tc.eval_every and done % tc.eval_every == 0))
            save = self.checkpointer is not None and (is_last or bool(
                tc.checkpoint_every and done % tc.checkpoint_every == 0))
            # One step ahead: the next step is queued before this one's metrics are read, so the device never waits
            # for the host between steps. Not past a step whose
            # state is evaluated or saved (the next step would consume it).
            ahead = not (is_last or evaluate or save)
            pending = dispatch(state, done) if ahead else None
            m = jax.device_get(step_metrics)  # waits for the step
            now = time.perf_counter()
            step_time, t_prev = now - t_prev, now
            row = self._row(step, m, step_time)
            self.step_times.append(step_time)
            self.dropped.append(row["dropped_fraction"])
            self.result.expert_load = np.asarray(m["expert_load"]).tolist()
            if not math.isfinite(row["loss"]):  # a step already queued after it is dropped with the run
                self._log(row)
                self.result.status = "nan"
                self.result.error = f"non-finite loss ({row['loss']}) at step {step}"
                return
            if evaluate:
                self._enter("evaluation")
                row["eval_loss"] = self._evaluate(eval_step, state, val)
                self._enter("training")
            if is_last or evaluate or step % tc.log_every == 0:
                self._log(row)
            self.progress.step(done, row["ce_loss"], row["tgs"])
            if save:
                self._enter("checkpointing")
                self.checkpointer.save(done, state, {"step": done, "history": history, "config": tc.to_dict()})
            if evaluate or save:
                self._enter("training")
            if pending is None and not is_last:
                t_prev = time.perf_counter()  # evaluation/checkpointing are not part of step time
                pending = dispatch(state, done)
        if tc.deterministic:  # what two runs of one config compare, with their losses and gradient norms
            self.result.summary["state_digest"] = state_digest(state)

    def _log(self, row: dict[str, Any]) -> None:
        self.result.history.append(row)
        if self.on_log is not None:
            self.on_log(row)

    def _enter(self, phase: str) -> None:
        now = time.perf_counter()
        self.phase_s[self.phase] = self.phase_s.get(self.phase, 0.0) + now - self._phase_start
        self.phase, self._phase_start = phase, now
        self.progress.phase(phase)

    def _row(self, step: int, m: dict, step_time: float) -> dict[str, Any]:
        mean_ratio, worst_ratio, per_layer = M.load_imbalance(m["expert_load"])
        return {
            "step": step, "loss": float(m["loss"]), "ce_loss": float(m["ce_loss"]),
            "mtp_loss": float(m["mtp_loss"]), "balance_loss": float(m["balance_loss"]),
            "eval_loss": math.nan, "step_time_s": step_time, "tgs": self.tokens_per_device / step_time,
            "dropped_fraction": float(m["dropped_fraction"]), "load_max_over_mean": mean_ratio,
            "dropped_fraction_per_layer": np.asarray(m["dropped_fraction_per_layer"]).round(5).tolist(),
            "load_max_over_mean_worst_layer": worst_ratio, "load_max_over_mean_per_layer": per_layer,
            "lr": float(self.schedule(step)),
            "grad_norm": float(m["grad_norm"]),
        }

    def _local_eval_batches(self, share: int, shares: int) -> list[dict]:
        if self.tc.eval_batches == 0:
            return []
        batches = eval_batches(self.dataset.val, self.global_batch, self.tc.eval_batches, seed=self.tc.seed)
        rows = slice(share * self.global_batch // shares, (share + 1) * self.global_batch // shares)
        return [{k: v[rows] for k, v in b.items()} for b in batches]

    def _evaluate(self, eval_step, state, val: list[dict]) -> float:
        losses = [float(eval_step(state, batch)["ce_loss"]) for batch in val]
        return float(np.mean(losses))

    def _head_prior(self, state):
        """The router recipe's head_bias "unigram": the head's bias starts at the training split's log unigram
        frequencies."""
        if self.model_cfg.router.head_bias == "unigram":
            state = with_head_bias(state, unigram_log_prior(self.dataset.train, self.model_cfg.vocab_size))
        return jax.block_until_ready(state)

    def _maybe_resume(self, state, program):
        if not (self.tc.resume and self.checkpointer and self.checkpointer.latest_step() is not None):
            return state
        self._enter("restore")
        state, record = self.checkpointer.restore(state, config=self.tc.to_dict())  # refuses another seed/path
        if program.refresh_compute is not None:  # the compute copy is not saved: cast it from the restored params
            state = program.refresh_compute(state)
        self.start_step = int(record["step"])
        if int(state.step) != self.start_step:
            raise ValueError(f"checkpoint record says step {self.start_step} but the optimizer state has "
                             f"{int(state.step)} updates")
        self.result.history.extend(record["history"])
        return state

    def _compile(self, train_step, abstract_state, mesh):
        """AOT-compile the train step (thread-safe: it only reads the config and writes its own fields)."""
        start = time.perf_counter()
        compiled = train_step.lower(abstract_state, abstract_batch(self.global_batch, self.seq_len, mesh)).compile()
        self.compile_time_s = time.perf_counter() - start
        self.compiled_mem = M.compiled_memory(compiled)
        self.memory_limit = M.device_memory_limit()
        return compiled

    def _check_state_fits(self, abstract_state) -> None:
        """On the CPU, refuse a train state larger than the host's available memory before creating it: the
        process would otherwise swap or be killed while initialising, before the compiled-step check runs."""
        if jax.devices()[0].platform != "cpu":
            return  # accelerators: the compiled-memory check below sees the device's own limit
        limit, source = M.device_memory_limit()
        state_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract_state)) // jax.process_count()
        if limit is not None and state_bytes > limit:
            raise OutOfMemory(f"the train state (parameters, optimizer moments) needs {state_bytes} bytes on this host "
                              f"but {source} is {limit} bytes: choose a smaller model or more devices")

    def _check_fits(self) -> None:
        """Refuse to run a step XLA says needs more than the device has (CPU would swap or be killed)."""
        limit, source = self.memory_limit
        mem = self.compiled_mem
        if limit is None or not mem:
            return
        on_cpu = jax.devices()[0].platform == "cpu"
        # On CPU the arguments are already resident (MemAvailable excludes them); on accelerators the
        # pool limit must hold arguments, outputs and temporaries together.
        need = mem["total_bytes"] - (mem["argument_size_in_bytes"] if on_cpu else 0)
        if need > limit:
            raise OutOfMemory(
                f"compiled train step needs {need} bytes per device (temporaries {mem['temp_size_in_bytes']}, "
                f"outputs {mem['output_size_in_bytes']}, arguments {mem['argument_size_in_bytes']}) but "
                f"{source} is {limit} bytes")

    def describe_oom(self, error: BaseException) -> str:
        asked = M.requested_bytes(str(error))
        self.result.summary["oom_requested_bytes"] = asked
        device = jax.devices()[0].device_kind
        model = self.tc.model if isinstance(self.tc.model, str) else "custom"
        asked_text = f"{asked} bytes" if asked is not None else "an unknown number of bytes"
        return (f"out of memory during {self.phase}: model {model} ({self.model_cfg.moe_path}), "
                f"per_device_batch={self.tc.per_device_batch} x seq_len={self.seq_len} on {self.n_devices} x "
                f"{device}; asked for {asked_text}. {str(error)[:600]}")

    def close(self) -> None:
        self._enter("done")
        if self.checkpointer is not None:
            # Waits for the last save and always closes (orbax's threads would hang the exit); a failed
            # save is the run's status, never an exception out of run().
            error = self.checkpointer.finish()
            if error is not None and self.result.status == "ok":
                self.result.status, self.result.error = "error", error

    # ------------------------------------------------------------------ run-level figures
    def summary(self) -> dict[str, Any]:
        tc, history = self.tc, self.result.history
        timed = M.timed_steps(self.step_times)
        tgs = M.tokens_per_device_per_second(self.tokens_per_device, timed)
        device = jax.devices()[0]
        peak, peak_source = M.peak_flops(device.device_kind, device.platform)
        fpt = flops_per_token(self.model_cfg, self.seq_len)
        params = count_params(self.model_cfg)
        peak_mem, mem_source = M.peak_memory()
        if peak_mem is not None and peak_mem == getattr(self, "peak_memory_at_start", None) and peak_mem > 0:
            # This run never raised the process peak: the figure belongs to an earlier run in this process.
            mem_source += " (unchanged by this run: an earlier run in this process set it; see compiled_*_bytes)"
        evals = [r["eval_loss"] for r in history if math.isfinite(r.get("eval_loss", math.nan))]
        ratios = [r["load_max_over_mean"] for r in history if math.isfinite(r["load_max_over_mean"])]
        return {
            **self.result.summary,
            "tgs": tgs, "tgs_steps": len(timed),
            "step_time_s": float(np.mean(timed)) if timed else math.nan,
            "mfu": M.model_flops_utilization(fpt, tgs, peak), "peak_flops": peak, "peak_flops_source": peak_source,
            "flops_per_token": fpt, "tokens_per_step": self.global_batch * self.seq_len,
            "peak_memory_bytes": peak_mem, "memory_source": mem_source,
            "compiled_temp_bytes": self.compiled_mem.get("temp_size_in_bytes"),
            "compiled_total_bytes": self.compiled_mem.get("total_bytes"), "compiled_memory": self.compiled_mem,
            "device_memory_limit_bytes": self.memory_limit[0], "device_memory_limit_source": self.memory_limit[1],
            "final_loss": history[-1]["loss"] if history else math.nan,  # cross-entropy + MTP and balance terms
            "final_ce_loss": history[-1].get("ce_loss", math.nan) if history else math.nan,  # beside the eval CE
            "final_eval_loss": evals[-1] if evals else math.nan,
            "dropped_fraction_mean": float(np.mean(self.dropped)) if self.dropped else math.nan,
            "load_max_over_mean_mean": float(np.mean(ratios)) if ratios else math.nan,
            "params_total": params["total"], "params_active": params["active"],
            "steps_done": history[-1]["step"] + 1 if history else 0, "resumed_from_step": self.start_step or None,
            "compile_time_s": self.compile_time_s, "phase_seconds": {k: round(v, 3) for k, v in self.phase_s.items()},
            "init_lowering": self.init_lowering, "n_devices": self.n_devices, "process_count": jax.process_count(),
            "per_device_batch": tc.per_device_batch, "seq_len": self.seq_len, "moe_path": self.model_cfg.moe_path,
        }
