"""Which slice of DeepSeek-V3-671B ``03_full_deepseek`` trains on the devices at hand: ``plan_slice``.

DeepSeek-V3's exact widths (d_model 7168, 128 heads, the MLA ranks, experts 2048 wide, a 129,280-token vocabulary)
unless the user asks for narrower ones (``width_divisor``). The plan walks a ladder, most faithful first, and takes the
first rung whose predicted peak (``accounting.memory_prediction``, the largest of the paths it runs) fits the device:

1. float32 master weights (DeepSeek-V3's), every routed expert: ``n_layers`` layers and the MTP block, then fewer
   layers (the MTP block goes before each main layer), down to ``n_dense_layers`` dense + 1 MoE layer;
2. the same layers with bfloat16 weights;
3. dense + 1 MoE layer in bfloat16 with fewer routed experts: as many as fit.

On several GPUs the routed experts are split over all of them (expert parallelism), so 256 fit where one GPU holds
fewer. Where no exact-width rung fits at all (any CPU: its host memory and, by default, a step budget of seconds)
and the user gave no widths, every width shrinks by the smallest power of two that fits, labelled as such.

The accounting over-predicts these slices' measured peaks (measured / predicted 0.78-0.97 at the exact widths,
docs/notes/expert-parallel-lab.md; 0.86 for 1 dense + 1 MoE layer of 256 experts on one H200): the prediction itself
is the margin, so a rung fits when it predicts no more than the device's memory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from turbo_moe.experiments import accounting
from turbo_moe.experiments.notebooks.display import GIB
from turbo_moe.model import flops_per_token, get_config
from turbo_moe.model.paths import MOE_PATHS
from turbo_moe.train import TrainConfig

PRESET = "deepseek_v3_671b"
FULL_LAYERS, FULL_EXPERTS = 61, 256
SLICE_REMAT_POLICY = "dots_experts_attention"
WEIGHT_DTYPES = ("float32", "bfloat16")  # DeepSeek-V3's float32 master weights first
SHRINKS = (2, 4, 8, 16, 32, 64)
# Widths divided by the shrink factor (floors keep a valid config); head dims stay exact.
_WIDTHS = {"d_model": 64, "n_heads": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "dense_ffn_dim": 64,
           "moe_ffn_dim": 16, "vocab_size": 512}
# A CPU's shrunk slice is a smoke run of the paths: its steps should take seconds (docs/notes/archive, "Measurements
# moved out of code comments").
SHRUNK_MAX_STEP_TFLOP = 0.003
MIN_SEQ_LEN = 64
# Left out of the default paths at the exact widths: XLA's ragged_dot autotuner ran out of memory there on one H200
# and at EP=2 (asked 32 and 112 GiB beyond the state; campaigns full_deepseek_h200, full_width_ep2_h200x2).
NOT_AT_EXACT_WIDTHS = ("ragged",)


@dataclasses.dataclass(frozen=True)
class Devices:
    """What the plan needs of the devices at hand. On accelerators the experts split over all ``count`` of them; a
    CPU's host devices stay data-parallel."""

    memory_bytes: float  # one device's
    memory_source: str
    platform: str = "gpu"
    count: int = 1
    fp8: bool = False  # runs turbo_fp8's FP8 kernels (Hopper)
    kind: str = ""

    @property
    def expert_parallel(self) -> int:
        return self.count if self.platform == "gpu" else 1

    @property
    def moments_dtype(self) -> str | None:
        """The AdamW moments' dtype a run resolves on this platform (TrainConfig's "auto")."""
        return TrainConfig(model="tiny").resolved(self.platform).moments_dtype


@dataclasses.dataclass
class SlicePlan:
    """What Part 2 trains: ``overrides`` of ``deepseek_v3_671b`` on ``paths``, and how it relates to the real model."""

    overrides: dict[str, Any]
    seq_len: int  # the sequence length the runs use (shorter than asked only in a CPU's shrunk slice)
    shrink: int  # 1: every width exact
    expert_parallel: int
    paths: tuple[str, ...]
    label: str
    need_bytes: float  # predicted peak per device, the largest path
    memory_bytes: float
    memory_source: str
    ladder: pd.DataFrame  # the rungs tried, in order: layers, MTP block, weights, experts, GiB predicted, fits
    notes: list[str]

    @property
    def exact(self) -> bool:
        return self.shrink == 1


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"parameter {name}: must be a positive int, got {value!r}")


def default_paths(cfg, devices: Devices, exact: bool) -> tuple[str, ...]:
    """The paths a default run compares: dense_cf, ragged (not at the exact widths) and turbo, plus turbo_fp8 where
    the device runs its kernels and the widths are multiples of its tile. pallas (GPUs) is yours to add."""
    usable = accounting.paths_for(cfg)
    paths = [p for p in ("dense_cf", "ragged", "turbo") if not (exact and p in NOT_AT_EXACT_WIDTHS)]
    if devices.fp8 and "turbo_fp8" in usable:
        paths.append("turbo_fp8")
    return tuple(paths)


