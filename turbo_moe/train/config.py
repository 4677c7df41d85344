"""TrainConfig: one frozen, validated description of a training run, in four sub-configs by concern.

`TrainConfig(model=..., steps=..., optimizer=OptimizerConfig(...), data=DataConfig(...), parallel=...,
checkpoint=...)`, or flat as MaxText writes its configs: `TrainConfig(learning_rate=1e-3, per_device_batch=4)`,
`cfg.learning_rate`, `cfg.replace(learning_rate=...)`, YAML/`--set learning_rate=...` (or a section
`optimizer: {learning_rate: ...}`, `--set optimizer.learning_rate=...`). A field given both flat and in its
sub-config is refused. `to_dict()` is flat: the run records and the results store read flat keys.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax

from turbo_moe.model import ModelConfig, get_config
from turbo_moe.model.config import MAXTEXT_ALIASES, PRESET_NAMES, record_router_fields, resolve_moe_path
from turbo_moe.model.config import REMOVED_FIELDS as MODEL_REMOVED_FIELDS
from turbo_moe.train.config_groups import (FLAT_FIELDS, FLAT_NAMES, GROUPS, MASTER_WEIGHTS, MOMENTS_DTYPES,
                                           OPTIMIZER_STATE_MEMORIES, CheckpointConfig, DataConfig, OptimizerConfig, ParallelConfig, require,
                                           require_int)
from turbo_moe.train.metrics import TGS_SKIP_STEPS
from turbo_moe.train.recipes import optimizer_recipe

__all__ = ["TrainConfig", "OptimizerConfig", "DataConfig", "ParallelConfig", "CheckpointConfig", "FIELD_NAMES",
           "REMOVED_FIELDS", "MOMENTS_DTYPES", "MASTER_WEIGHTS", "OPTIMIZER_STATE_MEMORIES"]

# TrainConfig fields that measured A/Bs decided and removed: name -> (the behaviour kept, why). `from_dict` accepts a
# removed field set to the kept behaviour (old records and specs) and refuses any other value with the reason.
REMOVED_FIELDS: dict[str, tuple[Any, str]] = {
    "scan_outputs_uninitialized": (True, "scan outputs are left uninitialised on one-GPU meshes wherever this JAX allows it"),
    "cast_params_in_update": (False, "master_weights='split' keeps the bf16 compute copy instead"),
    "xla_gpu_autotune_level": (None, "runs compile with XLA's GEMM autotuning (level 0 ran the step several times "
                                     "slower); benchmarks that only compile pass a level to build_program"),
    "adam_nu_rounding": ("auto", "a bfloat16 nu is always rounded stochastically (round-to-nearest cost +0.074 nats "
                                 "and froze nu for adam_b2 > 1 - 2**-8); a float32 nu has nothing to round"),
    "skip_steps_for_tgs": (TGS_SKIP_STEPS, f"TGS and MFU leave out the first {TGS_SKIP_STEPS} steps after compile "
                                           f"(half of a shorter run)"),
}
# Values of the removed adam_nu_rounding that name what now runs: "nearest" only where nu is not bfloat16.
_NU_ROUNDINGS_KEPT = ("auto", "stochastic")
# The two moments' dtypes, one field since both are stored alike (DeepSeek-V3 keeps both in bfloat16).
_MOMENT_NAMES = ("adam_mu_dtype", "adam_nu_dtype")
# The optimizer fields whose None means the model preset's recipe (turbo_moe/train/recipes.py).
_RECIPE_FIELDS = ("learning_rate", "warmup_steps")
_TOP_FIELDS = ("model", "model_overrides", "steps", "seed", "eval_every", "eval_batches", "log_every", "progress",
               "deterministic")
# Every name `from_dict` takes flat, the older spellings included (the constructor takes all but MaxText's top-level
# remat_policy, which `from_dict` moves into model_overrides).
FIELD_NAMES = (*_TOP_FIELDS, *FLAT_FIELDS, *_MOMENT_NAMES, "seq_len", "remat_policy")


@dataclasses.dataclass(frozen=True, init=False)
class TrainConfig:
    """Everything `run` needs. Model = preset name or ModelConfig, plus `model_overrides`; the run-level fields here,
    the rest in `optimizer`, `data`, `parallel` and `checkpoint` (each also readable and settable flat).

    `seq_len` (the tokens per sequence) is the model's `max_seq_len`: given here, it becomes that model override.
    """

    model: str | ModelConfig = "tiny"
    model_overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    steps: int = 50
    seed: int = 0
    eval_every: int = 25  # 0: only at the end
    eval_batches: int = 4  # 0: never evaluate (throughput runs skip compiling the eval step)
    log_every: int = 1
    progress: bool = True
    # The same config twice gives the same bits on the GPU (losses, gradients, parameters): every program compiles with
    # XLA's deterministic ops (turbo_moe/train/determinism.py; its cost in docs/notes/determinism.md). The CPU always
    # repeats.
    deterministic: bool = False
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)

    def __init__(self, model: str | ModelConfig = "tiny", *, model_overrides: Mapping[str, Any] | None = None,
                 steps: int = 50, seed: int = 0, eval_every: int = 25, eval_batches: int = 4, log_every: int = 1,
                 progress: bool = True, deterministic: bool = False, optimizer: OptimizerConfig | None = None,
                 data: DataConfig | None = None, parallel: ParallelConfig | None = None,
                 checkpoint: CheckpointConfig | None = None, **flat: Any):
        overrides = {} if model_overrides is None else model_overrides
        require(isinstance(overrides, Mapping), "model_overrides",
                f"must be a mapping, got {type(overrides).__name__}")
        flat, overrides = _fold_older_names(flat, overrides)
        if "moe_path" in overrides:  # "auto" recorded as the path it names on this device, as ModelConfig holds it
            overrides = {**overrides, "moe_path": resolve_moe_path(overrides["moe_path"])}
        given = {"optimizer": optimizer, "data": data, "parallel": parallel, "checkpoint": checkpoint}
        per_group: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
        for name, value in flat.items():
            if name not in FLAT_FIELDS:
                raise TypeError(f"TrainConfig got an unknown field {name!r}; known fields: {sorted(FIELD_NAMES)}")
            group, attr = FLAT_FIELDS[name]
            if given[group] is not None:
                raise ValueError(f"TrainConfig.{name}: given both flat and in {group}=...; set it in one place")
            per_group[group][attr] = value
        for group, cls in GROUPS.items():
            sub = given[group] if given[group] is not None else cls(**per_group[group])
            require(isinstance(sub, cls), group, f"must be a {cls.__name__}, got {type(sub).__name__}")
            object.__setattr__(self, group, sub)
        for name, value in (("model", model), ("model_overrides", overrides), ("steps", steps), ("seed", seed),
                            ("eval_every", eval_every), ("eval_batches", eval_batches), ("log_every", log_every),
                            ("progress", progress), ("deterministic", deterministic)):
            object.__setattr__(self, name, value)
        _validate(self)

    def __getattr__(self, name: str) -> Any:
        """Flat reads (`cfg.learning_rate`): the sub-config's attribute, or where a recipe field (`learning_rate`,
        `warmup_steps`) is None, the value the run uses (`recipe_values`). Only called for names not found."""
        if name in _RECIPE_FIELDS:
            value = getattr(object.__getattribute__(self, "optimizer"), name)
            return self.recipe_values()[name] if value is None else value
        if name in FLAT_FIELDS:
            group, attr = FLAT_FIELDS[name]
            return getattr(object.__getattribute__(self, group), attr)
        if name in _MOMENT_NAMES:
            return object.__getattribute__(self, "optimizer").moments_dtype
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def model_config(self) -> ModelConfig:
        """The resolved, validated ModelConfig (preset or given config, then overrides)."""
        overrides = dict(self.model_overrides)
        if isinstance(self.model, ModelConfig):
            return self.model.replace(**overrides) if overrides else self.model
        return get_config(self.model, **overrides)

    @property
    def seq_len(self) -> int:
        """Tokens per sequence: the model's max_seq_len."""
        return self.model_config().max_seq_len

    resolved_seq_len = seq_len

    @property
    def schedule_steps(self) -> int:
        return self.lr_schedule_steps if self.lr_schedule_steps is not None else self.steps

    def replace(self, **changes) -> "TrainConfig":
        """This config with `changes`, flat names (and sub-configs, and the older spellings) as the constructor takes
        them. New `model_overrides` keep the sequence length (`seq_len`, the model's max_seq_len) unless they name
        one."""
        values: dict[str, Any] = {name: getattr(self, name) for name in _TOP_FIELDS}
        for group, names in FLAT_NAMES.items():  # flat, but for a sub-config replaced whole
            if group not in changes:
                values.update({flat: getattr(getattr(self, group), attr) for attr, flat in names.items()})
        if any(name in changes for name in _MOMENT_NAMES):
            values.pop("moments_dtype", None)
        lengths = {k: v for k, v in self.model_overrides.items() if MAXTEXT_ALIASES.get(k, k) == "max_seq_len"}
        if "seq_len" in changes and "model_overrides" not in changes:  # the new length replaces the old one
            values["model_overrides"] = {k: v for k, v in self.model_overrides.items() if k not in lengths}
        elif "seq_len" not in changes and isinstance(changes.get("model_overrides"), Mapping) and not any(
                MAXTEXT_ALIASES.get(k, k) == "max_seq_len" for k in changes["model_overrides"]):
            changes["model_overrides"] = {**changes["model_overrides"], **lengths}
        return TrainConfig(**{**values, **changes})

    def resolved(self, platform: str | None = None) -> "TrainConfig":
        """This config with every "auto" replaced by what it means on `platform` (default: JAX's backend), and the
        learning rate and warm-up left None by the preset's recipe: what a run executes and records."""
        on_gpu = (platform or jax.default_backend()) == "gpu"
        cfg = self.model_config()
        changes: dict[str, Any] = {}
        if self.master_weights == "auto":
            split = on_gpu and cfg.dtype == "bfloat16" and cfg.param_dtype == "float32"
            changes["master_weights"] = "split" if split else "float32"
        if self.moments_dtype == "auto":
            changes["moments_dtype"] = "bfloat16" if on_gpu else None
        changes.update({name: value for name, value in self.recipe_values().items()
                        if getattr(self.optimizer, name) is None})
        return self.replace(**changes) if changes else self

    def recipe_values(self) -> dict[str, Any]:
        """What `learning_rate` and `warmup_steps` are where left None: the model preset's optimizer recipe
        (turbo_moe/train/recipes.py), its warm-up fitted to this run's schedule."""
        recipe = optimizer_recipe(self.model)
        schedule = self.lr_schedule_steps if self.lr_schedule_steps is not None else self.steps
        return {"learning_rate": recipe.learning_rate, "warmup_steps": recipe.warmup_for(schedule)}

    def to_dict(self) -> dict[str, Any]:
        """Flat, as the records hold it: the run-level fields, then each sub-config's under their flat names."""
        out = {name: getattr(self, name) for name in _TOP_FIELDS}
        out["model_overrides"] = dict(self.model_overrides)
        if isinstance(self.model, ModelConfig):
            out["model"] = self.model.to_dict()
        out.update({name: getattr(getattr(self, group), attr) for name, (group, attr) in FLAT_FIELDS.items()})
        return out

    @classmethod
    def from_record(cls, values: Mapping[str, Any]) -> "TrainConfig":
        """An older run's recorded config, for reading history: fields since removed (this class's and the model's,
        in `model` and `model_overrides`) are dropped whatever their value, since that run already ran with them, the
        router fields a recipe replaced are read as `record_router_fields` reads them, and the two moment dtypes of an
        older record are dropped unless they were alike. Configs to run go through `from_dict`."""

        def model_fields(fields: Mapping[str, Any], base: str = "deepseek_v3") -> dict[str, Any]:
            kept = {k: v for k, v in fields.items() if MAXTEXT_ALIASES.get(k, k) not in MODEL_REMOVED_FIELDS}
            return record_router_fields(kept, base)

        kept = {k: v for k, v in values.items() if k not in REMOVED_FIELDS}
        if "adam_mu_dtype" in kept:  # before nu had a field, it was stored in the parameters' dtype (None)
            kept.setdefault("adam_nu_dtype", None)
            if kept["adam_mu_dtype"] != kept["adam_nu_dtype"]:  # two dtypes: not one field's value
                kept = {k: v for k, v in kept.items() if k not in _MOMENT_NAMES}
        preset = kept.get("model", "tiny")
        if isinstance(kept.get("model_overrides"), Mapping):
            base = get_config(preset).router_recipe if preset in PRESET_NAMES else "deepseek_v3"
            kept["model_overrides"] = model_fields(kept["model_overrides"], base)
        if isinstance(kept.get("model"), Mapping):
            kept["model"] = model_fields(kept["model"])
        return cls.from_dict(kept)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "TrainConfig":
        """Inverse of `to_dict`: flat names (and the older spellings in FIELD_NAMES), or sections per sub-config
        (`optimizer: {learning_rate: ...}`); `model` may be a preset name or a ModelConfig dict. Unknown keys raise."""
        if not isinstance(values, Mapping):
            raise TypeError(f"TrainConfig.from_dict expects a mapping, got {type(values).__name__}")
        kwargs = dict(values)
        for name in sorted(set(kwargs) & set(REMOVED_FIELDS)):
            kept, why = REMOVED_FIELDS[name]
            value = kwargs.pop(name)
            if value != kept and not _names_what_runs(name, value, kwargs):
                raise ValueError(f"TrainConfig field {name!r} was removed ({why}); got {value!r}: drop it from the "
                                 f"config")
        for group in GROUPS:
            section = kwargs.pop(group, None)
            if section is None:
                continue
            if isinstance(section, GROUPS[group]):
                section = {FLAT_NAMES[group][f.name]: getattr(section, f.name) for f in dataclasses.fields(section)}
            if not isinstance(section, Mapping):
                raise ValueError(f"TrainConfig.{group}: expected a mapping of its fields, got {section!r}")
            for key, value in section.items():
                name = FLAT_NAMES[group].get(key, key)
                if FLAT_FIELDS.get(name, ("",))[0] != group:
                    raise ValueError(f"unknown TrainConfig.{group} field {key!r}; known: {sorted(FLAT_NAMES[group])}")
                if name in kwargs:
                    raise ValueError(f"TrainConfig.{name}: given both flat and in the {group} section; set it in "
                                     f"one place")
                kwargs[name] = value
        if "remat_policy" in kwargs:  # MaxText's top-level key: the model's field (over one in model_overrides)
            policy = kwargs.pop("remat_policy")
            if policy is not None:
                kwargs["model_overrides"] = {**dict(kwargs.get("model_overrides") or {}), "remat_policy": policy}
        unknown = sorted(set(kwargs) - set(FIELD_NAMES))
        if unknown:
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; known fields: {sorted(FIELD_NAMES)}")
        if isinstance(kwargs.get("model"), Mapping):
            kwargs["model"] = ModelConfig.from_dict(kwargs["model"])
        return cls(**kwargs)


