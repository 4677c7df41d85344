"""TrainConfig: one frozen, validated dataclass describing a training run."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping

import jax

from turbo_moe.model import ModelConfig, get_config
from turbo_moe.model.config import MAXTEXT_ALIASES, PRESET_NAMES, record_router_fields
from turbo_moe.model.config import REMOVED_FIELDS as MODEL_REMOVED_FIELDS

_POSITIVE_INTS = ("per_device_batch", "steps", "log_every", "keep_checkpoints", "expert_parallel")
_NON_NEGATIVE_INTS = ("warmup_steps", "eval_every", "eval_batches", "checkpoint_every", "skip_steps_for_tgs", "seed")
ADAM_MU_DTYPES = ("auto", None, "bfloat16", "float32")
ADAM_NU_DTYPES = ADAM_MU_DTYPES  # the moments' storage dtypes: None is the parameters' dtype
MASTER_WEIGHTS = ("auto", "float32", "split")  # turbo_moe/train/split_master.py
# TrainConfig fields that measured A/Bs decided and removed: name -> (the behaviour kept, why). `from_dict` accepts a
# removed field set to the kept behaviour (old records and specs) and refuses any other value with the reason.
REMOVED_FIELDS: dict[str, tuple[Any, str]] = {
    "scan_outputs_uninitialized": (True, "scan outputs are left uninitialised on GPUs wherever this JAX allows it"),
    "cast_params_in_update": (False, "master_weights='split' keeps the bf16 compute copy instead"),
    "xla_gpu_autotune_level": (None, "runs compile with XLA's GEMM autotuning (level 0 ran the step several times "
                                     "slower); benchmarks that only compile pass a level to build_program"),
    "adam_nu_rounding": ("auto", "a bfloat16 nu is always rounded stochastically (round-to-nearest cost +0.074 nats "
                                 "and froze nu for adam_b2 > 1 - 2**-8); a float32 nu has nothing to round"),
}
# Values of the removed adam_nu_rounding that name what now runs: "nearest" only where nu is not bfloat16.
_NU_ROUNDINGS_KEPT = ("auto", "stochastic")


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
    # How the stacked layers' float32 master weights are kept (turbo_moe.train.split_master): "float32", or "split":
    # as their bf16 compute copy (what the forward reads; rounded half up, not to nearest-even, at exact ties) + the
    # 16 low bits, exact together: the update reads and writes 4 bytes a weight and the forward reads the bf16 copy.
    # Needs the model's dtype bfloat16 and param_dtype float32. "auto": "split" on GPUs where it applies, else
    # "float32". Checkpoints hold the layout they were written in: resume with the same (resolved) setting.
    master_weights: str = "auto"
    seq_len: int | None = None
    steps: int = 50
    learning_rate: float = 3e-3
    warmup_steps: int = 10
    lr_schedule_steps: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    # AdamW moments' storage dtypes (a quality/speed choice: the update is memory-bound). mu: optax's mu_dtype; nu: a
    # wrapper around optax's adamw (turbo_moe.train.low_precision_adam) that rounds a bfloat16 nu stochastically
    # (unbiased; DeepSeek-V3's round-to-nearest cost +0.074 nats at 300 steps, docs/configuration.md). None: the
    # parameters' dtype (float32). "bfloat16" for both is DeepSeek-V3's recipe. "auto": bfloat16 on GPUs, None on
    # the CPU.
    adam_mu_dtype: str | None = "auto"
    adam_nu_dtype: str | None = "auto"
    grad_clip: float = 1.0  # global-norm clip; 0 disables
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

    def resolved(self, platform: str | None = None) -> "TrainConfig":
        """This config with every "auto" replaced by what it means on `platform` (default: JAX's backend): what a
        run executes and records."""
        on_gpu = (platform or jax.default_backend()) == "gpu"
        cfg = self.model_config()
        changes: dict[str, Any] = {}
        if self.master_weights == "auto":
            split = on_gpu and cfg.dtype == "bfloat16" and cfg.param_dtype == "float32"
            changes["master_weights"] = "split" if split else "float32"
        for name in ("adam_mu_dtype", "adam_nu_dtype"):
            if getattr(self, name) == "auto":
                changes[name] = "bfloat16" if on_gpu else None
        return self.replace(**changes) if changes else self

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["model_overrides"] = dict(self.model_overrides)
        if isinstance(self.model, ModelConfig):
            out["model"] = self.model.to_dict()
        return out

    @classmethod
    def from_record(cls, values: Mapping[str, Any]) -> "TrainConfig":
        """An older run's recorded config, for reading history: fields since removed (this class's and the model's,
        in `model` and `model_overrides`) are dropped whatever their value, since that run already ran with them, and
        the router fields a recipe replaced are read as `record_router_fields` reads them. Configs to run go through
        `from_dict`."""

        def model_fields(fields: Mapping[str, Any], base: str = "deepseek_v3") -> dict[str, Any]:
            kept = {k: v for k, v in fields.items() if MAXTEXT_ALIASES.get(k, k) not in MODEL_REMOVED_FIELDS}
            return record_router_fields(kept, base)

        kept = {k: v for k, v in values.items() if k not in REMOVED_FIELDS}
        preset = kept.get("model", "tiny")
        if isinstance(kept.get("model_overrides"), Mapping):
            base = get_config(preset).router_recipe if preset in PRESET_NAMES else "deepseek_v3"
            kept["model_overrides"] = model_fields(kept["model_overrides"], base)
        if isinstance(kept.get("model"), Mapping):
            kept["model"] = model_fields(kept["model"])
        return cls.from_dict(kept)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TrainConfig":
        """Inverse of `to_dict`; `model` may be a preset name or a ModelConfig dict. Unknown keys raise."""
        if not isinstance(values, Mapping):
            raise TypeError(f"TrainConfig.from_dict expects a mapping, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = dict(values)
        for name in sorted(set(kwargs) & set(REMOVED_FIELDS)):
            kept, why = REMOVED_FIELDS[name]
            value = kwargs.pop(name)
            if value != kept and not _names_what_runs(name, value, kwargs):
                raise ValueError(f"TrainConfig field {name!r} was removed ({why}); got {value!r}: drop it from the "
                                 f"config")
        if "remat_policy" in kwargs:  # MaxText's top-level key: the model's field
            policy = kwargs.pop("remat_policy")
            if policy is not None:
                kwargs["model_overrides"] = {**dict(kwargs.get("model_overrides") or {}), "remat_policy": policy}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; known fields: {sorted(known)}")
        if isinstance(kwargs.get("model"), Mapping):
            kwargs["model"] = ModelConfig.from_dict(kwargs["model"])
        return cls(**kwargs)


def _names_what_runs(name: str, value: Any, values: Mapping[str, Any]) -> bool:
    """A removed field's old value other than the kept one that still names what runs (an older resolved record)."""
    if name == "adam_nu_rounding":
        nu = values.get("adam_nu_dtype", "auto")
        return value in _NU_ROUNDINGS_KEPT or (value == "nearest" and nu in (None, "float32"))
    return False


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
    _require(c.seed < 2**63, "seed", f"must be below 2**63 (jax.random.key takes a 64-bit int), got {c.seed!r}")
    _require(isinstance(c.master_weights, str) and c.master_weights in MASTER_WEIGHTS, "master_weights",
             f"got {c.master_weights!r}; expected one of {MASTER_WEIGHTS}")
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
