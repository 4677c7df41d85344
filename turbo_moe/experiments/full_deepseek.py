"""The logic of ``03_full_deepseek`` (its cells hold parameters, these calls and plots).

Part 1 (accounting of the exact config): ``check_parameters`` validates the cell's parameters and returns
the config and mesh, ``param_table`` / ``plot_memory_per_path`` show `turbo_moe.experiments.accounting`.

Part 2: a slice of DeepSeek-V3-671B (fewer layers) trained on the devices at hand.

``plan_slice`` decides what runs: the exact widths with as many routed experts as fit one device, or,
where even the fewest experts do not fit (any CPU, small GPUs), a clearly labelled *shrunk* slice with
every width divided by a power of two (head dimensions stay exact). ``run_paths`` trains the plan once
per MoE path and records each run like a sweep point; ``plot_paths`` draws TGS and memory.

The records go to ``experiments/runs/full_deepseek/`` unless the caller names a results folder, so an
interactive run never lands in the committed ``experiments/results/`` that the report reads.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from turbo_moe.experiments import accounting
from turbo_moe.experiments.display import GIB
from turbo_moe.model.paths import MOE_PATHS

PRESET = "deepseek_v3_671b"
SLICE_REMAT_POLICY = "dots_experts_attention"
SHRINKS = (2, 4, 8, 16, 32, 64)
# Widths divided by the shrink factor (floors keep a valid config); head dims stay exact.
_WIDTHS = {"d_model": 64, "n_heads": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "dense_ffn_dim": 64,
           "moe_ffn_dim": 16, "vocab_size": 512}
# A shrunk slice is a smoke run of the paths: on a CPU its steps should take seconds (what a CPU runs
# them at: docs/notes/archive, "Measurements moved out of code comments").
SHRUNK_MAX_STEP_TFLOP = 0.003
MIN_SEQ_LEN = 64
INTERACTIVE_RESULTS = Path("experiments") / "runs" / "full_deepseek"


@dataclasses.dataclass
class SlicePlan:
    """What Part 2 trains: ``overrides`` of ``deepseek_v3_671b``, and how it relates to the real model."""

    overrides: dict[str, Any]
    seq_len: int  # the sequence length the runs use (shorter than asked only in a shrunk slice)
    shrink: int  # 1: every width exact
    label: str  # one line for titles and tables
    memory_bytes: float
    memory_source: str
    exact_need: pd.DataFrame  # GiB the exact widths need on one device, per expert count and path
    notes: list[str]

    @property
    def exact(self) -> bool:
        return self.shrink == 1


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"parameter {name}: must be a positive int, got {value!r}")


def _need_gib(cfg, per_device_batch: int, seq_len: int) -> float:
    table = accounting.full_model_table(cfg, accounting.MeshShape(), per_device_batch, seq_len)
    return float(table["total GiB/device"].max())


def _fewest_experts(cfg) -> int:
    for n in range(cfg.n_groups, cfg.n_experts + 1, cfg.n_groups):
        try:
            cfg.replace(n_experts=n)
            return n
        except ValueError:  # too few for top_k within the selected groups
            continue
    return cfg.n_experts


def plan_slice(
    *, n_layers: int, n_dense_layers: int, n_experts: int | None, model_overrides: Mapping[str, Any],
    memory_bytes: float, memory_source: str, per_device_batch: int, seq_len: int, capacity_factor: float,
    max_step_tflop: float | None = None,
) -> SlicePlan:
    """The slice to train. ``n_experts=None``: as many as fit (256 is exact). With ``model_overrides`` the
    user has chosen the widths: they are used as given (ValueError if nothing fits). Otherwise, when the
    exact widths do not fit, widths shrink by the smallest power of two that fits ``memory_bytes`` and
    ``max_step_tflop`` (training TFLOP per step; None: no limit)."""
    from turbo_moe.model import get_config

    for name, value in (("n_layers", n_layers), ("per_device_batch", per_device_batch), ("seq_len", seq_len)):
        _positive_int(name, value)
    if n_experts is not None:
        _positive_int("n_experts", n_experts)
    if not isinstance(model_overrides, Mapping):
        raise ValueError(f"parameter model_overrides: must be a dict, got {type(model_overrides).__name__}")
    # A slice of a few layers saves the matmul, expert and attention outputs: the preset's "full" (right for all 61
    # layers) recomputed 12% of the step at no memory saving (docs/expert-parallel.md); model_overrides may differ.
    base = {"n_layers": n_layers, "n_dense_layers": n_dense_layers, "capacity_factor": capacity_factor,
            "max_seq_len": seq_len, "remat_policy": SLICE_REMAT_POLICY}
    exact_cfg = get_config(PRESET, **base)  # validates the layer counts, naming the field
    fewest = _fewest_experts(exact_cfg)
    exact_need = pd.DataFrame(
        {f"{n} experts": {"GiB needed (largest path)": _need_gib(exact_cfg.replace(n_experts=n), per_device_batch,
                                                                 seq_len)}
         for n in sorted({fewest, n_experts or exact_cfg.n_experts, exact_cfg.n_experts})}).T
    have = f"{memory_bytes / GIB:.1f} GiB ({memory_source})"

    def fit(cfg) -> int:
        if n_experts is not None:
            ok = _need_gib(cfg.replace(n_experts=n_experts), per_device_batch, seq_len) * GIB <= 0.8 * memory_bytes
            return n_experts if ok else 0
        return accounting.experts_that_fit(cfg, memory_bytes, per_device_batch, seq_len)

    if model_overrides:
        cfg = get_config(PRESET, **{**base, **dict(model_overrides)})
        experts = fit(cfg)
        if experts == 0:
            raise ValueError(f"parameter model_overrides: with these overrides no expert count fits {have} "
                             f"(n_layers={n_layers}, per_device_batch={per_device_batch}, seq_len={seq_len})")
        overrides = {**base, **dict(model_overrides), "n_experts": experts}
        return SlicePlan(overrides, seq_len, 1, f"{PRESET} slice with your model_overrides, {n_layers} layers, "
                         f"{experts} experts", memory_bytes, memory_source, exact_need,
                         ["model_overrides given: the widths are yours, not DeepSeek-V3's"])

    experts = fit(exact_cfg)
    if experts:
        label = f"exact widths, {n_layers} of 61 layers, {experts} of 256 routed experts"
        return SlicePlan({**base, "n_experts": experts}, seq_len, 1, label, memory_bytes, memory_source, exact_need,
                         [])

    notes = [f"the exact widths do not fit this device: {have}; even {fewest} experts need "
             f"{exact_need['GiB needed (largest path)'].min():.1f} GiB (table above)"]
    plan_args = (memory_bytes, memory_source, exact_need, notes)
    fits_memory = False
    for shrink in SHRINKS:
        widths, experts = _widths_and_experts(exact_cfg, base, shrink, n_experts)
        cfg = get_config(PRESET, **base, **widths, n_experts=experts)
        if _need_gib(cfg, per_device_batch, seq_len) * GIB > 0.8 * memory_bytes:
            continue
        fits_memory = True
        if max_step_tflop is None or _step_tflop(cfg, per_device_batch, seq_len) <= max_step_tflop:
            return _shrunk(base, widths, experts, shrink, seq_len, seq_len, per_device_batch, plan_args)
    if not fits_memory:
        raise ValueError(
            f"parameter seq_len: even widths / {SHRINKS[-1]} do not fit {have} with per_device_batch="
            f"{per_device_batch}, seq_len={seq_len}; lower seq_len or set model_overrides")
    # The widest shrink still exceeds the step budget: attention at this length dominates; halve the sequence.
    shrink, run_seq = SHRINKS[-1], seq_len
    widths, experts = _widths_and_experts(exact_cfg, base, shrink, n_experts)
    while run_seq > MIN_SEQ_LEN and _step_tflop(get_config(PRESET, **{**base, **widths, "n_experts": experts,
                                                                       "max_seq_len": run_seq}),
                                                per_device_batch, run_seq) > max_step_tflop:
        run_seq //= 2
    return _shrunk({**base, "max_seq_len": run_seq}, widths, experts, shrink, run_seq, seq_len, per_device_batch,
                   plan_args)


def _widths_and_experts(exact_cfg, base, shrink, n_experts) -> tuple[dict[str, int], int]:
    """Widths / ``shrink`` and the experts of a shrunk slice: a shrunk slice checks the paths, it does not
    measure the architecture, so it takes the fewest valid experts unless the user named a count."""
    from turbo_moe.model import get_config

    widths = {k: max(int(getattr(exact_cfg, k)) // shrink, floor) for k, floor in _WIDTHS.items()}
    return widths, n_experts or _fewest_experts(get_config(PRESET, **base, **widths))


def _step_tflop(cfg, per_device_batch: int, seq_len: int) -> float:
    from turbo_moe.model import flops_per_token

    return flops_per_token(cfg, seq_len) * per_device_batch * seq_len / 1e12


def _shrunk(base, widths, experts, shrink, run_seq, asked_seq, per_device_batch, plan_args) -> SlicePlan:
    from turbo_moe.model import get_config

    memory_bytes, memory_source, exact_need, notes = plan_args
    cfg = get_config(PRESET, **{**base, **widths, "n_experts": experts})
    seq_text = f", sequence {run_seq} of {asked_seq}" if run_seq != asked_seq else ""
    label = (f"SHRUNK slice (not DeepSeek-V3's widths): every width / {shrink}{seq_text}, {base['n_layers']} "
             f"layers, {experts} experts")
    notes = notes + [f"running {label}: " + ", ".join(f"{k} {v}" for k, v in widths.items())
                     + f"; about {_step_tflop(cfg, per_device_batch, run_seq):.4f} training TFLOP per step"]
    return SlicePlan({**base, **widths, "n_experts": experts}, run_seq, shrink, label, memory_bytes, memory_source,
                     exact_need, notes)


# ---- Part 1: the exact config ---------------------------------------------------------------------------
def check_parameters(*, mesh_data: int, mesh_expert: int, mesh_tensor: int, mesh_pipeline: int, fsdp: bool,
                     paths: Sequence[str], max_step_tflop: float | None, capacity_factor: float):
    """(the exact DeepSeek-V3 config, its mesh) for the notebook's parameters; ValueError naming a bad one."""
    from turbo_moe.model import get_config

    mesh = accounting.MeshShape(data=mesh_data, expert=mesh_expert, tensor=mesh_tensor, pipeline=mesh_pipeline,
                                fsdp=fsdp)
    unknown = sorted(set(paths) - set(MOE_PATHS))
    if unknown or not paths:
        raise ValueError(f"parameter paths: expected a non-empty list from {MOE_PATHS}, got {paths!r}")
    if max_step_tflop is not None and (isinstance(max_step_tflop, bool)
                                       or not isinstance(max_step_tflop, (int, float)) or max_step_tflop <= 0):
        raise ValueError(f"parameter max_step_tflop: must be a positive number or None, got {max_step_tflop!r}")
    return get_config(PRESET, capacity_factor=capacity_factor), mesh


