"""FFI-backed MoE ops, differentiable (custom VJPs; grouped_gemm a linear primitive, to any order).
CPU handlers always; CUDA handlers when built.

- grouped_gemm: drop-in for jax.lax.ragged_dot; grouped_gemm_weight_grad: its variable-K wgrad;
  ragged_dot_general: jax.lax.ragged_dot_general's ragged-M and ragged-contracting modes on those kernels;
  grouped_gemm_fp8: the grouped GEMM in FP8 with DeepSeek-V3's 1x128 / 128x128 scaling (Hopper kernel, emulated
  elsewhere); fp8_weights: its weights' FP8 blocks made once (an Fp8Weights it takes in place of the weight);
  grouped_gemm_swiglu: the gate/up GEMM and SwiGLU of an expert FFN, both outputs from one call;
  swiglu_combine_grad: SwiGLU's backward, the combine weights' gradient and act * w in one pass (no VJP of its own);
  swiglu_combine_grad_fp8: the same, also writing d_h in FP8 per 1x128 tile (the FP8 data gradient's lhs).
- expert_block: a MoE layer's routed experts as one op (permute -> SwiGLU FFN -> unpermute, one custom VJP) for any
  GEMM set (GemmSet: forward, data and weight gradients, optionally the fused gate/up + SwiGLU; GEMM_SETS holds them);
  expert_ffn: the same FFN on expert-sorted rows, differentiated by autodiff.
- permute / unpermute: single-device dispatch/combine, each other's transposes; permute_rows: a permute's
  copy step again for new rows (its row index and group sizes known); permute_fp8: the permute writing FP8 rows
  with their 1x128 scales (grouped_gemm_fp8_quantized's lhs), quantised in the copy;
  quantize_group_columns: the FP8 weight gradient's operands, per 128x1 tile within each group, transposed;
  quantize_rows: activations in FP8 per 1x128 tile (the jnp fp8_scaling.quantize_rows as one kernel);
  swiglu_quantize: SwiGLU(h) written in FP8 per 1x128 tile in one pass (quantize_rows of act; no VJP).
- moe_dispatch / moe_combine: expert-parallel (shard_map) dispatch/combine with static buffers.
- router_topk: the router's group-limited top-k with the causal sequence load penalty fused in.
- segment_sum: rows summed by id, sorted and deterministic (no atomics): drop-in for jax.ops.segment_sum.
- ragged_exchange: pure JAX (no FFI), variable row counts between ranks by an ExchangePlan; the ragged
  layout of moe_dispatch and the model's ragged EP path use it.
"""
from turbo_moe.ops._ffi import ensure_registered, kernel_info
from turbo_moe.ops.expert_block import expert_block, expert_ffn
from turbo_moe.ops.gemm_sets import GEMM_SETS, GemmSet
from turbo_moe.ops.moe_combine import moe_combine
from turbo_moe.ops.moe_dispatch import DispatchHandle, moe_dispatch
from turbo_moe.ops.grouped_gemm import grouped_gemm, grouped_gemm_weight_grad
from turbo_moe.ops.fp8_scaling import Fp8Weights, fp8_weights
from turbo_moe.ops.grouped_gemm_fp8 import grouped_gemm_fp8, grouped_gemm_fp8_quantized
from turbo_moe.ops.grouped_gemm_swiglu import grouped_gemm_swiglu
from turbo_moe.ops.ragged_dot_general import ragged_dot_general
from turbo_moe.ops.swiglu_combine_grad import swiglu_combine_grad, swiglu_combine_grad_fp8
from turbo_moe.ops.permute import PermuteHandle, permute, permute_rows
from turbo_moe.ops.permute_fp8 import permute_fp8, permute_rows_fp8
from turbo_moe.ops.quantize_group_columns import quantize_group_columns
from turbo_moe.ops.quantize_rows import quantize_rows
from turbo_moe.ops.swiglu_quantize import swiglu_quantize
from turbo_moe.ops.ragged_exchange import ExchangePlan, ragged_exchange
from turbo_moe.ops.router_topk import router_topk
from turbo_moe.ops.segment_sum import segment_sum
from turbo_moe.ops.unpermute import unpermute

__all__ = [
    "ensure_registered",
    "kernel_info",
    "expert_block",
    "expert_ffn",
    "GemmSet",
    "GEMM_SETS",
    "grouped_gemm",
    "grouped_gemm_weight_grad",
    "ragged_dot_general",
    "grouped_gemm_fp8",
    "grouped_gemm_fp8_quantized",
    "fp8_weights",
    "Fp8Weights",
    "grouped_gemm_swiglu",
    "swiglu_combine_grad",
    "swiglu_combine_grad_fp8",
    "permute",
    "permute_rows",
    "permute_fp8",
    "permute_rows_fp8",
    "quantize_group_columns",
    "quantize_rows",
    "swiglu_quantize",
    "unpermute",
    "PermuteHandle",
    "moe_dispatch",
    "moe_combine",
    "DispatchHandle",
    "ragged_exchange",
    "ExchangePlan",
    "router_topk",
    "segment_sum",
]