def _fold_older_names(flat: Mapping[str, Any], overrides: Mapping[str, Any]) -> tuple[dict, Mapping[str, Any]]:
    """The flat fields and model overrides with the older spellings moved where they live now: `adam_mu_dtype` /
    `adam_nu_dtype` -> `moments_dtype` (they must agree), `seq_len` -> the model's `max_seq_len`."""
    flat = dict(flat)
    moments = {name: flat.pop(name) for name in _MOMENT_NAMES if name in flat}
    if "moments_dtype" in flat:
        moments["moments_dtype"] = flat["moments_dtype"]
    if len({repr(v) for v in moments.values()}) > 1:
        raise ValueError(f"TrainConfig.moments_dtype: the two AdamW moments are stored in one dtype now, got "
                         f"{moments}; set moments_dtype")
    if moments:
        flat["moments_dtype"] = next(iter(moments.values()))
    seq_len = flat.pop("seq_len", None)
    if seq_len is None:
        return flat, overrides
    require_int(seq_len, "seq_len", 1)
    for key, value in overrides.items():
        require(MAXTEXT_ALIASES.get(key, key) != "max_seq_len" or value == seq_len, "seq_len",
                f"{seq_len!r} here and {key}={value!r} in model_overrides: set it in one place")
    overrides = {**{k: v for k, v in overrides.items() if MAXTEXT_ALIASES.get(k, k) != "max_seq_len"},
                 "max_seq_len": seq_len}
    return flat, overrides