def mesh_text(mesh) -> str:
    return (f"mesh: {mesh.devices} devices = data {mesh.data} x expert {mesh.expert} x tensor {mesh.tensor}"
            f" x pipeline {mesh.pipeline} (fsdp={mesh.fsdp})")


def param_table(cfg) -> pd.DataFrame:
    """`accounting.param_budget` in billions, one row per part."""
    budget = accounting.param_budget(cfg)
    return pd.Series({k: v / 1e9 for k, v in budget.items()}, name="billions").to_frame().round(2)


def plot_memory_per_path(per_path: pd.DataFrame, mesh, batch: int, seq_len: int):
    """States and activations per device (GiB), one bar pair per path of `accounting.full_model_table`."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    melted = per_path.reset_index().melt(id_vars="path", value_vars=["states GiB/device", "activations GiB/device"],
                                         var_name="part", value_name="GiB")
    _, ax = plt.subplots(figsize=(7, 4))  # its own figure: never draw into whatever figure is current
    sns.barplot(data=melted, x="path", y="GiB", hue="part", ax=ax)
    ax.set(ylabel="memory per device (GiB)", xlabel="MoE path",
           title=f"DeepSeek-V3-671B on {mesh.devices} devices, {batch}x{seq_len} tokens/device")
    return ax.figure


# ---- Part 2: a slice on the devices at hand ---------------------------------------------------------------
def plan_on_this_device(*, max_step_tflop: float | None, **plan_args: Any) -> SlicePlan:
    """``plan_slice`` for the first local device's memory; ``max_step_tflop`` None takes the platform's default."""
    import jax

    from turbo_moe.experiments import notebook as nb

    memory, memory_source = nb.device_memory_bytes()
    if max_step_tflop is None:
        max_step_tflop = default_max_step_tflop(jax.default_backend())
    return plan_slice(memory_bytes=memory, memory_source=memory_source, max_step_tflop=max_step_tflop,
                      **plan_args)


def device_text(plan: SlicePlan) -> str:
    import jax

    return (f"device: {jax.device_count()} x {jax.devices()[0].device_kind}, "
            f"{plan.memory_bytes / 2**30:.1f} GiB ({plan.memory_source})")


def plan_text(plan: SlicePlan, table_path: str | Path) -> str:
    """The plan's notes, what runs, and where its rows go."""
    return "\n".join([*(f"note: {n}" for n in plan.notes), f"runs: {plan.label}",
                      f"rows and records go to {table_path}"])


