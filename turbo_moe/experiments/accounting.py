"""Full-size budgets per MoE path: parameters, training FLOPs and memory per device for a mesh.

Used by ``03_full_deepseek`` for the exact DeepSeek-V3-671B config, where nothing can be allocated.
The estimates are analytic and state their assumptions:

- Training states (AdamW): parameters and gradients in ``param_dtype`` plus two moments in ``param_dtype``
  (each in bfloat16 with ``TrainConfig.moments_dtype="bfloat16"``).
  Routed-expert weights are split over ``expert x tensor x pipeline``, the other weights over
  ``tensor x pipeline``; with ``fsdp`` both are further split over ``data`` (ZeRO-3 style).
- Activations for ``per_device_batch`` sequences, at the start of the backward pass: every layer's saved
  values under its remat policy (``saved_values_per_token``), one layer's working set, and the float32
  logits of the output heads (one chunk's with ``loss_chunk_tokens``). Layers are split over ``pipeline``;
  a layer's values over ``tensor``. The stacked weights' cast to the compute dtype before the layer scan is not
  modelled: XLA:CPU and the GPU move the peak in opposite directions (docs/notes/archive).
  ``master_weights="split"`` keeps each stacked float32 master as a bf16 copy + 16 low bits: the same 4 bytes.
  ``optimizer_state_memory="host"`` keeps the moments in host memory (``host_state_bytes_per_device``), not the
  device's (the split masters' low bits go there too; not modelled: the device estimate is high by up to 2 bytes a
  stacked weight).
- The MoE working set is where the paths differ: ``dense_cf`` builds (B, S, E, C) dispatch/combine
  one-hot tensors and runs E x C slots per sequence (C = ceil(S k / E) cf, padding included); the
  dropless paths (``paths.DROPLESS_PATHS``: ragged, turbo, pallas) hold the B S k sorted token copies only.

The path names and dense_cf's capacity come from ``turbo_moe.model.paths``, the MoE path table.
"""

from __future__ import annotations

import dataclasses

import pandas as pd

from turbo_moe.model import ModelConfig, count_params, flops_per_token
from turbo_moe.model.paths import DROPLESS_PATHS, MOE_PATHS, ONE_DEVICE, expert_capacity, path_row
from turbo_moe.train.config import MOMENTS_DTYPES, OPTIMIZER_STATE_MEMORIES

GIB = 1024**3
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The moments' storage dtypes a run executes: the TrainConfig fields' values less "auto" (None: param_dtype).
RESOLVED_MOMENT_DTYPES = tuple(d for d in MOMENTS_DTYPES if d != "auto")


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Device mesh of a hypothetical run: data (DP/FSDP) x expert (EP) x tensor (TP) x pipeline (PP)."""

    data: int = 1
    expert: int = 1
    tensor: int = 1
    pipeline: int = 1
    fsdp: bool = True

    def __post_init__(self):
        for name in ("data", "expert", "tensor", "pipeline"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"MeshShape.{name}: must be a positive int, got {value!r}")

    @property
    def devices(self) -> int:
        return self.data * self.expert * self.tensor * self.pipeline


def moe_blocks_with_mtp(cfg: ModelConfig) -> int:
    """Blocks with a routed-expert FFN: the main stack's MoE layers (``cfg.n_moe_layers``) plus the MTP
    blocks that are MoE (``cfg.n_router_layers`` counts both: one router per MoE block)."""
    return cfg.n_router_layers


def routed_expert_params(cfg: ModelConfig) -> int:
    """Parameters of all routed experts: gate, up and down projections, (D, F) each."""
    return moe_blocks_with_mtp(cfg) * cfg.n_experts * 3 * cfg.d_model * cfg.moe_ffn_dim


def param_budget(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the model itself (abstract shapes), split into routed experts and the rest."""
    counts = count_params(cfg)
    routed = routed_expert_params(cfg)
    return {"total (main)": counts["total"], "active per token": counts["active"],
            "allocated (with MTP)": counts["total_with_mtp"], "routed experts": routed,
            "other": counts["total_with_mtp"] - routed}


def capacity(cfg: ModelConfig, seq_len: int) -> int:
    """dense_cf slots per expert per sequence (``paths.expert_capacity``; capacity_factor > 0)."""
    return expert_capacity(seq_len, cfg.top_k, cfg.n_experts, cfg.capacity_factor)