def _names_what_runs(name: str, value: Any, values: Mapping[str, Any]) -> bool:
    """A removed field's old value other than the kept one that still names what runs (an older resolved record)."""
    if name == "adam_nu_rounding":
        nu = values.get("adam_nu_dtype", values.get("moments_dtype", "auto"))
        return value in _NU_ROUNDINGS_KEPT or (value == "nearest" and nu in (None, "float32"))
    return False


def _validate(c: TrainConfig) -> None:
    for name in ("steps", "log_every"):
        require_int(getattr(c, name), name, 1)
    for name in ("eval_every", "eval_batches", "seed"):
        require_int(getattr(c, name), name, 0)
    require(c.seed < 2**63, "seed", f"must be below 2**63 (jax.random.key takes a 64-bit int), got {c.seed!r}")
    require(isinstance(c.progress, bool), "progress", f"must be a bool, got {c.progress!r}")
    require(isinstance(c.deterministic, bool), "deterministic", f"must be a bool, got {c.deterministic!r}")
    require(c.lr_schedule_steps is None or c.lr_schedule_steps >= c.steps, "lr_schedule_steps",
            f"must be None or an int >= steps={c.steps}, got {c.lr_schedule_steps!r}")
    require(c.warmup_steps <= c.schedule_steps, "warmup_steps",
            f"{c.warmup_steps} > the schedule's {c.schedule_steps} steps")
    require(isinstance(c.model, (str, ModelConfig)), "model",
            f"must be a preset name or a ModelConfig, got {type(c.model).__name__}")
    model_cfg = c.model_config()  # raises ValueError naming the ModelConfig field
    require(model_cfg.n_experts % c.expert_parallel == 0, "expert_parallel",
            f"{c.expert_parallel} does not divide the model's n_experts={model_cfg.n_experts}")
    require(c.master_weights != "split" or (model_cfg.dtype == "bfloat16" and model_cfg.param_dtype == "float32"),
            "master_weights", f"'split' keeps float32 master weights as their bfloat16 compute copy + 16 low bits: it "
            f"needs the model's dtype 'bfloat16' and param_dtype 'float32', got {model_cfg.dtype!r} and "
            f"{model_cfg.param_dtype!r}")