def default_max_step_tflop(platform: str) -> float | None:
    """CPUs get a shrunk slice whose steps take seconds; accelerators are limited by memory only."""
    return SHRUNK_MAX_STEP_TFLOP if platform == "cpu" else None


def results_location(results_dir: str | Path | None, repo_root: str | Path) -> Path:
    """Where the rows go: the named folder, else ``experiments/runs/full_deepseek`` (never the report's)."""
    return Path(results_dir) if results_dir else Path(repo_root) / INTERACTIVE_RESULTS


def run_paths(
    plan: SlicePlan, paths: Sequence[str], *, per_device_batch: int, steps: int, dataset: str,
    capacity_factor: float, train_overrides: Mapping[str, Any], results_dir: str | Path, table: str,
) -> list[dict[str, Any]]:
    """Train ``plan`` once per path; each run becomes a row of ``<results_dir>/<table>.csv`` plus a record.
    Returns one dict per path (status, TGS, measured and predicted bytes, error). The sequence length is the
    plan's (a shrunk slice may run a shorter one than asked)."""
    from turbo_moe.experiments import notebook as nb
    from turbo_moe.train import run

    rows, seq_len = [], plan.seq_len
    for path in paths:
        # A short warm-up and the suite's learning rate: the loss moves within a dozen steps on real text.
        tc = nb.train_config(model=PRESET, model_overrides=plan.overrides, moe_path=path,
                             capacity_factor=capacity_factor, per_device_batch=per_device_batch, steps=steps,
                             seq_len=seq_len, dataset=dataset, warmup_steps=min(2, steps), eval_every=0,
                             eval_batches=0, train_overrides=train_overrides)  # no eval compile
        start = time.perf_counter()
        result = run(tc)
        params = {"moe_path": path, "capacity_factor": capacity_factor, "per_device_batch": per_device_batch,
                  "seq_len": seq_len, "n_layers": plan.overrides["n_layers"],
                  "n_experts": plan.overrides["n_experts"], "shrink": plan.shrink}
        nb.record_in_table(result, results_dir=results_dir, sweep=table, params=params,
                           elapsed_s=time.perf_counter() - start)
        predicted = accounting.full_model_table(tc.model_config(), accounting.MeshShape(), per_device_batch,
                                                seq_len, paths=[path]).iloc[0]
        rows.append({"path": path, "status": result.status, "tgs": result.summary.get("tgs"),
                     "first_loss": result.history[0]["loss"] if result.history else None,
                     "final_loss": result.summary.get("final_loss"), "history": result.history,
                     "measured_bytes": result.summary.get("peak_memory_bytes"),
                     "memory_source": result.summary.get("memory_source"),
                     "predicted_bytes": predicted["total GiB/device"] * GIB, "error": result.error})
    return rows