def _capacity_slots(cfg: ModelConfig, path: str) -> bool:
    """The path runs E x C padded slots (dense_cf with cf > 0); the dropless paths run the B S k copies."""
    return path not in DROPLESS_PATHS and cfg.capacity_factor > 0


def flops_per_token_by_path(
    cfg: ModelConfig, seq_len: int, path: str, *, useful: float | None = None
) -> dict[str, float]:
    """Training FLOPs per token: the useful model FLOPs, and what the path actually executes.

    ``useful`` (``flops_per_token(cfg, seq_len)``, the same for every path) may be passed to skip
    rebuilding the abstract model.
    """
    _check_path(path)
    useful = flops_per_token(cfg, seq_len) if useful is None else useful
    expert = 6.0 * moe_blocks_with_mtp(cfg) * cfg.top_k * 3 * cfg.d_model * cfg.moe_ffn_dim  # routed, dropless
    executed = useful
    if _capacity_slots(cfg, path):
        slots_per_token = cfg.n_experts * capacity(cfg, seq_len) / seq_len  # E*C/S rows per token
        executed += expert * (slots_per_token / cfg.top_k - 1.0)  # padded slots run too
        # One-hot dispatch and combine einsums: (S, E*C) x (S, D) each, fwd + 2 bwd matmuls.
        executed += moe_blocks_with_mtp(cfg) * 2 * 3 * 2.0 * cfg.n_experts * capacity(cfg, seq_len) * cfg.d_model
    return {"useful": useful, "executed": executed}


def _per_device(routed: float, other: float, mesh: MeshShape) -> float:
    """Elements per device of tensors laid out like the parameters (routed experts / the rest)."""
    data_split = mesh.data if mesh.fsdp else 1
    return (routed / (mesh.expert * mesh.tensor * mesh.pipeline * data_split)
            + other / (mesh.tensor * mesh.pipeline * data_split * (mesh.expert if mesh.fsdp else 1)))


def _moment_bytes(cfg: ModelConfig, adam_mu_dtype: str | None, adam_nu_dtype: str | None,
                  optimizer_state_memory: str) -> int:
    """Bytes a parameter of both AdamW moments."""
    for name, dtype in (("adam_mu_dtype", adam_mu_dtype), ("adam_nu_dtype", adam_nu_dtype)):
        if dtype not in RESOLVED_MOMENT_DTYPES:
            raise ValueError(f"{name} must be None, 'bfloat16' or 'float32' (resolve 'auto' with "
                             f"TrainConfig.resolved(platform)), got {dtype!r}")
    if optimizer_state_memory not in OPTIMIZER_STATE_MEMORIES:
        raise ValueError(f"optimizer_state_memory must be one of {OPTIMIZER_STATE_MEMORIES}, got "
                         f"{optimizer_state_memory!r}")
    return _BYTES[adam_mu_dtype or cfg.param_dtype] + _BYTES[adam_nu_dtype or cfg.param_dtype]


def state_bytes_per_device(cfg: ModelConfig, mesh: MeshShape, adam_mu_dtype: str | None = None,
                           adam_nu_dtype: str | None = None, optimizer_state_memory: str = "device") -> float:
    """AdamW training states in each device's memory: params + grads (in param_dtype) + the first and second moments
    (``adam_mu_dtype`` / ``adam_nu_dtype``, as the TrainConfig fields resolved for a device,
    ``TrainConfig.resolved``; None: param_dtype, as optax keeps them) unless ``optimizer_state_memory="host"``."""
    moments = _moment_bytes(cfg, adam_mu_dtype, adam_nu_dtype, optimizer_state_memory)
    per_param = 2 * _BYTES[cfg.param_dtype] + (moments if optimizer_state_memory == "device" else 0)
    budget = param_budget(cfg)
    return per_param * _per_device(budget["routed experts"], budget["other"], mesh)


def host_state_bytes_per_device(cfg: ModelConfig, mesh: MeshShape, adam_mu_dtype: str | None = None,
                                adam_nu_dtype: str | None = None, optimizer_state_memory: str = "device") -> float:
    """The AdamW moments a device keeps in host memory (``optimizer_state_memory="host"``; else 0)."""
    moments = _moment_bytes(cfg, adam_mu_dtype, adam_nu_dtype, optimizer_state_memory)
    budget = param_budget(cfg)
    return (moments if optimizer_state_memory == "host" else 0) * _per_device(budget["routed experts"],
                                                                            budget["other"], mesh)


