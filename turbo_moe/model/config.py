"""ModelConfig: one frozen dataclass for the DeepSeek-V3-style decoder, its presets and validation.

Every module receives the whole config; each behavioural difference is an explicit field read in one
place. Presets: `tiny` (CPU tests), `small` (CPU default run), `reduced` (one 80 GB GPU),
`deepseek_v3_671b` (the public architecture).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

MOE_PATHS = ("dense_cf", "ragged", "turbo", "pallas")  # each has its rows in turbo_moe.model.paths.PATHS
EP_EXCHANGES = ("deepep", "ragged_all_to_all")
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
PARAM_DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "dots_experts_attention")
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "cudnn_unpadded")  # turbo_moe/model/layers.py: causal_attention
EP_LAYOUTS = ("auto", "dense", "packed", "ragged")  # turbo_moe.ops.moe_dispatch's layouts
ROUTER_BIAS_UPDATES = ("sign", "proportional")
HEAD_BIASES = ("none", "zero", "unigram")
LOGITS_DTYPES = ("float32", "bfloat16")
# Fields that measured A/Bs decided and removed: name -> (the behaviour kept, why). `from_dict` accepts a removed
# field set to the kept behaviour (old records and specs), and refuses any other value with the reason.
REMOVED_FIELDS: dict[str, tuple[Any, str]] = {
    "cast_params_before_scan": (True, "the stacked weights are always cast to the compute dtype before the layer scan"),
    "router_topk_impl": ("auto", "the router_topk kernel picks the experts on GPUs, jnp elsewhere (the same picks)"),
    "embedding_grad": ("segment", "the embedding's backward is always turbo_moe.ops.segment_sum"),
    "expert_backward": ("block", "the permute exchange's experts always run as one expert block"),
    "swiglu_impl": ("auto", "the SwiGLU kernels run on GPUs, XLA's fusions elsewhere"),
    "router_center_ema": (0.0, "router centering by a running mean lost to router_center_causal"),
    "router_bias_rate_start": (0.0, "the bias update rate is router_bias_rate throughout"),
    "router_bias_rate_decay_steps": (0, "the bias update rate is router_bias_rate throughout"),
}

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
    """Architecture + MoE-path settings. Validated on construction (`ValueError` naming the field)."""

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
    rope_theta: float = 10000.0
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
    balance_loss_weight: float = 1e-4
    router_bias_rate: float = 1e-3
    moe_path: str = "turbo"
    capacity_factor: float = 1.25  # dense_cf only; <= 0 computes every expert densely
    drop_tokens: bool = False  # a dropless path drops what dense_cf at capacity_factor drops (model/capacity.py)
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
    # Run each stack of blocks (dense prefix, MoE blocks) as one jax.lax.scan: compile time independent
    # of depth. False: the same stacked weights in a Python loop (every layer in the HLO; debugging).
    scan_layers: bool = True
    tie_embeddings: bool = False
    # Output-head bias, a float32 (V,) Param added to the main and MTP logits. "unigram": training sets it
    # at init to the training split's log unigram frequencies, so the model need not learn them as one
    # direction every token's hidden state carries, the direction that collapses the routers in the lr
    # warm-up (docs/notes/routing.md); "zero": learned from zero; "none": no bias (DeepSeek-V3).
    head_bias: str = "none"
    # Zero-init the projections back into the residual stream (attention and SwiGLU `wo`, experts'
    # `w_down`): every block starts as the identity, so the router inputs are the token embeddings at
    # every depth. With random ones, the near-uniform attention of a fresh model adds nearly the same
    # vector to every token in each layer, and the routers of deep layers see tokens that look alike.
    zero_init_out_proj: bool = False
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02  # std of every projection's normal init
    # Token-embedding init std; None: d_model ** -0.5 (MaxText's fan-in default). Not init_std: with
    # embeddings as small as DeepSeek's 0.006 the (near-uniform) attention output dominates the residual
    # stream at init, the tokens of a sequence look alike and the router collapses onto a few experts.
    embedding_init_std: float | None = None
    # Router (gate) kernel init std; None: init_std (DeepSeek/Megatron: one std for every projection);
    # d_model ** -0.5 is MaxText's fan-in gate init.
    router_init_std: float | None = None
    # "sign": b_i += rate * sign(mean - load_i) (DeepSeek-V3); "proportional": b_i += rate * (mean -
    # load_i) / mean, so an expert at 10x the mean load moves 9 steps' worth at once.
    router_bias_update: str = "sign"
    # Gate kernel stored divided by this factor and multiplied back in the forward: AdamW (updates ~lr
    # per element) then moves the gate at lr * router_lr_scale, without touching the optimizer.
    router_lr_scale: float = 1.0
    # Causal sequence centering of the selection (False: off): top-k reads sigmoid(l_t - mean_{s<=t} l_s),
    # each token's gate logits minus the running mean of its own sequence's so far (stop-gradient; combine
    # weights unchanged). Whatever every token of a sequence shares (the shared direction that collapses the
    # routers) leaves the choice exactly; past tokens only, so training and decoding agree.
    router_center_causal: bool = False
    # Causal sequence load penalty on the selection (0: off): each sequence runs through top-k in chunks of
    # `router_seq_load_chunk` tokens; a token's selection is lowered by this weight x max(share - 1, 0) per expert,
    # share = that expert's picks by the sequence's *earlier chunks* over its fair share k/E (with a prior of
    # SEQ_LOAD_PRIOR_TOKENS fair-share tokens; `router.seq_load_penalized_selection`). A sequence that sends most
    # of its tokens to a few experts (repeated names and lines) spreads its later tokens. Stop-gradient, combine
    # weights unchanged, past chunks only (a decoder that keeps each sequence's counts, updated at chunk boundaries,
    # makes the same choices). Sequential over chunks: a parallel version moves alike tokens all at once.
    router_seq_load_penalty: float = 0.0
    router_seq_load_chunk: int = 128
    # "auto" (on the GPU for bf16/f16: cuDNN with v at its own width where this JAX has the private entry point
    # "cudnn_unpadded" needs, else cuDNN with v padded; XLA elsewhere), "xla", "cudnn", or "cudnn_unpadded"
    # (layers.causal_attention).
    attention_impl: str = "auto"

    def __post_init__(self):
        _validate(self)

    # ----- derived sizes -----
    @property
    def embedding_std(self) -> float:
        return self.d_model ** -0.5 if self.embedding_init_std is None else float(self.embedding_init_std)

    @property
    def router_std(self) -> float:
        return self.init_std if self.router_init_std is None else float(self.router_init_std)

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
        for key, value in values.items():
            name = MAXTEXT_ALIASES.get(key, key)
            if name in REMOVED_FIELDS:
                _check_removed(name, value)
                continue
            if name not in known:
                raise ValueError(f"unknown ModelConfig field {key!r}; known fields: {sorted(known)}")
            if name in kwargs:
                raise ValueError(f"ModelConfig field {name!r} given twice (as {key!r} and an alias)")
            kwargs[name] = _coerce(name, value, known[name].type)
        return cls(**kwargs)

    @classmethod
    def from_record(cls, values: Mapping[str, Any]) -> "ModelConfig":
        """An older run's recorded config, for reading history: fields since removed (REMOVED_FIELDS) are dropped
        whatever their value, since that run already ran with them. Configs to run go through `from_dict`."""
        return cls.from_dict({k: v for k, v in values.items() if MAXTEXT_ALIASES.get(k, k) not in REMOVED_FIELDS})

    @classmethod
    def from_yaml(cls, path_or_text: str) -> "ModelConfig":
        """From a YAML file path or YAML text. A top-level `preset:` key starts from that preset."""
        import yaml

        text = path_or_text
        if os.path.exists(path_or_text):
            with open(path_or_text) as f:
                text = f.read()
        values = yaml.safe_load(text) or {}
        if not isinstance(values, dict):
            raise ValueError(f"YAML model config must be a mapping, got {type(values).__name__}")
        preset = values.pop("preset", None)
        return get_config(preset, **values) if preset else cls.from_dict(values)


def _canonical_names(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Rename MaxText aliases so overrides replace (not duplicate) the field they name."""
    renamed: dict[str, Any] = {}
    for key, value in overrides.items():
        name = MAXTEXT_ALIASES.get(key, key)
        if name in renamed:
            raise ValueError(f"ModelConfig field {name!r} given twice (as {key!r} and an alias)")
        renamed[name] = value
    return renamed


