"""TrainConfig's sub-configs, one frozen dataclass per concern: the optimizer, the data, the mesh, the checkpoints.

Each validates its own fields (`turbo_moe.validation.ConfigError`, a ValueError, naming the field as
`TrainConfig.<flat name>`, the name a user writes).
`FLAT_FIELDS` maps each flat name (MaxText's configs are one flat namespace, and so are our records) to its
sub-config and attribute: `TrainConfig` reads, builds and records them flat.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from turbo_moe.validation import Checks, is_int

MOMENTS_DTYPES = ("auto", None, "bfloat16", "float32")  # None: the parameters' dtype
MASTER_WEIGHTS = ("auto", "float32", "split")  # turbo_moe/train/split_master.py
OPTIMIZER_STATE_MEMORIES = ("device", "host")  # turbo_moe/train/offload.py


CHECK = Checks("TrainConfig")


def require(condition: bool, field: str, message: str, value: Any = None) -> None:
    """CHECK.require for checks written as one message (TrainConfig's own): `message` says what went wrong."""
    CHECK.require(condition, field, value, message, detail=message)


def require_int(value: Any, field: str, minimum: int) -> None:
    CHECK.integer(field, value, minimum)


def _path_or_none(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value  # stored as str: the config stays JSON-serialisable


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (DeepSeek-V3's recipe) and its schedule: a linear warm-up over `warmup_steps`, then a cosine decay to
    `min_lr_ratio * learning_rate` at `lr_schedule_steps` (None: the run's `steps`; set it when a run is split into
    several invocations). `learning_rate` / `warmup_steps` None: the model preset's recipe (turbo_moe/train/recipes.py;
    DeepSeek-V3's 2.2e-4 for deepseek_v3_671b), which `TrainConfig` reads flat and `resolved()` writes in."""

    learning_rate: float | None = None
    warmup_steps: int | None = None
    lr_schedule_steps: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    adam_b1: float = 0.9
    adam_b2: float = 0.95
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    # The storage dtype of both AdamW moments (a quality/speed choice: the update is memory-bound). "bfloat16" is
    # DeepSeek-V3's recipe: mu through optax's mu_dtype, nu through turbo_moe.train.low_precision_adam, which rounds
    # it stochastically (DeepSeek-V3's round-to-nearest cost +0.074 nats at 300 steps, docs/configuration.md). None:
    # the parameters' dtype. "auto": bfloat16 on GPUs, None on the CPU.
    moments_dtype: str | None = "auto"
    # How the stacked layers' float32 master weights are kept (turbo_moe.train.split_master): "float32", or "split":
    # as their bf16 compute copy (what the forward reads; rounded half up, not to nearest-even, at exact ties) + the
    # 16 low bits, exact together: the update reads and writes 4 bytes a weight and the forward reads the bf16 copy.
    # Needs the model's dtype bfloat16 and param_dtype float32. "auto": "split" on GPUs where it applies, else
    # "float32". Checkpoints hold the layout they were written in: resume with the same (resolved) setting.
    master_weights: str = "auto"
    # Where the state only the update reads (the AdamW moments; with "split", the master weights' low 16 bits) lives
    # between steps: "device", or "host" (the devices' pinned host memory, brought over for the update inside the
    # step, turbo_moe.train.offload): device memory against the step's host transfers. Checkpoints are alike.
    optimizer_state_memory: str = "device"

    def __post_init__(self):
        if self.learning_rate is not None:
            CHECK.number("learning_rate", self.learning_rate, "a positive finite number or None", lambda v: v > 0)
        if self.warmup_steps is not None:
            CHECK.integer("warmup_steps", self.warmup_steps, 0)
        CHECK.require(self.lr_schedule_steps is None or (is_int(self.lr_schedule_steps) and self.lr_schedule_steps > 0),
                      "lr_schedule_steps", self.lr_schedule_steps, "None or a positive int")
        for name in ("weight_decay", "grad_clip"):
            CHECK.number(name, getattr(self, name), "a finite number >= 0", lambda v: v >= 0)
        for name in ("min_lr_ratio", "adam_b1", "adam_b2"):
            CHECK.number(name, getattr(self, name), "in [0, 1]", lambda v: 0 <= v <= 1)
        CHECK.choice("moments_dtype", self.moments_dtype, MOMENTS_DTYPES)
        CHECK.choice("master_weights", self.master_weights, MASTER_WEIGHTS)
        CHECK.choice("optimizer_state_memory", self.optimizer_state_memory, OPTIMIZER_STATE_MEMORIES)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The corpus, its held-out share and the batch. The sequence length is the model's `max_seq_len`."""

    dataset: str = "shakespeare"  # "shakespeare" | "synthetic" | a path (txt/jsonl/json.gz/parquet)
    text_field: str = "text"  # the JSON/Parquet column holding the text
    val_fraction: float = 0.05
    per_device_batch: int = 8
    data_dir: str | None = None  # None: $TURBO_MOE_DATA_DIR or ~/.cache/turbo_moe
    # None: a byte-level BPE trained on the corpus at the model's vocab_size; else a tokenizer.json path or a Hugging
    # Face Hub name (turbo_moe/data/dataset.py), whose vocabulary must fit the model's vocab_size. Text datasets only.
    tokenizer: str | None = None

    def __post_init__(self):
        for name in ("dataset", "data_dir", "tokenizer"):
            object.__setattr__(self, name, _path_or_none(getattr(self, name)))
        CHECK.require(isinstance(self.dataset, str) and self.dataset != "", "dataset", self.dataset,
                      "'shakespeare', 'synthetic' or a path")
        CHECK.require(isinstance(self.text_field, str) and self.text_field != "", "text_field", self.text_field,
                      "a non-empty str")
        CHECK.number("val_fraction", self.val_fraction, "in (0, 1)", lambda v: 0 < v < 1)
        CHECK.integer("per_device_batch", self.per_device_batch, 1)
        CHECK.require(self.data_dir is None or (isinstance(self.data_dir, str) and self.data_dir != ""), "data_dir",
                      self.data_dir, "None or a non-empty path")
        require(self.tokenizer is None or (isinstance(self.tokenizer, str) and self.tokenizer != ""), "tokenizer",
                f"must be None, a tokenizer.json path or a Hugging Face Hub name, got {self.tokenizer!r}")
        require(self.tokenizer is None or (self.dataset != "synthetic" and Path(self.dataset).suffix not in
                                           (".npy", ".bin")), "tokenizer",
                f"must be None for dataset {self.dataset!r}: synthetic tokens and token-id files (.npy/.bin) are "
                f"tokenised already, got {self.tokenizer!r}")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The mesh: (devices / expert_parallel, expert_parallel) over ("data", "expert")."""

    expert_parallel: int = 1  # routed experts split over this many devices
    # ZeRO-3 / FSDP: shard every training state over the devices (turbo_moe.model.sharding); False replicates the
    # non-expert states over all devices and the expert states over "data".
    fsdp: bool = True

    def __post_init__(self):
        CHECK.integer("expert_parallel", self.expert_parallel, 1)
        CHECK.boolean("fsdp", self.fsdp)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints and the run record in `dir` (needed to resume): disk against what a crash loses."""

    dir: str | None = None
    every: int = 0  # steps between saves; 0: only at the end (when `dir` is set)
    keep: int = 2
    resume: bool = False
    # Resume even where the learning-rate schedule differs from the checkpoint's run (its fields, or `steps` as the
    # schedule's length): the LR of the steps to come changes. Refused otherwise (checkpoint.check_resume_config).
    allow_schedule_change: bool = False

    def __post_init__(self):
        object.__setattr__(self, "dir", _path_or_none(self.dir))
        CHECK.require(self.dir is None or (isinstance(self.dir, str) and self.dir != ""), "checkpoint_dir", self.dir,
                      "None or a non-empty path")
        CHECK.integer("checkpoint_every", self.every, 0)
        CHECK.integer("keep_checkpoints", self.keep, 1)
        CHECK.boolean("resume", self.resume)
        CHECK.boolean("allow_schedule_change", self.allow_schedule_change)
        CHECK.require(not self.resume or self.dir is not None, "resume", self.resume, "False without a checkpoint_dir",
                      "resume=True needs a checkpoint_dir")


GROUPS: dict[str, type] = {"optimizer": OptimizerConfig, "data": DataConfig, "parallel": ParallelConfig,
                           "checkpoint": CheckpointConfig}
# Flat name (records, YAML, --set, keyword arguments, attribute reads) -> (sub-config, its attribute).
FLAT_FIELDS: dict[str, tuple[str, str]] = {
    **{f.name: (group, f.name) for group in ("optimizer", "data", "parallel")
       for f in dataclasses.fields(GROUPS[group])},
    "checkpoint_dir": ("checkpoint", "dir"), "checkpoint_every": ("checkpoint", "every"),
    "keep_checkpoints": ("checkpoint", "keep"), "resume": ("checkpoint", "resume"),
    "allow_schedule_change": ("checkpoint", "allow_schedule_change"),
}
# Sub-config attribute -> flat name, per sub-config (a YAML section `checkpoint: {dir: ...}` names attributes).
FLAT_NAMES: dict[str, dict[str, str]] = {group: {attr: flat for flat, (g, attr) in FLAT_FIELDS.items() if g == group}
                                         for group in GROUPS}