def moe_working_set_bytes(cfg: ModelConfig, path: str, per_device_batch: int, seq_len: int) -> float:
    """Live bytes of one MoE layer's forward for ``per_device_batch`` sequences (compute dtype)."""
    _check_path(path)
    b, s, d, f, e, k = per_device_batch, seq_len, cfg.d_model, cfg.moe_ffn_dim, cfg.n_experts, cfg.top_k
    act = _BYTES[cfg.dtype]
    if _capacity_slots(cfg, path):
        c = capacity(cfg, s)
        masks = b * s * e * c * (act + 4)  # dispatch (compute dtype) + combine (float32)
        rows = e * b * c  # dispatched slots, padding included
    else:
        masks = b * s * k * 4 * 2  # sort indices and row map (int32)
        rows = b * s * k  # sorted token copies
    # rows x (D in, 2F gate/up, F activation, D out)
    return masks + rows * (2 * d + 3 * f) * act


def attention_working_set_bytes(cfg: ModelConfig, per_device_batch: int, seq_len: int) -> float:
    """One attention layer on a GPU: q, k, v and the output (cuDNN's flash attention keeps no (S, S) scores)."""
    b, s, h = per_device_batch, seq_len, cfg.n_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    tensors = b * s * h * (2 * qk + 2 * cfg.v_head_dim) * _BYTES[cfg.dtype]
    return tensors


def _expert_block(path: str) -> bool:
    """The path runs `ops.expert_block`'s one VJP: every path with the permute exchange (turbo, pallas; under EP
    around each rank's experts)."""
    return path_row(path, ONE_DEVICE).exchange == "permute"


def saved_values_per_token(cfg: ModelConfig, path: str, moe: bool) -> float:
    """Bytes one block keeps per token for its backward pass under ``cfg.remat_policy``.

    "full": the block input. "dots_no_batch" (and "dots", whose extra batched dots are attention and
    dense_cf's slot einsums): the input plus every projection output (MLA q/kv LoRA and up-projections,
    output projection, the float32 router gate, the shared expert or dense FFN). Grouped GEMMs (FFI
    calls, `ragged_dot`) and cuDNN attention are not dots: they are recomputed. "dots_experts_attention":
    "dots_no_batch" plus the routed experts' rows, gate/up, SwiGLU and down outputs (per copy or capacity slot;
    with the expert block, on the paths with the permute exchange, only the gate/up outputs and the block's input
    tokens),
    the routing's int32 picks and row index, and cuDNN attention's inputs, output and float32 softmax statistics.
    "none": the whole working set of the block (attention + FFN), at least the widest policy's set, stays.
    """
    act = _BYTES[cfg.dtype]
    d = cfg.d_model
    if cfg.remat_policy == "full":
        return d * act
    if cfg.remat_policy == "none":
        work = attention_working_set_bytes(cfg, 1, 1) + (
            moe_working_set_bytes(cfg, path, 1, 1) if moe else 3 * cfg.dense_ffn_dim * act)
        # Everything stays, so at least what the widest policy keeps (it names tensors the working-set terms
        # leave out: the projection outputs), + norms and residual sums.
        widest = saved_values_per_token(dataclasses.replace(cfg, remat_policy="dots_experts_attention"), path, moe)
        return max(work, widest) + 6 * d * act
    h, qk = cfg.n_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = (cfg.q_lora_rank + h * qk) if cfg.q_lora_rank else h * qk
    kv = cfg.kv_lora_rank + cfg.qk_rope_head_dim + h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    attention = q + kv + d
    if moe:
        ffn = 2 * cfg.n_shared_experts * cfg.moe_ffn_dim + d if cfg.n_shared_experts else 0
        gate = cfg.n_experts * 4 / act  # float32 router scores
    else:
        ffn, gate = 2 * cfg.dense_ffn_dim + d, 0
    if cfg.remat_policy == "dots_experts_attention":
        # cuDNN's inputs (q, k, v at the wider head dim), output and float32 log-sum-exp
        attention += 3 * h * max(qk, cfg.v_head_dim) + h * cfg.v_head_dim + h * 4 / act
        if moe:
            # per copy (dense_cf: per capacity slot, cf x top_k per token, unrounded)
            rows = cfg.top_k * (cfg.capacity_factor if _capacity_slots(cfg, path) else 1.0)
            if _expert_block(path):
                ffn += rows * 2 * cfg.moe_ffn_dim + d  # gate/up out per copy, the tokens once
            else:
                ffn += rows * (2 * d + 3 * cfg.moe_ffn_dim)  # rows in, gate/up out, SwiGLU out, down out
            # int32 routing results: the router's picks, and the permute's row index where the path permutes
            ffn += cfg.top_k * 4 / act * (1 if _capacity_slots(cfg, path) else 2)
    return (d + attention + ffn + gate) * act