def _check_removed(name: str, value: Any) -> None:
    kept, why = REMOVED_FIELDS[name]
    same = value == kept or (isinstance(kept, str) and value in ("kernel", "xla") and kept == "auto")
    if not same or isinstance(value, bool) != isinstance(kept, bool):
        raise ValueError(f"ModelConfig field {name!r} was removed ({why}); got {value!r}: drop it from the config")


def _coerce(name: str, value: Any, type_name: Any) -> Any:
    """Coerce YAML/CLI values (e.g. '1e-3', 2.0 for an int) to the field's type, or raise naming the field."""
    type_name = type_name if isinstance(type_name, str) else type_name.__name__
    if type_name == "float | None":
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        type_name = "float"
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
        raise TypeError(f"ModelConfig.{name} expects {type_name}, got {value!r}") from None
    return value


def _require(condition: bool, field: str, message: str) -> None:
    if not condition:
        raise ValueError(f"ModelConfig.{field}: {message}")


def _validate(c: ModelConfig) -> None:
    positive = ("vocab_size", "d_model", "n_layers", "moe_ffn_dim", "n_experts", "top_k", "n_groups",
                "topk_groups", "n_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "max_seq_len")
    for name in positive:
        value = getattr(c, name)
        _require(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                 f"must be a positive int, got {value!r}")
    non_negative = ("n_dense_layers", "n_shared_experts", "q_lora_rank", "qk_nope_head_dim", "mtp_depth",
                    "dense_ffn_dim", "loss_chunk_tokens")
    for name in non_negative:
        value = getattr(c, name)
        _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name,
                 f"must be a non-negative int, got {value!r}")
    _require(c.n_dense_layers <= c.n_layers, "n_dense_layers",
             f"{c.n_dense_layers} dense layers > n_layers={c.n_layers}")
    _require(c.n_dense_layers == 0 or c.dense_ffn_dim > 0, "dense_ffn_dim",
             f"must be > 0 when n_dense_layers={c.n_dense_layers}")
    _require(c.top_k <= c.n_experts, "top_k", f"top_k={c.top_k} > n_experts={c.n_experts}")
    _require(c.n_experts % c.n_groups == 0, "n_groups",
             f"n_groups={c.n_groups} does not divide n_experts={c.n_experts}")
    _require(c.topk_groups <= c.n_groups, "topk_groups",
             f"topk_groups={c.topk_groups} > n_groups={c.n_groups}")
    selectable = c.topk_groups * (c.n_experts // c.n_groups)
    _require(c.top_k <= selectable, "top_k",
             f"top_k={c.top_k} > experts in the {c.topk_groups} selected groups ({selectable})")
    _require(c.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim",
             f"must be even (RoPE rotates pairs), got {c.qk_rope_head_dim}")
    _require(c.moe_path in MOE_PATHS, "moe_path", f"unknown path {c.moe_path!r}; expected one of {MOE_PATHS}")
    _require(c.dtype in COMPUTE_DTYPES, "dtype", f"got {c.dtype!r}; expected one of {COMPUTE_DTYPES}")
    _require(c.moe_path != "pallas" or c.dtype in ("bfloat16", "float16"), "dtype",
             f"moe_path='pallas' (Mosaic-GPU wgmma kernels) computes in bfloat16 or float16, got {c.dtype!r}")
    _require(c.param_dtype in PARAM_DTYPES, "param_dtype",
             f"got {c.param_dtype!r}; expected one of {PARAM_DTYPES}")
    _require(c.remat_policy in REMAT_POLICIES, "remat_policy",
             f"got {c.remat_policy!r}; expected one of {REMAT_POLICIES}")
    _require(c.attention_impl in ATTENTION_IMPLS, "attention_impl",
             f"got {c.attention_impl!r}; expected one of {ATTENTION_IMPLS}")
    _require(c.ep_layout in EP_LAYOUTS, "ep_layout", f"got {c.ep_layout!r}; expected one of {EP_LAYOUTS}")
    _require(c.head_bias in HEAD_BIASES, "head_bias", f"got {c.head_bias!r}; expected one of {HEAD_BIASES}")
    _require(c.logits_dtype in LOGITS_DTYPES, "logits_dtype", f"got {c.logits_dtype!r}; expected one of {LOGITS_DTYPES}")
    _require(c.router_bias_update in ROUTER_BIAS_UPDATES, "router_bias_update",
             f"got {c.router_bias_update!r}; expected one of {ROUTER_BIAS_UPDATES}")
    for name in ("routed_scaling_factor", "rope_theta", "rms_norm_eps", "init_std", "router_lr_scale"):
        value = getattr(c, name)
        _require(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, name,
                 f"must be a positive finite number, got {value!r}")
    _require(c.embedding_init_std is None or (
        isinstance(c.embedding_init_std, (int, float)) and math.isfinite(c.embedding_init_std)
        and c.embedding_init_std > 0), "embedding_init_std",
        f"must be None or a positive finite number, got {c.embedding_init_std!r}")
    _require(c.router_init_std is None or (
        isinstance(c.router_init_std, (int, float)) and math.isfinite(c.router_init_std)
        and c.router_init_std > 0), "router_init_std",
        f"must be None or a positive finite number, got {c.router_init_std!r}")
    _require(isinstance(c.router_center_causal, bool), "router_center_causal",
             f"must be a bool, got {c.router_center_causal!r}")
    _require(isinstance(c.router_seq_load_penalty, (int, float)) and not isinstance(c.router_seq_load_penalty, bool)
             and math.isfinite(c.router_seq_load_penalty) and c.router_seq_load_penalty >= 0,
             "router_seq_load_penalty", f"must be a finite number >= 0 (0: off), got {c.router_seq_load_penalty!r}")
    _require(isinstance(c.router_seq_load_chunk, int) and not isinstance(c.router_seq_load_chunk, bool)
             and c.router_seq_load_chunk > 0, "router_seq_load_chunk",
             f"must be a positive int (tokens per chunk), got {c.router_seq_load_chunk!r}")
    n_chunks = -(-c.max_seq_len // c.router_seq_load_chunk)
    _require(c.router_seq_load_penalty == 0 or n_chunks <= MAX_SEQ_LOAD_CHUNKS, "router_seq_load_chunk",
             f"{c.router_seq_load_chunk} makes {n_chunks} chunks of a {c.max_seq_len}-token sequence, each unrolled "
             f"into the program; at most {MAX_SEQ_LOAD_CHUNKS} (chunk >= {-(-c.max_seq_len // MAX_SEQ_LOAD_CHUNKS)})")
    for name in ("mtp_loss_weight", "balance_loss_weight", "router_bias_rate"):
        value = getattr(c, name)
        _require(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, name,
                 f"must be a finite number >= 0, got {value!r}")
    _require(isinstance(c.capacity_factor, (int, float)) and math.isfinite(c.capacity_factor),
             "capacity_factor", f"must be a finite number, got {c.capacity_factor!r}")
    _require(not c.drop_tokens or (c.moe_path != "dense_cf" and c.capacity_factor > 0), "drop_tokens",
             f"drops dense_cf's overflow on a dropless path and needs capacity_factor > 0; got moe_path "
             f"{c.moe_path!r}, capacity_factor {c.capacity_factor!r}")
    _require(c.ep_exchange in EP_EXCHANGES, "ep_exchange",
             f"got {c.ep_exchange!r}; expected one of {EP_EXCHANGES}")
    _require(isinstance(c.ep_capacity_factor, (int, float)) and 0 <= c.ep_capacity_factor <= 1,
             "ep_capacity_factor", f"must be in [0, 1] (0: worst-case buffers), got {c.ep_capacity_factor!r}")
    for name in ("tie_embeddings", "scan_layers", "zero_init_out_proj"):
        _require(isinstance(getattr(c, name), bool), name, f"must be a bool, got {getattr(c, name)!r}")


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
    # 8 x 2048 tokens. Its routing recipe is for short, high-lr runs (docs/configuration.md has the measurements;
    # DeepSeek-V3's own: head_bias "none", zero_init_out_proj False, router_lr_scale 1, router_bias_update "sign",
    # router_bias_rate 1e-3, router_center_causal False, router_seq_load_penalty 0).
    "reduced": dict(
        vocab_size=32768, d_model=1280, n_layers=16, n_dense_layers=1, dense_ffn_dim=3584, moe_ffn_dim=512,
        n_experts=64, n_shared_experts=1, top_k=6, n_groups=8, topk_groups=4, routed_scaling_factor=2.5,
        n_heads=16, q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, max_seq_len=2048, mtp_depth=1, mtp_loss_weight=0.3, balance_loss_weight=1e-4,
        remat_policy="dots_experts_attention", init_std=0.006, loss_chunk_tokens=4096, logits_dtype="bfloat16",
        head_bias="unigram", zero_init_out_proj=True, router_lr_scale=0.1, router_bias_update="proportional",
        router_bias_rate=1e-2, router_center_causal=True, router_seq_load_penalty=0.1,
    ),
    # The public DeepSeek-V3 architecture (config.json of deepseek-ai/DeepSeek-V3).
    "deepseek_v3_671b": dict(
        vocab_size=129280, d_model=7168, n_layers=61, n_dense_layers=3, dense_ffn_dim=18432, moe_ffn_dim=2048,
        n_experts=256, n_shared_experts=1, top_k=8, n_groups=8, topk_groups=4, routed_scaling_factor=2.5,
        n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, rope_theta=10000.0, max_seq_len=4096, mtp_depth=1, mtp_loss_weight=0.3,
        balance_loss_weight=1e-4, router_bias_rate=1e-3, remat_policy="full", init_std=0.006,
        loss_chunk_tokens=4096, logits_dtype="bfloat16",
    ),
}

PRESET_NAMES = tuple(_PRESETS)


def get_config(name: str, **overrides) -> ModelConfig:
    """Preset `name` with field overrides (MaxText aliases accepted), validated."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {PRESET_NAMES}")
    return ModelConfig.from_dict({**_PRESETS[name], **_canonical_names(overrides)})
