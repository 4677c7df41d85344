"""ModelConfig: one frozen dataclass for the DeepSeek-V3-style decoder, its presets and validation.

Every module receives the whole config; each behavioural difference is an explicit field read in one
place. Presets: `tiny` (CPU tests), `small` (CPU default run), `reduced` (one 80 GB GPU),
`deepseek_v3_671b` (the public architecture).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import yaml

from turbo_moe import ops
from turbo_moe.model.router_recipes import RECIPE_FIELDS, ROUTER_RECIPE_NAMES, ROUTER_RECIPES, RouterRecipe
from turbo_moe.model.router_recipes import recipe_named_by
from turbo_moe.validation import Checks

CHECK = Checks("ModelConfig")

MOE_PATHS = ("dense_cf", "ragged", "turbo", "pallas", "turbo_fp8")  # each has its rows in turbo_moe.model.paths.PATHS
AUTO_PATH = "auto"  # a moe_path's name for the fastest dropless path of the device (`resolve_moe_path`)
FP8_BLOCK = 128  # turbo_fp8: its GEMMs scale FP8 in 128-wide tiles, so d_model and moe_ffn_dim are multiples
EP_EXCHANGES = ("deepep", "ragged_all_to_all")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
PARAM_DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "dots_experts_attention")
EP_LAYOUTS = ("auto", "dense", "packed", "ragged")  # turbo_moe.ops.moe_dispatch's layouts
LOGITS_DTYPES = ("float32", "bfloat16")
# Fields that measured A/Bs decided and removed: name -> (the behaviour kept, why). `from_dict` accepts a removed
# field set to the kept behaviour (old records and specs), and refuses any other value with the reason.
REMOVED_FIELDS: dict[str, tuple[Any, str]] = {
    "block_micro_batches": (1, "two micro-batches a MoE block (attention included) ran slower than one batch on two "
                               "H200s: they hid ~2.5 ms of the exchange and cost ~16 ms of kernels (docs/expert-parallel.md)"),
    "ep_micro_batches": (1, "two micro-batches per MoE layer ran slower than one on two H200s: XLA overlapped the "
                            "exchange, but the half-size kernels cost more than it hid (docs/expert-parallel.md)"),
    "cast_params_before_scan": (True, "the stacked weights are always cast to the compute dtype before the layer scan"),
    "router_topk_impl": ("auto", "the router_topk kernel picks the experts on GPUs, jnp elsewhere (the same picks)"),
    "embedding_grad": ("segment", "the embedding's backward is always turbo_moe.ops.segment_sum"),
    "expert_backward": ("block", "the permute exchange's experts always run as one expert block"),
    "swiglu_impl": ("auto", "the SwiGLU kernels run on GPUs, XLA's fusions elsewhere"),
    "router_center_ema": (0.0, "router centering by a running mean lost to causal centering (router_recipe "
                               "'short_run')"),
    "router_bias_rate_start": (0.0, "the bias update rate is router_bias_rate throughout"),
    "router_bias_rate_decay_steps": (0, "the bias update rate is router_bias_rate throughout"),
    "embedding_init_std": (None, "the token embeddings are initialised with std d_model ** -0.5 (MaxText's fan-in)"),
    "router_init_std": (None, "the gate kernel is initialised with init_std, as every projection; a fan-in gate lost"),
    "scan_layers": (True, "each stack of blocks runs as one jax.lax.scan; the unrolled stack was slower to run and "
                          "to compile"),
    "rms_norm_eps": (1e-6, "every RMSNorm uses DeepSeek-V3's epsilon 1e-6"),
    "rope_theta": (10000.0, "RoPE uses DeepSeek-V3's base 10000 (every preset's)"),
    "attention_impl": ("auto", "attention runs cuDNN (v at its own width where this JAX allows it) on GPUs, XLA "
                               "elsewhere; the other choices lost and stay reachable through layers.causal_attention"),
    "tie_embeddings": (False, "the output head is its own matrix, as in DeepSeek-V3; no preset tied it"),
}

RMS_NORM_EPS = 1e-6  # DeepSeek-V3's (config.json rms_norm_eps); MaxText's normalization_layer_epsilon
ROPE_THETA = 10000.0  # DeepSeek-V3's (config.json rope_theta)

# The sequence load penalty's chunk loop is unrolled (router.seq_load_penalized_selection): compile time grows with it.
MAX_SEQ_LOAD_CHUNKS = 64

# MaxText spellings accepted by `from_dict` (left) for our field names (right).
MAXTEXT_ALIASES = {
    "emb_dim": "d_model",
    "base_emb_dim": "d_model",
    "base_num_decoder_layers": "n_layers",
    "num_decoder_layers": "n_layers",
    "first_num_dense_layers": "n_dense_layers",
    "mlp_dim": "dense_ffn_dim",
    "base_mlp_dim": "dense_ffn_dim",
    "moe_mlp_dim": "moe_ffn_dim",
    "base_moe_mlp_dim": "moe_ffn_dim",
    "num_experts": "n_experts",
    "shared_experts": "n_shared_experts",
    "num_experts_per_tok": "top_k",
    "n_routing_groups": "n_groups",
    "topk_routing_group": "topk_groups",
    "base_num_query_heads": "n_heads",
    "num_query_heads": "n_heads",
    "max_target_length": "max_seq_len",
    "mtp_num_layers": "mtp_depth",
    "mtp_loss_scaling_factor": "mtp_loss_weight",
    "routed_bias_update_rate": "router_bias_rate",
    "weight_dtype": "param_dtype",
    "normalization_layer_epsilon": "rms_norm_eps",
    "logits_via_embedding": "tie_embeddings",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture + MoE-path settings. Validated on construction (`turbo_moe.validation.ConfigError`, a ValueError
    naming the field, its value and what it allows)."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 3
    n_dense_layers: int = 1
    dense_ffn_dim: int = 128
    moe_ffn_dim: int = 32
    n_experts: int = 8
    n_shared_experts: int = 1
    top_k: int = 2
    n_groups: int = 4
    topk_groups: int = 2
    routed_scaling_factor: float = 1.0
    n_heads: int = 4
    q_lora_rank: int = 32  # 0: plain query projection (no low-rank compression)
    kv_lora_rank: int = 16
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    max_seq_len: int = 64
    mtp_depth: int = 1
    mtp_loss_weight: float = 0.3
    # > 0: the main and MTP cross-entropies run the head over chunks of ~this many tokens of the batch
    # (`chunked_loss`): no float32 (tokens, vocab) logits or their gradient for the whole batch. 0: unchunked.
    loss_chunk_tokens: int = 0
    # The output heads' logits as the head GEMM writes them: "float32" (float32 accumulators kept) or "bfloat16"
    # (rounded to bf16 by the GEMM, upcast by the loss: MaxText's default, logits_dot_in_fp32=False with
    # cast_logits_to_fp32; half the bytes the loss's passes read, the loss math stays float32). A quality/speed
    # choice: the GPU presets take bfloat16 (docs/performance.md).
    logits_dtype: str = "float32"
    router_bias_rate: float = 1e-3
    moe_path: str = "turbo"  # one of MOE_PATHS, or "auto": resolved on construction (`resolve_moe_path`)
    # dense_cf: slots per expert (cf x its fair share); <= 0 computes every expert densely.
    capacity_factor: float = 1.25
    # A dropless path (turbo, ragged, pallas) drops exactly the copies dense_cf at capacity_factor drops, at its own
    # speed (model/capacity.py): the drop penalty measured without dense_cf's cost. False: dropless.
    drop_tokens: bool = False
    # Expert parallelism (used when the ambient mesh has an "expert" axis of size > 1):
    ep_exchange: str = "deepep"  # turbo's exchange: "deepep" (moe_dispatch/combine) | "ragged_all_to_all"
    # deepep slots per source rank as a fraction of its tokens; 0 (or 1) = every token (never drops),
    # in (0, 1) caps the buffers and counts the overflowing copies in dropped_fraction.
    ep_capacity_factor: float = 0.0
    # deepep's dispatch layout (turbo_moe.ops.moe_dispatch): "auto" (dense worst-case buffers up to 4 ranks, the
    # real rows only beyond), or one of "dense" | "packed" | "ragged" to trade memory against speed.
    ep_layout: str = "auto"
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    # What a block keeps for its backward pass (the rest is recomputed): "none" everything, "full" its input,
    # "dots" / "dots_no_batch" JAX's matmul policies, "dots_experts_attention" = "dots_no_batch" + the routed
    # experts' GEMM inputs/outputs and cuDNN attention's outputs (custom kernels the dot policies recompute).
    remat_policy: str = "none"
    init_std: float = 0.02  # std of every projection's normal init, the router's gate included (DeepSeek/Megatron)
    # The router's recipe (turbo_moe/model/router_recipes.py; the model reads its values as `router`):
    # "deepseek_v3" (DeepSeek-V3's own) or "short_run" (balanced routing for short, high-lr runs; `reduced`).
    router_recipe: str = "deepseek_v3"

    def __post_init__(self):
        # "auto" becomes the path it names here, so that the config (and every record of it) says what ran
        object.__setattr__(self, "moe_path", resolve_moe_path(self.moe_path))
        _validate(self)

    # ----- derived sizes -----
    @property
    def rms_norm_eps(self) -> float:
        return RMS_NORM_EPS

    @property
    def rope_theta(self) -> float:
        return ROPE_THETA

    @property
    def balance_loss_weight(self) -> float:
        """The auxiliary balance loss's weight: the router recipe's."""
        return self.router.balance_loss_weight

    @property
    def embedding_std(self) -> float:
        """Token-embedding init std, d_model ** -0.5 (MaxText's fan-in default), not init_std: with embeddings as
        small as DeepSeek's 0.006 the (near-uniform) attention output dominates the residual stream at init, the
        tokens of a sequence look alike and the router collapses onto a few experts."""
        return self.d_model ** -0.5

    @property
    def router_std(self) -> float:
        return self.init_std

    @property
    def router(self) -> RouterRecipe:
        """The values of `router_recipe`: what the router, the model's init and the bias update read."""
        return ROUTER_RECIPES[self.router_recipe]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        """MoE layers in the main stack (MTP blocks not included)."""
        return self.n_layers - self.n_dense_layers

    def is_moe_layer(self, layer_index: int) -> bool:
        """Layer `layer_index` (MTP blocks continue the numbering after n_layers) is MoE."""
        return layer_index >= self.n_dense_layers

    @property
    def n_router_layers(self) -> int:
        """Rows of `MoEStats.expert_load`: main MoE layers then MoE MTP blocks."""
        mtp_moe = sum(self.is_moe_layer(self.n_layers + d) for d in range(self.mtp_depth))
        return self.n_moe_layers + mtp_moe

    # ----- construction helpers -----
    def replace(self, **overrides) -> "ModelConfig":
        return ModelConfig.from_dict({**self.to_dict(), **_canonical_names(overrides)})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """Build from a dict; accepts MaxText aliases (emb_dim, num_experts, ...); unknown keys raise."""
        if not isinstance(values, Mapping):
            raise TypeError(f"ModelConfig.from_dict expects a mapping, got {type(values).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        old_router_fields: dict[str, Any] = {}
        for key, value in values.items():
            name = MAXTEXT_ALIASES.get(key, key)
            if name in REMOVED_FIELDS:
                _check_removed(name, value)
                continue
            if name in RECIPE_FIELDS:  # replaced by router_recipe: a recipe's values name that recipe
                old_router_fields[name] = _coerce(name, value, RECIPE_FIELDS[name][1])
                continue
            if name not in known:
                CHECK.fail(key, value, f"one of the fields {sorted(known)}",
                           f"unknown ModelConfig field {key!r}; known fields: {sorted(known)}")
            if name in kwargs:
                _given_twice(name, key, value)
            kwargs[name] = _coerce(name, value, known[name].type)
        if old_router_fields:
            base = kwargs.get("router_recipe", known["router_recipe"].default)
            _check_recipe(base)
            kwargs["router_recipe"] = recipe_named_by(base, old_router_fields)
        return cls(**kwargs)

    @classmethod
    def from_record(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """An older run's recorded config, for reading history: fields since removed (REMOVED_FIELDS) are dropped
        whatever their value, since that run already ran with them, and the router fields a recipe replaced are
        read as in `record_router_fields`. Configs to run go through `from_dict`."""
        kept = {k: v for k, v in values.items() if MAXTEXT_ALIASES.get(k, k) not in REMOVED_FIELDS}
        return cls.from_dict(record_router_fields(kept))

    @classmethod
    def from_yaml(cls, path_or_text: str) -> "ModelConfig":
        """From a YAML file path or YAML text. A top-level `preset:` key starts from that preset."""
        text = path_or_text
        if os.path.exists(path_or_text):
            with open(path_or_text) as f:
                text = f.read()
        values = yaml.safe_load(text) or {}
        if not isinstance(values, dict):
            raise ValueError(f"YAML model config must be a mapping, got {type(values).__name__}")
        preset = values.pop("preset", None)
        return get_config(preset, **values) if preset else cls.from_dict(values)


def record_router_fields(values: Mapping[str, Any], base: str = "deepseek_v3") -> dict[str, Any]:
    """An older record's model fields with the router fields that router_recipe replaced read as the recipe they
    equal (on top of the record's router_recipe, else `base`: a preset's), or dropped where no recipe has their
    values: the routing studies ran such combinations, and their records keep the fields that say so."""
    old = {k: v for k, v in values.items() if k in RECIPE_FIELDS}
    kept = {k: v for k, v in values.items() if k not in RECIPE_FIELDS}
    base = kept.get("router_recipe", base)
    if old and base in ROUTER_RECIPES:
        try:
            kept["router_recipe"] = recipe_named_by(
                base, {k: _coerce(k, v, RECIPE_FIELDS[k][1]) for k, v in old.items()})
        except (TypeError, ValueError):
            pass
    return kept


def _canonical_names(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Rename MaxText aliases so overrides replace (not duplicate) the field they name."""
    renamed: dict[str, Any] = {}
    for key, value in overrides.items():
        name = MAXTEXT_ALIASES.get(key, key)
        if name in renamed:
            _given_twice(name, key, value)
        renamed[name] = value
    return renamed


def _check_recipe(name: str) -> None:
    """ROUTER_RECIPES, not its public names: a test may register a recipe of its own."""
    CHECK.require(name in ROUTER_RECIPES, "router_recipe", name, f"one of {ROUTER_RECIPE_NAMES}",
                  f"got {name!r}; expected one of {ROUTER_RECIPE_NAMES}")


def _given_twice(name: str, key: str, value: Any) -> None:
    CHECK.fail(name, value, "given once", f"ModelConfig field {name!r} given twice (as {key!r} and an alias)")


def _check_removed(name: str, value: Any) -> None:
    kept, why = REMOVED_FIELDS[name]
    if isinstance(kept, float) and isinstance(value, str):  # YAML reads 1e-6 (no dot) as a str
        try:
            value = float(value)
        except ValueError:
            pass
    auto_spellings = ("kernel", "xla", "cudnn_unpadded")  # what "auto" ran as on some device
    same = value == kept or (isinstance(kept, str) and value in auto_spellings and kept == "auto")
    if not same or isinstance(value, bool) != isinstance(kept, bool):
        CHECK.fail(name, value, f"left out (removed: {why})",
                   f"ModelConfig field {name!r} was removed ({why}); got {value!r}: drop it from the config")


def _coerce(name: str, value: Any, type_name: Any) -> Any:
    """Coerce YAML/CLI values (e.g. '1e-3', 2.0 for an int) to the field's type, or raise naming the field."""
    type_name = type_name if isinstance(type_name, str) else type_name.__name__
    try:
        if type_name == "int":
            if isinstance(value, bool) or float(value) != int(float(value)):
                raise ValueError
            return int(float(value))
        if type_name == "float":
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if type_name == "bool":
            if isinstance(value, str) and value.lower() in ("true", "false"):
                return value.lower() == "true"
            if not isinstance(value, bool):
                raise ValueError
            return value
        if type_name == "str":
            if not isinstance(value, str):
                raise ValueError
            return value
    except (TypeError, ValueError):
        CHECK.fail(name, value, f"a {type_name}", f"ModelConfig.{name} expects {type_name}, got {value!r}",
                   wrong_type=True)
    return value


def resolve_moe_path(name: Any) -> Any:
    """`name`, with "auto" replaced by the fastest dropless path of this device: ``turbo`` where its kernels are
    loaded (the CPU library is always built; on a GPU, the CUDA library), else ``ragged``. Other names unchanged."""
    if name != AUTO_PATH:
        return name
    return "turbo" if {"cpu": "cpu", "gpu": "CUDA"}.get(jax.default_backend()) in ops.ensure_registered() else "ragged"


def check_moe_path(name: Any) -> None:
    """The one check of a MoE path's name (ModelConfig's field, the path table's direct callers): a ConfigError
    for field "moe_path" naming the paths allowed."""
    allowed = f"one of {MOE_PATHS} or {AUTO_PATH!r}"
    CHECK.require(name in MOE_PATHS, "moe_path", name, allowed, f"unknown MoE path {name!r}; expected {allowed}")


def _validate(c: ModelConfig) -> None:
    for name in ("vocab_size", "d_model", "n_layers", "moe_ffn_dim", "n_experts", "top_k", "n_groups",
                 "topk_groups", "n_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "max_seq_len"):
        CHECK.integer(name, getattr(c, name), 1)
    for name in ("n_dense_layers", "n_shared_experts", "q_lora_rank", "qk_nope_head_dim", "mtp_depth",
                 "dense_ffn_dim", "loss_chunk_tokens"):
        CHECK.integer(name, getattr(c, name), 0)
    CHECK.require(c.n_dense_layers <= c.n_layers, "n_dense_layers", c.n_dense_layers, f"<= n_layers={c.n_layers}",
                  f"{c.n_dense_layers} dense layers > n_layers={c.n_layers}")
    CHECK.require(c.n_dense_layers == 0 or c.dense_ffn_dim > 0, "dense_ffn_dim", c.dense_ffn_dim,
                  f"> 0 when n_dense_layers={c.n_dense_layers}", f"must be > 0 when n_dense_layers={c.n_dense_layers}")
    CHECK.require(c.top_k <= c.n_experts, "top_k", c.top_k, f"<= n_experts={c.n_experts}",
                  f"top_k={c.top_k} > n_experts={c.n_experts}")
    CHECK.require(c.n_experts % c.n_groups == 0, "n_groups", c.n_groups, f"a divisor of n_experts={c.n_experts}",
                  f"n_groups={c.n_groups} does not divide n_experts={c.n_experts}")
    CHECK.require(c.topk_groups <= c.n_groups, "topk_groups", c.topk_groups, f"<= n_groups={c.n_groups}",
                  f"topk_groups={c.topk_groups} > n_groups={c.n_groups}")
    selectable = c.topk_groups * (c.n_experts // c.n_groups)
    CHECK.require(c.top_k <= selectable, "top_k", c.top_k, f"<= the experts in the selected groups ({selectable})",
                  f"top_k={c.top_k} > experts in the {c.topk_groups} selected groups ({selectable})")
    CHECK.require(c.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", c.qk_rope_head_dim, "even (RoPE rotates pairs)")
    check_moe_path(c.moe_path)
    CHECK.choice("dtype", c.dtype, COMPUTE_DTYPES)
    CHECK.require(c.moe_path != "pallas" or c.dtype in ("bfloat16", "float16"), "dtype", c.dtype,
                  "bfloat16 or float16 with moe_path='pallas'",
                  f"moe_path='pallas' (Mosaic-GPU wgmma kernels) computes in bfloat16 or float16, got {c.dtype!r}")
    for name in ("d_model", "moe_ffn_dim"):  # the expert GEMMs' K and N (gate/up: d_model -> 2F, down: F -> d_model)
        value = getattr(c, name)
        CHECK.require(c.moe_path != "turbo_fp8" or value % FP8_BLOCK == 0, name, value,
                      f"a multiple of {FP8_BLOCK} with moe_path='turbo_fp8'",
                      f"moe_path='turbo_fp8' (FP8 grouped GEMMs with {FP8_BLOCK}-wide scale tiles) needs a multiple of "
                      f"{FP8_BLOCK}, got {value}")
    CHECK.choice("param_dtype", c.param_dtype, PARAM_DTYPES)
    CHECK.choice("remat_policy", c.remat_policy, REMAT_POLICIES)
    CHECK.choice("ep_layout", c.ep_layout, EP_LAYOUTS)
    CHECK.choice("logits_dtype", c.logits_dtype, LOGITS_DTYPES)
    _check_recipe(c.router_recipe)
    for name in ("routed_scaling_factor", "init_std"):
        CHECK.number(name, getattr(c, name), "a positive finite number", lambda v: v > 0)
    recipe = c.router
    n_chunks = -(-c.max_seq_len // recipe.seq_load_chunk)
    longest = MAX_SEQ_LOAD_CHUNKS * recipe.seq_load_chunk
    CHECK.require(recipe.seq_load_penalty == 0 or n_chunks <= MAX_SEQ_LOAD_CHUNKS, "max_seq_len", c.max_seq_len,
                  f"<= {longest} with router_recipe {c.router_recipe!r}",
                  f"router_recipe {c.router_recipe!r} runs the sequence load penalty over chunks of "
                  f"{recipe.seq_load_chunk} tokens, each unrolled into the program: {c.max_seq_len} tokens make "
                  f"{n_chunks} chunks, at most {MAX_SEQ_LOAD_CHUNKS} (max_seq_len <= {longest})")
    for name in ("mtp_loss_weight", "router_bias_rate"):
        CHECK.number(name, getattr(c, name), "a finite number >= 0", lambda v: v >= 0)
    CHECK.number("capacity_factor", c.capacity_factor, "a finite number")
    CHECK.require(not c.drop_tokens or (c.moe_path != "dense_cf" and c.capacity_factor > 0), "drop_tokens",
                  c.drop_tokens, "False with moe_path 'dense_cf' or capacity_factor <= 0",
                  f"drops dense_cf's overflow on a dropless path and needs capacity_factor > 0; got moe_path "
                  f"{c.moe_path!r}, capacity_factor {c.capacity_factor!r}")
    CHECK.choice("ep_exchange", c.ep_exchange, EP_EXCHANGES)
    CHECK.number("ep_capacity_factor", c.ep_capacity_factor, "in [0, 1] (0: worst-case buffers)",
                 lambda v: 0 <= v <= 1)


# ---------------------------------------------------------------- presets

_PRESETS: dict[str, dict[str, Any]] = {
    # Seconds on CPU: every feature on (MLA with q LoRA, groups, shared expert, MTP) at toy sizes.
    "tiny": dict(
        vocab_size=256, d_model=64, n_layers=3, n_dense_layers=1, dense_ffn_dim=128, moe_ffn_dim=32,
        n_experts=8, n_shared_experts=1, top_k=2, n_groups=4, topk_groups=2, routed_scaling_factor=1.0,
        n_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_seq_len=64, mtp_depth=1, router_bias_rate=1e-2,
    ),
    # CPU default run: 9.3M parameters (11.5M with MTP), 16 experts top-2 + 1 shared, seq 128, vocab 2048
    # (the data pipeline trains its BPE to vocab_size). Narrow (d_model 128) so that most parameters sit
    # in the experts and a step stays ~18 GFLOP at 8 x 128 tokens. float32 compute: XLA:CPU bf16
    # matmuls are much slower than float32 ones.
    "small": dict(
        vocab_size=2048, d_model=128, n_layers=5, n_dense_layers=1, dense_ffn_dim=384, moe_ffn_dim=320,
        n_experts=16, n_shared_experts=1, top_k=2, n_groups=4, topk_groups=2, routed_scaling_factor=1.0,
        n_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, max_seq_len=128, mtp_depth=1, router_bias_rate=1e-2, dtype="float32",
    ),
    # DeepSeek-V3 proportions at ~2.07 B total / ~0.36 B active: 64 routed experts (8 groups, top-4 groups)
    # + 1 shared, top-6, MLA with q/kv LoRA and decoupled RoPE, MTP depth 1; sized for one 80 GB GPU at
    # 8 x 2048 tokens. Its router recipe is for short, high-lr runs (docs/configuration.md has the measurements;
    # DeepSeek-V3's own is router_recipe "deepseek_v3" with router_bias_rate 1e-3).
    "reduced": dict(
        vocab_size=32768, d_model=1280, n_layers=16, n_dense_layers=1, dense_ffn_dim=3584, moe_ffn_dim=512,
        n_experts=64, n_shared_experts=1, top_k=6, n_groups=8, topk_groups=4, routed_scaling_factor=2.5,
        n_heads=16, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, max_seq_len=2048, mtp_depth=1, mtp_loss_weight=0.3,
        remat_policy="dots_experts_attention", init_std=0.006, loss_chunk_tokens=4096, logits_dtype="bfloat16",
        router_recipe="short_run", router_bias_rate=1e-2,
    ),
    # The public DeepSeek-V3 architecture (config.json of deepseek-ai/DeepSeek-V3).
    "deepseek_v3_671b": dict(
        vocab_size=129280, d_model=7168, n_layers=61, n_dense_layers=3, dense_ffn_dim=18432, moe_ffn_dim=2048,
        n_experts=256, n_shared_experts=1, top_k=8, n_groups=8, topk_groups=4, routed_scaling_factor=2.5,
        n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, max_seq_len=4096, mtp_depth=1, mtp_loss_weight=0.3,
        router_bias_rate=1e-3, remat_policy="full", init_std=0.006,
        loss_chunk_tokens=4096, logits_dtype="bfloat16",
    ),
}

PRESET_NAMES = tuple(_PRESETS)


def get_config(name: str, **overrides) -> ModelConfig:
    """Preset `name` with field overrides (MaxText aliases accepted), validated."""
    if name not in _PRESETS:
        CHECK.fail("preset", name, f"one of {PRESET_NAMES}",
                   f"unknown model preset {name!r}; expected one of {PRESET_NAMES}")
    return ModelConfig.from_dict({**_PRESETS[name], **_canonical_names(overrides)})