def activation_bytes_per_device(
    cfg: ModelConfig, path: str, mesh: MeshShape, per_device_batch: int, seq_len: int
) -> dict[str, float]:
    """Activation memory per device at the start of the backward pass (where training peaks):

    saved layers   every block's saved values (`saved_values_per_token`), MTP blocks included;
    live layer     what a MoE block's backward rebuilds beyond its own saved values: its working set less those
                   (counted once, in "saved layers"; nothing under "none", most of the set under "full");
    logits         float32 logits of the main and MTP heads, kept for the loss's backward, plus the
                   gradient of one of them; with ``loss_chunk_tokens`` (``chunked_loss``) one chunk's
                   logits (``logits_dtype``) and float32 gradient, plus each head's float32 gradients (hidden
                   and head weight) kept from the forward pass.
    """
    tokens = per_device_batch * seq_len
    moe_block_per_token = saved_values_per_token(cfg, path, True)
    per_token = (moe_blocks_with_mtp(cfg) * moe_block_per_token
                 + cfg.n_dense_layers * saved_values_per_token(cfg, path, False))
    saved = tokens * per_token / (mesh.pipeline * mesh.tensor)
    moe = moe_working_set_bytes(cfg, path, per_device_batch, seq_len) / mesh.tensor
    attn = attention_working_set_bytes(cfg, per_device_batch, seq_len) / mesh.tensor
    # The recomputation does not rebuild what the block saved: a 2-layer full-width slice under
    # dots_experts_attention measured 0.76-0.84x a prediction that counted both (docs/expert-parallel.md).
    live = max(0.0, moe + attn - tokens * moe_block_per_token / mesh.tensor)
    if cfg.loss_chunk_tokens:
        # a chunk spans the global batch (split over data x expert) and loss_chunk_tokens // batch positions
        positions = max(1, min(seq_len, cfg.loss_chunk_tokens // (per_device_batch * mesh.data * mesh.expert)))
        # one chunk's logits (as the head GEMM writes them), their float32 gradient and its compute-dtype cast
        chunk = per_device_batch * positions * cfg.vocab_size * (_BYTES[cfg.logits_dtype] + 4 + _BYTES[cfg.dtype])
        kept = (1 + cfg.mtp_depth) * (tokens * cfg.d_model + cfg.d_model * cfg.vocab_size) * 4
        logits = (chunk + kept) / mesh.tensor
    else:
        logits = tokens * cfg.vocab_size * 4 * (1 + cfg.mtp_depth + 1) / mesh.tensor
    return {"saved layers": saved, "live layer": live, "logits": logits}


def memory_prediction(cfg: ModelConfig, per_device_batch: int, seq_len: int,
                      mesh: MeshShape | None = None, adam_mu_dtype: str | None = None,
                      adam_nu_dtype: str | None = None, optimizer_state_memory: str = "device") -> dict[str, float]:
    """Predicted peak bytes in each device's memory of one training step of ``cfg`` (its own ``moe_path``): AdamW
    states (parameters, gradients, two moments; ``adam_mu_dtype`` / ``adam_nu_dtype`` / ``optimizer_state_memory``
    as the resolved TrainConfig fields; moments in host memory are left out) plus the activations above. Checked
    against XLA's buffer assignment by ``benchmarks/memory_check.py`` (docs/notes/archive)."""
    mesh = mesh or MeshShape()
    _check_path(cfg.moe_path)
    return {"states": state_bytes_per_device(cfg, mesh, adam_mu_dtype, adam_nu_dtype, optimizer_state_memory),
            **activation_bytes_per_device(cfg, cfg.moe_path, mesh, per_device_batch, seq_len)}


def paths_for(cfg: ModelConfig) -> tuple[str, ...]:
    """The MoE paths `cfg` can run: `turbo_fp8` needs 128-wide experts, `pallas` a bfloat16/float16 dtype."""
    usable = []
    for path in MOE_PATHS:
        try:
            cfg.replace(moe_path=path)
        except ValueError:
            continue
        usable.append(path)
    return tuple(usable)


def full_model_table(
    cfg: ModelConfig, mesh: MeshShape, per_device_batch: int, seq_len: int, paths=None
) -> pd.DataFrame:
    """One row per path (default: every path `cfg` can run, `paths_for`): FLOPs per token and memory per device
    (GiB) for this mesh. ``cfg`` with each path given must be a valid config.
    """
    states = state_bytes_per_device(cfg, mesh)
    useful = flops_per_token(cfg, seq_len)  # path-independent
    rows = []
    for path in paths_for(cfg) if paths is None else paths:
        path_cfg = cfg.replace(moe_path=path)
        flops = flops_per_token_by_path(path_cfg, seq_len, path, useful=useful)
        acts = activation_bytes_per_device(path_cfg, path, mesh, per_device_batch, seq_len)
        rows.append({
            "path": path,
            "useful GFLOP/token": flops["useful"] / 1e9,
            "executed GFLOP/token": flops["executed"] / 1e9,
            "states GiB/device": states / GIB,
            "MoE layer working set GiB": moe_working_set_bytes(path_cfg, path, per_device_batch, seq_len) / GIB,
            "activations GiB/device": sum(acts.values()) / GIB,
            "total GiB/device": (states + sum(acts.values())) / GIB,
        })
    return pd.DataFrame(rows).set_index("path")


def experts_that_fit(cfg: ModelConfig, memory_bytes: float, per_device_batch: int, seq_len: int,
                     *, headroom: float = 0.8) -> int:
    """Most routed experts (a multiple of n_groups, a valid config) whose single-device run fits.

    Single device: nothing is sharded; ``headroom`` leaves room for XLA temporaries. 0 if none fits.
    """
    best = 0
    for n in range(cfg.n_groups, cfg.n_experts + 1, cfg.n_groups):
        try:
            trial = cfg.replace(n_experts=n)
        except ValueError:  # too few experts for top_k within the selected groups
            continue
        need = _single_device_bytes(trial, per_device_batch, seq_len)
        if need <= headroom * memory_bytes:
            best = n
    return best


def _single_device_bytes(cfg: ModelConfig, per_device_batch: int, seq_len: int) -> float:
    per_param = 2 * _BYTES[cfg.param_dtype] + 8
    # Analytic count (no model build): routed experts + the rest scaled from the preset's own count.
    routed = routed_expert_params(cfg)
    other = _other_params_estimate(cfg)
    acts = activation_bytes_per_device(cfg, cfg.moe_path, MeshShape(), per_device_batch, seq_len)
    return per_param * (routed + other) + sum(acts.values())


def _other_params_estimate(cfg: ModelConfig) -> float:
    """Non-routed parameters: embedding/head, attention, shared experts, dense FFNs, routers."""
    d = cfg.d_model
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    q = (d * cfg.q_lora_rank + cfg.q_lora_rank * cfg.n_heads * qk) if cfg.q_lora_rank else d * cfg.n_heads * qk
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * cfg.n_heads * (
        cfg.qk_nope_head_dim + cfg.v_head_dim)
    attention = q + kv + cfg.n_heads * cfg.v_head_dim * d
    blocks = cfg.n_layers + cfg.mtp_depth
    moe_blocks = moe_blocks_with_mtp(cfg)
    shared = moe_blocks * cfg.n_shared_experts * 3 * d * cfg.moe_ffn_dim + moe_blocks * cfg.n_experts * d
    dense = cfg.n_dense_layers * 3 * d * cfg.dense_ffn_dim
    embed = cfg.vocab_size * d * 2  # the embedding and the output head
    mtp_proj = cfg.mtp_depth * 2 * d * d
    return embed + blocks * attention + shared + dense + mtp_proj


def _check_path(path: str) -> None:
    if path not in MOE_PATHS:
        raise ValueError(f"path must be one of {MOE_PATHS}, got {path!r}")
