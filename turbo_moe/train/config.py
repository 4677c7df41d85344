"""TrainConfig: one frozen, validated dataclass describing a training run."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping

from turbo_moe.model import ModelConfig, get_config

_POSITIVE_INTS = ("per_device_batch", "steps", "log_every", "keep_checkpoints", "expert_parallel")
_NON_NEGATIVE_INTS = ("warmup_steps", "eval_every", "eval_batches", "checkpoint_every", "skip_steps_for_tgs", "seed")
ADAM_MU_DTYPES = (None, "bfloat16", "float32")
ADAM_NU_DTYPES = ADAM_MU_DTYPES  # the moments' storage dtypes: None is the parameters' dtype
NU_ROUNDINGS = ("nearest", "stochastic")
MASTER_WEIGHTS = ("float32", "split")  # turbo_moe/train/split_master.py
# bfloat16 keeps 8 significant bits: for adam_b2 above 1 - 2**-8 the decay b2 * nu can round back to nu.
BF16_NU_MAX_B2 = 1 - 2**-8


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything `run` needs. Model = preset name or ModelConfig, plus `model_overrides`.

    seq_len None means the model's `max_seq_len`. The learning rate warms up linearly over
    `warmup_steps`, then follows a cosine decay to `min_lr_ratio * learning_rate` at
    `lr_schedule_steps` (default: `steps`; set it when a run is split into several invocations).
    """

    model: str | ModelConfig = "tiny"
    model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dataset: str = "shakespeare"  # "shakespeare" | "synthetic" | a path (txt/jsonl/json.gz/parquet)
    text_field: str = "text"
    val_fraction: float = 0.05
    per_device_batch: int = 8
    # Routed experts split over this many devices (mesh (devices / ep, ep) over ("data", "expert")).
    expert_parallel: int = 1
    # ZeRO-3 / FSDP: shard every training state over the devices (turbo_moe.model.sharding); False
    # replicates the non-expert states over all devices and the expert states over "data".
    fsdp: bool = True
    # XLA's GPU GEMM autotuning at compile time (0-4; None: XLA's default, 4). 0 compiles faster but,
    # without a warm autotune cache, its default Triton tiles run the step several times slower
    # (experiments/NOTES.md, issue 12): keep None unless compile time is all that matters.
    xla_gpu_autotune_level: int | None = None
    # Lower the train step with JAX's scan outputs left uninitialised (`lax.empty`) instead of zero-filled:
    # every stacked output slice is written by the loop, so the fill is wasted (turbo_moe/train/scan_outputs.py).
    # Replaces a private JAX function while lowering: off by default.
    scan_outputs_uninitialized: bool = False
    # The stacked layers' cast-at-use weights kept in the train state in the compute dtype, written by the optimizer
    # update next to the float32 master weights (one fused pass), instead of cast from float32 at the start of every
    # step (ModelConfig.cast_params_before_scan). Same values and gradients; +2 bytes a stacked weight in the state.
    cast_params_in_update: bool = False
    # How the stacked layers' float32 master weights are kept (turbo_moe.train.split_master): "float32", or "split":
    # as their bf16 compute copy (what the forward reads; rounded half up, not to nearest-even, at exact ties) + the
    # 16 low bits, exact together. The update reads and writes 4 bytes a weight where cast_params_in_update reads 4
    # and writes 6; the state is 2 bytes a weight smaller. Needs the model's dtype bfloat16 and param_dtype float32,
    # and replaces cast_params_in_update. Checkpoints hold the split form: resume with the same setting.
    master_weights: str = "float32"
    seq_len: int | None = None
    steps: int = 50
    learning_rate: float = 3e-3
    warmup_steps: int = 10
    lr_schedule_steps: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    # AdamW first-moment storage dtype (optax mu_dtype); None: the parameters' dtype (float32). "bfloat16"
    # halves mu's bytes: the update is memory-bound (experiments/NOTES.md, issue 14).
    adam_mu_dtype: str | None = None
    # AdamW second-moment storage dtype (a wrapper around optax's adamw, turbo_moe.train.step.with_adam_nu_dtype);
    # None: the parameters' dtype. "bfloat16" with a bf16 mu is DeepSeek-V3's recipe (both moments in BF16) and
    # needs adam_b2 <= 1 - 2**-8 (BF16_NU_MAX_B2), else nu cannot decay.
    adam_nu_dtype: str | None = None
    # How a bf16 nu is stored: "nearest" (as DeepSeek-V3 describes; it cost +0.074 nats at 300 steps here, NOTES) or
    # "stochastic" (unbiased: turbo_moe.train.low_precision_adam), which also lifts the adam_b2 limit.
    adam_nu_rounding: str = "nearest"
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    remat_policy: str | None = None  # overrides the model's remat_policy when set
    eval_every: int = 25  # 0: only at the end
    eval_batches: int = 4  # 0: never evaluate (throughput runs skip compiling the eval step)
    log_every: int = 1
    seed: int = 0
    data_dir: str | None = None  # None: $TURBO_MOE_DATA_DIR or ~/.cache/turbo_moe
    checkpoint_dir: str | None = None  # orbax checkpoints + run record; needed for resume
    checkpoint_every: int = 0  # 0: only at the end (when checkpoint_dir is set)
    keep_checkpoints: int = 2
    resume: bool = False
    progress: bool = True
    skip_steps_for_tgs: int = 3  # steps after compile excluded from TGS/MFU

    def __post_init__(self):
        # Paths may be given as pathlib.Path; store str so the config stays JSON-serialisable.
        for name in ("dataset", "data_dir", "checkpoint_dir"):
            if isinstance(getattr(self, name), Path):
                object.__setattr__(self, name, str(getattr(self, name)))
        _validate(self)

    def model_config(self) -> ModelConfig:
        """The resolved, validated ModelConfig (preset or given config, then overrides)."""
        overrides = dict(self.model_overrides)
        if self.remat_policy is not None:
            overrides["remat_policy"] = self.remat_policy
        if isinstance(self.model, ModelConfig):
            return self.model.replace(**overrides) if overrides else self.model
        return get_config(self.model, **overrides)

    @property
    def resolved_seq_len(self) -> int:
        return self.seq_len if self.seq_len is not None else self.model_config().max_seq_len

    @property
    def schedule_steps(self) -> int:
        return self.lr_schedule_steps if self.lr_schedule_steps is not None else self.steps

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["model_overrides"] = dict(self.model_overrides)
        if isinstance(self.model, ModelConfig):
            out["model"] = self.model.to_dict()
        return out

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TrainConfig":
        """Inverse of `to_dict`; `model` may be a preset name or a ModelConfig dict. Unknown keys raise."""
        if not isinstance(values, Mapping):
            raise TypeError(f"TrainConfig.from_dict expects a mapping, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; known fields: {sorted(known)}")
        kwargs = dict(values)
        if isinstance(kwargs.get("model"), Mapping):
            kwargs["model"] = ModelConfig.from_dict(kwargs["model"])
        return cls(**kwargs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ValueError(f"TrainConfig.{field}: {message}")


def _validate(c: TrainConfig) -> None:
    for name in _POSITIVE_INTS:
        value = getattr(c, name)
        _require(_is_int(value) and value > 0, name, f"must be a positive int, got {value!r}")
    for name in _NON_NEGATIVE_INTS:
        value = getattr(c, name)
        _require(_is_int(value) and value >= 0, name, f"must be a non-negative int, got {value!r}")
    _require(isinstance(c.scan_outputs_uninitialized, bool), "scan_outputs_uninitialized",
             f"must be a bool, got {c.scan_outputs_uninitialized!r}")
    _require(isinstance(c.cast_params_in_update, bool), "cast_params_in_update",
             f"must be a bool, got {c.cast_params_in_update!r}")
    _require(isinstance(c.master_weights, str) and c.master_weights in MASTER_WEIGHTS, "master_weights",
             f"got {c.master_weights!r}; expected one of {MASTER_WEIGHTS}")
    _require(not (c.master_weights == "split" and c.cast_params_in_update), "master_weights",
             "'split' already keeps the bf16 compute copy in the state: set cast_params_in_update=False")
    _require(c.xla_gpu_autotune_level is None or (_is_int(c.xla_gpu_autotune_level)
             and 0 <= c.xla_gpu_autotune_level <= 4), "xla_gpu_autotune_level",
             f"must be None or an int in 0..4, got {c.xla_gpu_autotune_level!r}")
    _require(c.seq_len is None or (_is_int(c.seq_len) and c.seq_len > 0), "seq_len",
             f"must be a positive int or None, got {c.seq_len!r}")
    _require(c.lr_schedule_steps is None or (_is_int(c.lr_schedule_steps) and c.lr_schedule_steps >= c.steps),
             "lr_schedule_steps", f"must be None or an int >= steps={c.steps}, got {c.lr_schedule_steps!r}")
    _require(c.warmup_steps <= c.schedule_steps, "warmup_steps",
             f"{c.warmup_steps} > the schedule's {c.schedule_steps} steps")
    _require(_is_number(c.learning_rate) and c.learning_rate > 0, "learning_rate",
             f"must be a positive finite number, got {c.learning_rate!r}")
    for name in ("weight_decay", "grad_clip"):
        value = getattr(c, name)
        _require(_is_number(value) and value >= 0, name, f"must be a finite number >= 0, got {value!r}")
    for name in ("min_lr_ratio", "adam_b1", "adam_b2"):
        value = getattr(c, name)
        _require(_is_number(value) and 0 <= value <= 1, name, f"must be in [0, 1], got {value!r}")
    _require(c.adam_mu_dtype is None or (isinstance(c.adam_mu_dtype, str) and c.adam_mu_dtype in ADAM_MU_DTYPES),
             "adam_mu_dtype", f"got {c.adam_mu_dtype!r}; expected one of {ADAM_MU_DTYPES}")
    _require(c.adam_nu_dtype is None or (isinstance(c.adam_nu_dtype, str) and c.adam_nu_dtype in ADAM_NU_DTYPES),
             "adam_nu_dtype", f"got {c.adam_nu_dtype!r}; expected one of {ADAM_NU_DTYPES}")
    _require(c.adam_nu_rounding in NU_ROUNDINGS, "adam_nu_rounding",
             f"got {c.adam_nu_rounding!r}; expected one of {NU_ROUNDINGS}")
    _require(c.adam_nu_rounding == "nearest" or c.adam_nu_dtype == "bfloat16", "adam_nu_rounding",
             f"{c.adam_nu_rounding!r} rounds a bfloat16 nu; adam_nu_dtype is {c.adam_nu_dtype!r}")
    _require(c.adam_nu_dtype != "bfloat16" or c.adam_nu_rounding == "stochastic" or c.adam_b2 <= BF16_NU_MAX_B2,
             "adam_nu_dtype",
             f"'bfloat16' needs adam_b2 <= 1 - 2**-8 (~{BF16_NU_MAX_B2:.4f}), got adam_b2={c.adam_b2!r}: bfloat16 "
             f"keeps 8 significant bits, so b2 * nu can round back to nu and the second moment stops shrinking "
             f"(adam_nu_rounding='stochastic' does not)")
    _require(_is_number(c.val_fraction) and 0 < c.val_fraction < 1, "val_fraction",
             f"must be in (0, 1), got {c.val_fraction!r}")
    _require(isinstance(c.dataset, str) and c.dataset != "", "dataset",
             f"must be 'shakespeare', 'synthetic' or a path, got {c.dataset!r}")
    _require(isinstance(c.text_field, str) and c.text_field != "", "text_field",
             f"must be a non-empty str, got {c.text_field!r}")
    for name in ("resume", "progress", "fsdp"):
        _require(isinstance(getattr(c, name), bool), name, f"must be a bool, got {getattr(c, name)!r}")
    _require(not c.resume or c.checkpoint_dir is not None, "resume", "resume=True needs a checkpoint_dir")
    for name in ("data_dir", "checkpoint_dir"):
        value = getattr(c, name)
        _require(value is None or (isinstance(value, str) and value != ""), name,
                 f"must be None or a non-empty path, got {value!r}")
    _require(isinstance(c.model, (str, ModelConfig)), "model",
             f"must be a preset name or a ModelConfig, got {type(c.model).__name__}")
    _require(isinstance(c.model_overrides, Mapping), "model_overrides",
             f"must be a mapping, got {type(c.model_overrides).__name__}")
    model_cfg = c.model_config()  # raises ValueError naming the ModelConfig field
    _require(model_cfg.n_experts % c.expert_parallel == 0, "expert_parallel",
             f"{c.expert_parallel} does not divide the model's n_experts={model_cfg.n_experts}")
    _require(c.master_weights != "split" or (model_cfg.dtype == "bfloat16" and model_cfg.param_dtype == "float32"),
             "master_weights", f"'split' keeps float32 master weights as their bfloat16 compute copy + 16 low bits: it "
             f"needs the model's dtype 'bfloat16' and param_dtype 'float32', got {model_cfg.dtype!r} and "
             f"{model_cfg.param_dtype!r}")
    seq_len = c.seq_len if c.seq_len is not None else model_cfg.max_seq_len
    _require(seq_len <= model_cfg.max_seq_len, "seq_len",
             f"{seq_len} > the model's max_seq_len={model_cfg.max_seq_len} (raise it in model_overrides)")