def need_bytes(cfg, paths: Sequence[str], devices: Devices, per_device_batch: int, seq_len: int) -> float:
    """The predicted peak per device of the largest of `paths` (states + activations)."""
    mesh = accounting.MeshShape(expert=devices.expert_parallel)
    moments = devices.moments_dtype
    return max(sum(accounting.memory_prediction(cfg.replace(moe_path=p), per_device_batch, seq_len, mesh, moments,
                                                moments).values()) for p in paths)


def step_tflop(cfg, per_device_batch: int, seq_len: int) -> float:
    """Training TFLOP a device runs per step."""
    return flops_per_token(cfg, seq_len) * per_device_batch * seq_len / 1e12


def _rung_row(cfg, need: float, fits: bool) -> dict[str, Any]:
    return {"layers": cfg.n_layers, "MTP block": "yes" if cfg.mtp_depth else "no", "weights": cfg.param_dtype,
            "routed experts": cfg.n_experts, "GiB predicted": need / GIB, "fits": fits}


def _layer_rungs(n_layers: int, n_dense_layers: int, mtp_depth: int) -> list[tuple[int, int]]:
    return [(layers, mtp) for layers in range(n_layers, n_dense_layers, -1)
            for mtp in dict.fromkeys((mtp_depth, 0))]


def _expert_counts(cfg, expert_parallel: int) -> list[int]:
    """Valid routed-expert counts below cfg's, most first: multiples of n_groups and of the expert-parallel ways."""
    step = math.lcm(cfg.n_groups, expert_parallel)
    counts = []
    for n in range(cfg.n_experts - step, 0, -step):
        try:
            cfg.replace(n_experts=n)
        except ValueError:  # too few experts for top_k within the selected groups
            continue
        counts.append(n)
    return counts


def _walk(base: Mapping[str, Any], *, n_layers: int, n_dense_layers: int, n_experts: int | None, paths, devices,
          per_device_batch: int, seq_len: int, max_step_tflop: float | None, exact: bool):
    """(first rung that fits or None, its paths, its need, the ladder's rows)."""
    top = get_config(PRESET, **{**base, "n_layers": n_layers, "n_dense_layers": n_dense_layers})
    experts = n_experts or top.n_experts
    rows: list[dict[str, Any]] = []

    def trial(cfg):
        run_paths = tuple(paths) if paths else default_paths(cfg, devices, exact)
        need = need_bytes(cfg, run_paths, devices, per_device_batch, seq_len)
        fits = need <= devices.memory_bytes and (max_step_tflop is None
                                                 or step_tflop(cfg, per_device_batch, seq_len) <= max_step_tflop)
        return run_paths, need, fits

    weights = (base["param_dtype"],) if "param_dtype" in base else WEIGHT_DTYPES
    for dtype in weights:
        for layers, mtp in _layer_rungs(n_layers, n_dense_layers, top.mtp_depth):
            cfg = get_config(PRESET, **{**base, "n_layers": layers, "n_dense_layers": n_dense_layers,
                                        "mtp_depth": mtp, "param_dtype": dtype, "n_experts": experts})
            run_paths, need, fits = trial(cfg)
            rows.append(_rung_row(cfg, need, fits))
            if fits:
                return cfg, run_paths, need, rows
    if n_experts is not None:
        return None, (), 0.0, rows
    fewest = None
    for count in _expert_counts(cfg, devices.expert_parallel):  # cfg: the last rung, the fewest layers
        fewer = cfg.replace(n_experts=count)
        run_paths, need, fits = trial(fewer)
        fewest = (fewer, need)
        if fits:
            rows.append(_rung_row(fewer, need, True))
            return fewer, run_paths, need, rows
    if fewest is not None:
        rows.append(_rung_row(fewest[0], fewest[1], False))
    return None, (), 0.0, rows


def _slice_fields(cfg) -> dict[str, Any]:
    return {k: getattr(cfg, k) for k in ("n_layers", "n_dense_layers", "mtp_depth", "n_experts", "param_dtype")}


def exact_label(cfg, expert_parallel: int) -> str:
    """One line: which part of DeepSeek-V3-671B the slice is."""
    moe = cfg.n_layers - cfg.n_dense_layers
    mtp = " + the MTP block" if cfg.mtp_depth else ", no MTP block"
    over = f" over {expert_parallel} GPUs (expert parallelism)" if expert_parallel > 1 else ""
    return (f"DeepSeek-V3's exact widths: {cfg.n_layers} of {FULL_LAYERS} layers ({cfg.n_dense_layers} dense + {moe} "
            f"MoE{mtp}), {cfg.n_experts} of {FULL_EXPERTS} routed experts{over}, {cfg.param_dtype} weights")