def memory_note(platform: str) -> str:
    """Why measured and predicted memory may not compare."""
    if platform == "cpu":
        return ("CPU: 'measured' is the peak RSS of the whole kernel process (Python, JAX, XLA's compiler, the "
                "data), 'predicted' only the slice's training states and activations: not comparable; the "
                "prediction is for an accelerator's allocator")
    return "measured: the device allocator's peak for this process; predicted: states + activations"


def plot_paths(rows: Sequence[Mapping[str, Any]], plan: SlicePlan, platform: str):
    """TGS and memory per path; None when no path finished. On an accelerator the memory panel sets the
    allocator's measured peak beside the prediction; on the CPU the two do not compare (`memory_note`), so
    it draws the measured peak RSS alone and the prediction stays in the table."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    ok = pd.DataFrame([r for r in rows if r["status"] == "ok"])
    if ok.empty:
        print("no path finished; see the error column")
        return None
    ok["measured peak"] = ok["measured_bytes"].astype(float) / GIB
    ok["predicted"] = ok["predicted_bytes"].astype(float) / GIB
    fig, (ax_tgs, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    sns.barplot(data=ok, x="path", y="tgs", ax=ax_tgs)
    ax_tgs.set(ylabel="TGS (tokens / device / s)", xlabel="MoE path", title="Throughput")
    if platform == "cpu":
        sns.barplot(data=ok, x="path", y="measured peak", ax=ax_mem)
        ax_mem.set(ylabel="peak RSS of the kernel process (GiB)", xlabel="MoE path",
                   title="Measured memory (the whole process; the prediction is in the table)")
    else:
        mem = ok.melt(id_vars="path", value_vars=["measured peak", "predicted"], var_name="memory",
                      value_name="GiB")
        sns.barplot(data=mem, x="path", y="GiB", hue="memory", ax=ax_mem)
        ax_mem.set(ylabel="memory (GiB)", xlabel="MoE path", title="Memory: measured peak vs predicted")
    fig.suptitle(plan.label, fontsize=10)
    fig.tight_layout()
    return fig


def plot_losses(histories: Mapping[str, Sequence[Mapping[str, Any]]], plan: SlicePlan):
    """Training loss against step, one line per path (the record's history); None without any."""
    import matplotlib.pyplot as plt

    drawn = {path: pd.DataFrame(h) for path, h in histories.items() if h}
    drawn = {path: h for path, h in drawn.items() if {"step", "loss"} <= set(h.columns)}
    if not drawn:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for path, h in drawn.items():
        ax.plot(h["step"], h["ce_loss"] if "ce_loss" in h else h["loss"], marker="o", markersize=3, label=path)
    ax.set(xlabel="step", ylabel="train cross-entropy (nats / token)", title=f"Loss per path: {plan.label}")
    ax.title.set_fontsize(9)
    ax.legend()
    fig.tight_layout()
    return fig