def shrunk_widths(divisor: int) -> dict[str, int]:
    """Every width of the preset / ``divisor`` (floors keep a valid config); head dimensions stay exact."""
    exact = get_config(PRESET)
    return {k: max(int(getattr(exact, k)) // divisor, floor) for k, floor in _WIDTHS.items()}


def _check(n_layers, n_dense_layers, n_experts, width_divisor, model_overrides, paths, per_device_batch, seq_len,
           devices: Devices) -> None:
    for name, value in (("n_layers", n_layers), ("per_device_batch", per_device_batch), ("seq_len", seq_len)):
        _positive_int(name, value)
    if isinstance(n_dense_layers, bool) or not isinstance(n_dense_layers, int) or not 0 <= n_dense_layers < n_layers:
        raise ValueError(f"parameter n_dense_layers: must be an int in [0, n_layers={n_layers}) (a slice has a MoE "
                         f"layer), got {n_dense_layers!r}")
    if n_experts is not None:
        _positive_int("n_experts", n_experts)
        if n_experts % devices.expert_parallel:
            raise ValueError(f"parameter n_experts: {n_experts} routed experts do not split over "
                             f"{devices.expert_parallel} GPUs; use a multiple of {devices.expert_parallel}")
    if width_divisor is not None and width_divisor not in (1, *SHRINKS):
        raise ValueError(f"parameter width_divisor: must be None (exact widths where they fit), 1 or one of "
                         f"{SHRINKS}, got {width_divisor!r}")
    if not isinstance(model_overrides, Mapping):
        raise ValueError(f"parameter model_overrides: must be a dict, got {type(model_overrides).__name__}")
    if paths is not None and (isinstance(paths, str) or not paths or set(paths) - set(MOE_PATHS)):
        raise ValueError(f"parameter paths: expected None or a non-empty list from {MOE_PATHS}, got {paths!r}")


def plan_slice(
    *, n_layers: int, n_dense_layers: int, n_experts: int | None, width_divisor: int | None,
    model_overrides: Mapping[str, Any], paths: Sequence[str] | None, per_device_batch: int, seq_len: int,
    capacity_factor: float, devices: Devices, max_step_tflop: float | None = None,
) -> SlicePlan:
    """The slice to train (module docstring). ``n_layers`` is the most layers; ``n_experts`` None: as many as fit (256
    is exact); ``width_divisor`` None: exact widths where any rung fits, else the smallest shrink that does; a number:
    those widths (1: exact, or a ValueError). ``model_overrides`` go on top of every rung (the widths are then yours).
    ``paths`` None: `default_paths`. ``max_step_tflop``: training TFLOP a device may run per step (None: no limit)."""
    _check(n_layers, n_dense_layers, n_experts, width_divisor, model_overrides, paths, per_device_batch, seq_len,
           devices)
    # A slice of a few layers saves the matmul, expert and attention outputs: the preset's "full" (right for all 61
    # layers) recomputed 12% of the step at no memory saving (docs/expert-parallel.md); model_overrides may differ.
    base = {"capacity_factor": capacity_factor, "max_seq_len": seq_len, "remat_policy": SLICE_REMAT_POLICY}
    divisor = width_divisor or 1
    widths = shrunk_widths(divisor) if divisor > 1 else {}
    user = dict(model_overrides)
    have = f"{devices.memory_bytes / GIB:.1f} GiB ({devices.memory_source})"
    walk = dict(n_layers=n_layers, n_dense_layers=n_dense_layers, n_experts=n_experts, paths=paths, devices=devices,
                per_device_batch=per_device_batch, seq_len=seq_len, max_step_tflop=max_step_tflop)
    cfg, run_paths, need, rows = _walk({**base, **widths, **user}, exact=divisor == 1 and not user, **walk)
    ladder = pd.DataFrame(rows)
    ep = devices.expert_parallel
    if cfg is not None:
        overrides = {**base, **widths, **_slice_fields(cfg), **user}
        if user:
            label = (f"{PRESET} slice with your model_overrides: {cfg.n_layers} layers, {cfg.n_experts} routed "
                     f"experts, {cfg.param_dtype} weights")
            notes = ["model_overrides given: the widths are yours, not DeepSeek-V3's"]
        elif divisor > 1:
            label = (f"widths / {divisor} (as asked; not DeepSeek-V3's): {cfg.n_layers} layers, {cfg.n_experts} "
                     f"routed experts, {cfg.param_dtype} weights")
            notes = [f"width_divisor={divisor}: " + ", ".join(f"{k} {v}" for k, v in widths.items())]
        else:
            label, notes = exact_label(cfg, ep), []
        return SlicePlan(overrides, seq_len, divisor, ep, run_paths, label, need, devices.memory_bytes,
                         devices.memory_source, ladder, notes)
    if user or width_divisor is not None:
        smallest = ladder["GiB predicted"].min() if len(ladder) else float("nan")
        name = "model_overrides" if user else "width_divisor"
        raise ValueError(f"parameter {name}: no slice of these widths fits {have}: the smallest needs {smallest:.1f} "
                         f"GiB (n_layers={n_layers}, per_device_batch={per_device_batch}, seq_len={seq_len})")
    budget = "" if max_step_tflop is None else f" within {max_step_tflop:g} training TFLOP a step"
    notes = [f"DeepSeek-V3's exact widths do not fit this device{budget}: {have}; the smallest slice needs "
             f"{ladder['GiB predicted'].min():.1f} GiB (the ladder above)"]
    return _shrunk_fallback(base, n_layers, n_dense_layers, n_experts, paths, devices, per_device_batch, seq_len,
                            max_step_tflop, ladder, notes)


def _shrunk_fallback(base, n_layers, n_dense_layers, n_experts, paths, devices, per_device_batch, seq_len,
                     max_step_tflop, ladder, notes) -> SlicePlan:
    """Every width / the smallest power of two whose slice fits the memory and the step budget: a smoke run of the
    paths (it checks them, it does not measure the architecture), so the asked layers and the fewest valid experts
    unless the user named a count; where even widths / 64 exceed the budget, a shorter sequence."""
    have = f"{devices.memory_bytes / GIB:.1f} GiB ({devices.memory_source})"
    layers = {"n_layers": n_layers, "n_dense_layers": n_dense_layers}

    def slice_cfg(shrink: int, run_seq: int):
        widths = shrunk_widths(shrink)
        cfg = get_config(PRESET, **{**base, **layers, **widths, "max_seq_len": run_seq})
        experts = n_experts or next(n for n in sorted({cfg.n_experts, *_expert_counts(cfg, devices.expert_parallel)})
                                    if n % devices.expert_parallel == 0)
        return cfg.replace(n_experts=experts), widths

    def paths_of(cfg):
        return tuple(paths) if paths else default_paths(cfg, devices, exact=False)

    fits_memory = False
    for shrink in SHRINKS:
        cfg, widths = slice_cfg(shrink, seq_len)
        need = need_bytes(cfg, paths_of(cfg), devices, per_device_batch, seq_len)
        if need > devices.memory_bytes:
            continue
        fits_memory = True
        if max_step_tflop is None or step_tflop(cfg, per_device_batch, seq_len) <= max_step_tflop:
            return _shrunk(cfg, widths, shrink, seq_len, seq_len, per_device_batch, paths_of(cfg), need, devices,
                           ladder, notes)
    if not fits_memory:
        raise ValueError(f"parameter seq_len: even widths / {SHRINKS[-1]} do not fit {have} with per_device_batch="
                         f"{per_device_batch}, seq_len={seq_len}; lower seq_len or set model_overrides")
    # The widest shrink still exceeds the step budget: attention at this length dominates; halve the sequence.
    shrink, run_seq = SHRINKS[-1], seq_len
    while run_seq > MIN_SEQ_LEN and step_tflop(slice_cfg(shrink, run_seq)[0], per_device_batch,
                                               run_seq) > max_step_tflop:
        run_seq //= 2
    cfg, widths = slice_cfg(shrink, run_seq)
    need = need_bytes(cfg, paths_of(cfg), devices, per_device_batch, run_seq)
    return _shrunk(cfg, widths, shrink, run_seq, seq_len, per_device_batch, paths_of(cfg), need, devices, ladder,
                   notes)


def _shrunk(cfg, widths, shrink, run_seq, asked_seq, per_device_batch, paths, need, devices, ladder,
            notes) -> SlicePlan:
    seq_text = f", sequence {run_seq} of {asked_seq}" if run_seq != asked_seq else ""
    label = (f"SHRUNK slice (not DeepSeek-V3's widths): every width / {shrink}{seq_text}, {cfg.n_layers} layers, "
             f"{cfg.n_experts} experts")
    notes = notes + [f"running {label}: " + ", ".join(f"{k} {v}" for k, v in widths.items())
                     + f"; about {step_tflop(cfg, per_device_batch, run_seq):.4f} training TFLOP per step"]
    overrides = {"capacity_factor": cfg.capacity_factor, "max_seq_len": run_seq, "remat_policy": cfg.remat_policy,
                 **widths, **_slice_fields(cfg)}
    return SlicePlan(overrides, run_seq, shrink, devices.expert_parallel, paths, label, need, devices.memory_bytes,
                     devices.memory_source, ladder, notes)
