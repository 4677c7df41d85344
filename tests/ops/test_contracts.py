"""The C++ argument checks every FFI handler shares with its CUDA twin (kernels/contracts/<op>.h): each bad call
below reaches the handler (through the public op where the Python checks let it through, else straight through
jax.ffi.ffi_call) and must be refused with the contract's message. tests/gpu/test_contracts_gpu.py runs the same
CASES on the CUDA handlers and asserts the same messages.

Sizes past the int32 bounds use zero-width dims (K = 0, H = 0, k = 0): the shape is huge, the buffers are empty.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe import ops
from turbo_moe.ops import _ffi

F32, BF16, F16, I32, U8 = jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.uint8
BIG = 2**31  # a row count past the int32 bound


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def ws(*batch):
    """An empty workspace result: the CPU handlers ignore it, and the contracts fail before the CUDA ones read it."""
    return spec((*batch, 0), U8)


@dataclass(frozen=True)
class Case:
    """One bad call of `target`: operands (specs, filled with zeros), result specs and attributes."""
    name: str
    target: str
    operands: tuple
    results: tuple
    message: str  # the handler's whole message (after "INVALID_ARGUMENT: ")
    attrs: dict = field(default_factory=dict)


def _router(name, message, sel=(2, 3, 8), bias=(8,), ids=(2, 3, 2), **attrs):
    kw = dict(top_k=np.int64(2), n_groups=np.int64(2), topk_groups=np.int64(1), penalty=np.float32(0.0),
              chunk=np.int64(4), prior_tokens=np.int64(1))
    kw.update({k: np.float32(v) if k == "penalty" else np.int64(v) for k, v in attrs.items()})
    return Case(name, "turbo_moe_router_topk", (spec(sel, F32), spec(bias, F32)), (spec(ids, I32),), message, kw)


def _permute_fp8(name, message, h=128, xdt=F32, qdt=jnp.float8_e4m3fn, scale=None):
    operands = (spec((4, h), xdt), spec((4, 2), I32), spec((3,), I32))
    results = (spec((8, h), qdt), spec(scale or (8, max(h // 128, 1)), F32))
    return Case(name, "turbo_moe_permute_fp8", operands, results, message, dict(zero_tail=True))


def _group_columns(name, message, x=(10, 4), xdt=F32, groups=2, qdt=jnp.float8_e4m3fn, sdt=F32, p=384):
    q = (x[-1], p) if len(x) == 2 else (4, p)
    results = (spec(q, qdt), spec((p // 128, q[0]), sdt))
    return Case(name, "turbo_moe_quantize_group_columns", (spec(x, xdt), spec((groups,), I32)), results, message)


def _quantize_rows(name, message, x=(2, 3, 256), xdt=F32, qdt=jnp.float8_e5m2, sdt=F32, scale=None):
    results = (spec(x, qdt), spec(scale or (*x[:-1], max(x[-1] // 128, 1)), sdt))
    return Case(name, "turbo_moe_quantize_rows", (spec(x, xdt),), results, message)


def _dispatch(name, message, x=(4, 8), ids=(4, 2), xdt=F32, sx=(2, 3, 8), sxdt=F32, P=2, El=2, C=3, counts=(2,)):
    operands = (spec(x, xdt), spec(ids, I32), spec(ids, F32))
    k = ids[-1]
    results = (spec(sx, sxdt), spec((P, C, k), I32), spec((P, C, k), F32), spec(counts, I32), spec((P,), I32),
               spec((x[0], P), I32))
    attrs = dict(num_ranks=np.int64(P), experts_per_rank=np.int64(El), capacity=np.int64(C))
    return Case(name, "turbo_moe_dispatch_pack", operands, results, message, attrs)


def _fused_pack(name, message, x=(4, 8), slot=(4, 2), sxdt=F32, rows=(2, 3, 2), R=12):
    operands = (spec(x, F32), spec((4, 2), I32), spec((4, 2), F32), spec(slot, I32), spec((2, 3), I32))
    results = (spec((2, 3, 8), sxdt), spec(rows, I32), spec((2, 3, 2), F32))
    return Case(name, "turbo_moe_fused_dispatch_pack", operands, results, message, dict(recv_rows=np.int64(R)))


def _fused_land(name, message, x=(4, 8), rows=(4, 2), out=(12, 8), odt=F32):
    return Case(name, "turbo_moe_fused_dispatch_land", (spec(x, F32), spec(rows, I32)), (spec(out, odt),), message)


def _permute(name, message, x=(4, 8), ids=(4, 2), xdt=F32, xs=(8, 8), gs=(3,), E=3):
    operands = (spec(x, xdt), spec(ids, I32))
    results = (spec(xs, xdt), spec(gs, I32), spec(ids, I32), ws())
    return Case(name, "turbo_moe_permute", operands, results, message, dict(num_experts=np.int64(E), zero_tail=True))


def _combine_grad(name, message, h=(4, 6), g=(4, 3), w=(4,), valid=(), hdt=F32, gdt=F32, d_w=None):
    operands = (spec(h, hdt), spec(g, gdt), spec(w, F32), spec(valid, I32))
    results = (spec(h, hdt), spec(w if d_w is None else d_w, F32), spec(g, hdt))
    return Case(name, "turbo_moe_swiglu_combine_grad", operands, results, message)


def _swiglu_quantize(name, message, h=(2, 3, 512), hdt=F32, valid=(2,), qdt=jnp.float8_e4m3fn, sdt=F32, q=None,
                     scale=None):
    f = h[-1] // 2
    results = (spec(q or (*h[:-1], f), qdt), spec(scale or (*h[:-1], max(f // 128, 1)), sdt))
    return Case(name, "turbo_moe_swiglu_quantize", (spec(h, hdt), spec(valid, I32)), results, message)


def _permute_rows_fp8(name, message, h=128, xdt=F32, rdt=None, qdt=jnp.float8_e5m2, scale=None):
    operands = (spec((4, h), xdt), spec((4, 2), I32), spec((3,), I32))
    results = (spec((8, h), rdt or xdt), spec((8, h), qdt), spec(scale or (8, max(h // 128, 1)), F32))
    return Case(name, "turbo_moe_permute_rows_fp8", operands, results, message, dict(zero_tail=True))


def _combine_grad_fp8(name, message, F=64, qdt=jnp.float8_e4m3fn, scale=(4, 1), sdt=F32):
    operands = (spec((4, 2 * F), F32), spec((4, F), F32), spec((4,), F32), spec((), I32))
    results = (spec((4, 2 * F), F32), spec((4,), F32), spec((4, F), F32), spec((4, 2 * F), qdt), spec(scale, sdt))
    return Case(name, "turbo_moe_swiglu_combine_grad_fp8", operands, results, message)


CASES = [
    # ---- grouped_gemm: (M, K) x (G, K, N) -> (M, N)
    Case("gemm_dtype", "turbo_moe_grouped_gemm", (spec((4, 8), F32), spec((2, 8, 4), BF16), spec((2,), I32)),
         (spec((4, 4), F32), ws()), "grouped_gemm: lhs and rhs must share one dtype of float32/bfloat16/float16",
         dict(transpose_rhs=False, zero_tail=True)),
    Case("gemm_int_out", "turbo_moe_grouped_gemm", (spec((4, 8), F32), spec((2, 8, 4), F32), spec((2,), I32)),
         (spec((4, 4), I32), ws()), "grouped_gemm: output dtype must be float32/bfloat16/float16",
         dict(transpose_rhs=False, zero_tail=True)),
    Case("gemm_contraction", "turbo_moe_grouped_gemm", (spec((4, 8), F32), spec((2, 8, 4), F32), spec((2,), I32)),
         (spec((4, 4), F32), ws()),
         "grouped_gemm: contraction dim or group count mismatch between lhs, rhs, group_sizes",
         dict(transpose_rhs=True, zero_tail=True)),
    Case("gemm_out_shape", "turbo_moe_grouped_gemm", (spec((4, 8), F32), spec((2, 8, 4), F32), spec((2,), I32)),
         (spec((4, 5), F32), ws()), "grouped_gemm: out must be [..., M, N] for lhs [..., M, K] and rhs's N",
         dict(transpose_rhs=False, zero_tail=True)),
    Case("gemm_m_bound", "turbo_moe_grouped_gemm", (spec((BIG, 0), F32), spec((2, 0, 0), F32), spec((2,), I32)),
         (spec((BIG, 0), F32), ws()), "grouped_gemm: M must be < 2^31", dict(transpose_rhs=False, zero_tail=True)),
    # ---- grouped_gemm_weight_grad: (M, K), (M, N) -> (G, K, N)
    Case("wgrad_dtype", "turbo_moe_grouped_gemm_weight_grad",
         (spec((4, 8), F32), spec((4, 3), F16), spec((2,), I32)), (spec((2, 8, 3), F32), ws()),
         "grouped_gemm_weight_grad: lhs and d_out must share one dtype of f32/bf16/f16"),
    Case("wgrad_result_shape", "turbo_moe_grouped_gemm_weight_grad",
         (spec((4, 8), F32), spec((4, 3), F32), spec((2,), I32)), (spec((2, 3, 8), F32), ws()),
         "grouped_gemm_weight_grad: shape mismatch between lhs, d_out and the result"),
    Case("wgrad_batch_dims", "turbo_moe_grouped_gemm_weight_grad",
         (spec((2, 4, 8), F32), spec((3, 4, 3), F32), spec((2, 2), I32)), (spec((2, 2, 8, 3), F32), ws(2)),
         "grouped_gemm_weight_grad: operands must share the same leading batch dims"),
    Case("wgrad_m_bound", "turbo_moe_grouped_gemm_weight_grad",
         (spec((BIG, 0), F32), spec((BIG, 0), F32), spec((2,), I32)), (spec((2, 0, 0), F32), ws()),
         "grouped_gemm_weight_grad: M must be < 2^31"),
    # ---- grouped_gemm_swiglu: the grouped GEMM's operands -> h (M, 2F), act (M, F)
    Case("swiglu_act_dtype", "turbo_moe_grouped_gemm_swiglu",
         (spec((4, 8), F32), spec((2, 8, 6), F32), spec((2,), I32)), (spec((4, 6), F32), spec((4, 3), BF16), ws()),
         "grouped_gemm_swiglu: h and act must share one dtype of float32/bfloat16/float16",
         dict(transpose_rhs=False, zero_tail=True)),
    Case("swiglu_width", "turbo_moe_grouped_gemm_swiglu",
         (spec((4, 8), F32), spec((2, 8, 6), F32), spec((2,), I32)), (spec((4, 6), F32), spec((4, 2), F32), ws()),
         "grouped_gemm_swiglu: h must be [..., M, 2F] for act [..., M, F]", dict(transpose_rhs=False, zero_tail=True)),
    Case("swiglu_gemm_check", "turbo_moe_grouped_gemm_swiglu",
         (spec((4, 8), F32), spec((2, 7, 6), F32), spec((2,), I32)), (spec((4, 6), F32), spec((4, 3), F32), ws()),
         "grouped_gemm: contraction dim or group count mismatch between lhs, rhs, group_sizes",
         dict(transpose_rhs=False, zero_tail=True)),
    # ---- swiglu_combine_grad: h (M, 2F), g (M, F), w (M,), valid () -> d_h, d_w, act_w
    _combine_grad("combine_dtype",
                  "swiglu_combine_grad: h, g, d_h and act_w must share one dtype of float32/bfloat16/float16", gdt=BF16),
    _combine_grad("combine_width", "swiglu_combine_grad: h must be [..., 2F] for g [..., F]", h=(4, 5)),
    _combine_grad("combine_rows", "swiglu_combine_grad: h, g and w must share leading dims", w=(5,)),
    _combine_grad("combine_d_w", "swiglu_combine_grad: d_h must be shaped like h and d_w like w", d_w=(3,)),
    _combine_grad("combine_valid",
                  "swiglu_combine_grad: expected valid [...] (rows to compute of each [M, 2F] problem of h)", valid=(1,)),
    # ---- permute: x (T, H), expert_ids (T, k) -> x_sorted (T*k, H), group_sizes (E,), row_index (T, k), workspace
    _permute("permute_dtype", "permute: x must be float32/bfloat16/float16 and x_sorted the same dtype", xdt=jnp.int32),
    _permute("permute_rows_mismatch", "permute: expert_ids must have T rows like x", ids=(5, 2)),
    _permute("permute_experts_bound", "permute: num_experts must be <= 8192", gs=(8193,), E=8193),
    _permute("permute_results", "permute: expected results x_sorted [..., T*k, H], group_sizes [..., num_experts], "
             "row_index [..., T, k]", gs=(4,)),
    # ---- permute_rows: x (T, H), row_index (T, k), group_sizes (E,) -> x_sorted (T*k, H)
    Case("permute_rows_dims", "turbo_moe_permute_rows", (spec((4, 8), F32), spec((4, 2), I32), spec((2, 3), I32)),
         (spec((8, 8), F32),), "permute_rows: expected x [..., T, H], row_index [..., T, k] and group_sizes [..., E]",
         dict(zero_tail=True)),
    Case("permute_rows_out", "turbo_moe_permute_rows", (spec((4, 8), F32), spec((4, 2), I32), spec((3,), I32)),
         (spec((4, 8), F32),), "permute_rows: x_sorted must be [..., T*k, H]", dict(zero_tail=True)),
    # ---- permute_fp8: x (T, H), row_index (T, k), group_sizes (E,) -> q (T*k, H) e4m3fn, scale (T*k, H/128) f32
    _permute_fp8("permute_fp8_dtype", "permute_fp8: x must be float32/bfloat16/float16", xdt=jnp.int32),
    _permute_fp8("permute_fp8_out_dtype", "permute_fp8: q must be float8_e4m3fn and scale float32", qdt=BF16),
    _permute_fp8("permute_fp8_width", "permute_fp8: x's H must be a positive multiple of 128 (the FP8 scale tiles), "
                 "got H=100", h=100),
    _permute_fp8("permute_fp8_results", "permute_fp8: expected results q [..., T*k, H] and scale [..., T*k, H/128]",
                 scale=(8, 2)),
    # ---- quantize_group_columns: x (M, C), group_sizes (G,) -> q_t (C, P) fp8, scale (P/128, C) f32
    _group_columns("group_columns_dtype", "quantize_group_columns: x must be float32/bfloat16/float16", xdt=I32),
    _group_columns("group_columns_q_dtype", "quantize_group_columns: q_t must be float8_e4m3fn or float8_e5m2",
                   qdt=U8),
    _group_columns("group_columns_scale_dtype", "quantize_group_columns: scale must be float32", sdt=BF16),
    _group_columns("group_columns_rank", "quantize_group_columns: expected x [M, C] and group_sizes [G] (no batch "
                   "dims, no vmap)", x=(2, 10, 4)),
    _group_columns("group_columns_width", "quantize_group_columns: x must have C >= 1 columns", x=(10, 0)),
    _group_columns("group_columns_results", "quantize_group_columns: expected results q_t [C, P] and scale [P/128, C] "
                   "with P = 384 (padded_rows(M, G) in turbo_moe/ops/quantize_group_columns.py)", p=256),
    # ---- quantize_rows: x (..., M, K) -> q (..., M, K) fp8, scale (..., M, K/128) f32
    _quantize_rows("quantize_rows_dtype", "quantize_rows: x must be float32/bfloat16/float16", xdt=I32),
    _quantize_rows("quantize_rows_q_dtype", "quantize_rows: q must be float8_e4m3fn or float8_e5m2", qdt=U8),
    _quantize_rows("quantize_rows_scale_dtype", "quantize_rows: scale must be float32", sdt=BF16),
    _quantize_rows("quantize_rows_rank", "quantize_rows: expected x [..., M, K]", x=(256,), scale=(2,)),
    _quantize_rows("quantize_rows_width", "quantize_rows: x's K must be a positive multiple of 128 (the FP8 scale "
                   "tiles), got K=100", x=(3, 100)),
    _quantize_rows("quantize_rows_results", "quantize_rows: expected results q [..., M, K] and scale [..., M, K/128]",
                   scale=(2, 3, 1)),
    # ---- unpermute: y (R, H), row_index (T, k), weights (T, k) -> out (T, H)
    Case("unpermute_dtype", "turbo_moe_unpermute", (spec((8, 4), F32), spec((4, 2), I32), spec((4, 2), F32)),
         (spec((4, 4), BF16),), "unpermute: y must be float32/bfloat16/float16 and out the same dtype"),
    Case("unpermute_weights", "turbo_moe_unpermute", (spec((8, 4), F32), spec((4, 2), I32), spec((4, 3), F32)),
         (spec((4, 4), F32),), "unpermute: weights must have the shape of row_index"),
    Case("unpermute_out", "turbo_moe_unpermute", (spec((8, 4), F32), spec((4, 2), I32), spec((4, 2), F32)),
         (spec((4, 5), F32),), "unpermute: out must be [..., T, H]"),
    Case("unpermute_t_bound", "turbo_moe_unpermute", (spec((1, 0), F32), spec((BIG, 0), I32), spec((BIG, 0), F32)),
         (spec((BIG, 0), F32),), "unpermute: batch * T must be < 2^31"),
    # ---- unpermute_bwd: d_out (T, H), y (R, H), row_index, weights -> d_y, d_weights, workspace
    Case("unpermute_bwd_d_out", "turbo_moe_unpermute_bwd",
         (spec((4, 3), F32), spec((8, 4), F32), spec((4, 2), I32), spec((4, 2), F32)),
         (spec((8, 4), F32), spec((4, 2), F32), ws()), "unpermute_bwd: d_out must be [..., T, H]"),
    Case("unpermute_bwd_r_bound", "turbo_moe_unpermute_bwd",
         (spec((4, 0), F32), spec((BIG, 0), F32), spec((4, 2), I32), spec((4, 2), F32)),
         (spec((BIG, 0), F32), spec((4, 2), F32), ws()), "unpermute_bwd: batch * R must be < 2^31"),
    # ---- dispatch_pack: x (T, H), expert_ids (T, k), weights (T, k) -> send_x (P, C, H), ... slot (T, P)
    _dispatch("dispatch_dtype", "dispatch_pack: x must be float32/bfloat16/float16 and send_x the same dtype",
              sxdt=BF16),
    _dispatch("dispatch_attrs", "dispatch_pack: num_ranks, experts_per_rank > 0, capacity >= 0", El=0),
    _dispatch("dispatch_experts_bound", "dispatch_pack: num_ranks * experts_per_rank must be < 2^31", El=2**30),
    _dispatch("dispatch_results", "dispatch_pack: expected results send_x [..., P, C, H], send_ids and send_w "
              "[..., P, C, k], counts and overflow [..., P], slot [..., T, P]", counts=(3,)),
    # ---- fused_dispatch_pack: x (T, H), ids, weights (T, k), slot (T, P), dest_base (P, El) -> (P, C, H), 2x (P, C, k)
    _fused_pack("fused_pack_dtype", "fused_dispatch_pack: x must be float32/bfloat16/float16 and send_x the same dtype",
                sxdt=BF16),
    _fused_pack("fused_pack_rank", "fused_dispatch_pack: expected x [T, H], expert_ids [T, k], slot [T, P], "
                "dest_base [P, El]", x=(1, 4, 8)),
    _fused_pack("fused_pack_slot", "fused_dispatch_pack: expert_ids and weights must be [T, k], slot [T, P] with "
                "dest_base's P", slot=(4, 3)),
    _fused_pack("fused_pack_results", "fused_dispatch_pack: expected results send_x [P, C, H], send_rows and send_w "
                "[P, C, k]", rows=(2, 4, 2)),
    _fused_pack("fused_pack_rows_bound", "fused_dispatch_pack: P * C * k and recv_rows must be in [0, 2^31)", R=BIG),
    # ---- fused_dispatch_land: recv_x (N, H), recv_rows (N, k) -> x_sorted (R, H)
    _fused_land("fused_land_dtype", "fused_dispatch_land: recv_x must be float32/bfloat16/float16 and x_sorted the "
                "same dtype", odt=F16),
    _fused_land("fused_land_shape", "fused_dispatch_land: expected recv_x [N, H], recv_rows [N, k], x_sorted [R, H]",
                rows=(3, 2)),
    _fused_land("fused_land_bound", "fused_dispatch_land: R and N * k must be < 2^31", x=(4, 0), out=(BIG, 0)),
    # ---- router_topk: selection (B, S, E), bias (E,) -> expert_ids (B, S, k)
    _router("router_bias", "router_topk: bias must have E entries like selection's last dim", bias=(7,)),
    _router("router_ids", "router_topk: expert_ids must be [..., B, S, top_k]", ids=(2, 3, 3)),
    _router("router_experts_bound", "router_topk: the number of experts must be in [1, 4096]",
            sel=(1, 1, 4100), bias=(4100,), ids=(1, 1, 2)),
    _router("router_groups_bound", "router_topk: n_groups must be in [1, 64] and divide the number of experts",
            sel=(1, 1, 128), bias=(128,), ids=(1, 1, 2), n_groups=128, topk_groups=1),
    _router("router_top_k_bound", "router_topk: top_k must be in [1, min(32, experts of the topk_groups kept groups)]",
            sel=(1, 1, 64), bias=(64,), ids=(1, 1, 33), top_k=33, n_groups=1),
    _router("router_penalty", "router_topk: penalty must be finite and >= 0", penalty=float("nan")),
    _router("router_chunk", "router_topk: chunk and prior_tokens must be positive", chunk=0),
    # ---- segment_sum: data (N, D), sorted_ids (N,), order (N,) -> out (V, D)
    Case("segment_sum_dtype", "turbo_moe_segment_sum", (spec((6, 4), F32), spec((6,), I32), spec((6,), I32)),
         (spec((3, 4), F16),), "segment_sum: data must be float32/bfloat16/float16 and out the same dtype"),
    Case("segment_sum_rows", "turbo_moe_segment_sum", (spec((6, 4), F32), spec((5,), I32), spec((6,), I32)),
         (spec((3, 4), F32),), "segment_sum: sorted_ids and order must have data's N rows, out data's D columns"),
    Case("segment_sum_batch_dims", "turbo_moe_segment_sum",
         (spec((2, 6, 4), F32), spec((3, 6), I32), spec((2, 6), I32)), (spec((2, 3, 4), F32),),
         "segment_sum: data, sorted_ids, order and out must share leading (vmap) dims"),
    Case("segment_sum_v_bound", "turbo_moe_segment_sum", (spec((6, 0), F32), spec((6,), I32), spec((6,), I32)),
         (spec((BIG, 0), F32),), "segment_sum: N and V must be < 2^31"),
    Case("segment_sum_batch_bound", "turbo_moe_segment_sum",
         (spec((65536, 1, 0), F32), spec((65536, 1), I32), spec((65536, 1), I32)), (spec((65536, 1, 0), F32),),
         "segment_sum: at most 65535 leading (batch) problems"),
    # ---- swiglu_quantize: h (..., M, 2F), valid (...) -> q (..., M, F) fp8, scale (..., M, F/128) f32
    _swiglu_quantize("swiglu_quantize_dtype", "swiglu_quantize: h must be float32/bfloat16/float16", hdt=I32),
    _swiglu_quantize("swiglu_quantize_q_dtype", "swiglu_quantize: q must be float8_e4m3fn or float8_e5m2", qdt=U8),
    _swiglu_quantize("swiglu_quantize_scale_dtype", "swiglu_quantize: scale must be float32", sdt=BF16),
    _swiglu_quantize("swiglu_quantize_rank", "swiglu_quantize: expected h [..., M, 2F]", h=(512,), valid=(),
                     q=(256,), scale=(2,)),
    _swiglu_quantize("swiglu_quantize_width", "swiglu_quantize: h must be [..., M, 2F] with F a positive multiple "
                     "of 128 (the FP8 scale tiles), got a last dim of 384", h=(2, 3, 384)),
    _swiglu_quantize("swiglu_quantize_results",
                     "swiglu_quantize: expected results q [..., M, F] and scale [..., M, F/128]", q=(2, 3, 128)),
    _swiglu_quantize("swiglu_quantize_valid",
                     "swiglu_quantize: expected valid [...] (rows to compute of each [M, 2F] problem of h)", valid=(3,)),
    _permute_rows_fp8("permute_rows_fp8_dtype", "permute_rows_fp8: x must be float32/bfloat16/float16", xdt=jnp.int32),
    _permute_rows_fp8("permute_rows_fp8_q_dtype",
                      "permute_rows_fp8: q must be float8_e4m3fn or float8_e5m2 and scale float32", qdt=BF16),
    _permute_rows_fp8("permute_rows_fp8_rows", "permute_rows_fp8: expected result rows [..., T*k, H] of x's dtype",
                      rdt=BF16),
    _permute_rows_fp8("permute_rows_fp8_width", "permute_rows_fp8: x's H must be a positive multiple of 128 (the FP8 "
                      "scale tiles), got H=100", h=100),
    _combine_grad_fp8("combine_fp8_q_dtype", "swiglu_combine_grad_fp8: d_h_q must be float8_e4m3fn or float8_e5m2",
                      qdt=BF16),
    _combine_grad_fp8("combine_fp8_scale_dtype", "swiglu_combine_grad_fp8: d_h_scale must be float32", sdt=BF16),
    _combine_grad_fp8("combine_fp8_width", "swiglu_combine_grad_fp8: h's 2F must be a positive multiple of 128 (the "
                      "FP8 scale tiles), got 2F=64", F=32),
    _combine_grad_fp8("combine_fp8_results", "swiglu_combine_grad_fp8: expected results d_h_q [..., M, 2F] and "
                      "d_h_scale [..., M, 2F/128]", scale=(4, 2)),
]

# Every FFI target has its contract exercised.
ALL_TARGETS = set(_ffi.TARGETS + _ffi.CPU_ONLY_TARGETS)
assert {c.target for c in CASES} == ALL_TARGETS, ALL_TARGETS - {c.target for c in CASES}


def handler_message(error: Exception) -> str:
    """The handler's message inside XLA's error text (the backends wrap it differently)."""
    text = str(error)
    found = re.search(r"INVALID_ARGUMENT: ([^;\n]*)", text)
    assert found, f"not an invalid-argument error from a handler: {text}"
    return re.sub(r"\s*\[executable_name=[^]]*\]$", "", found.group(1).strip())  # the GPU runtime's suffix


def call_message(case: Case, device) -> str:
    """Runs the bad call on `device` and returns the handler's message (the call must fail)."""
    _ffi.ensure_registered()
    # A side effect, so that XLA never drops a call whose results are all empty (the zero-width cases).
    call = jax.ffi.ffi_call(case.target, case.results, has_side_effect=True)
    operands = [jax.device_put(jnp.zeros(o.shape, o.dtype), device) for o in case.operands]
    with pytest.raises(Exception) as info:
        jax.block_until_ready(jax.jit(lambda *a: call(*a, **case.attrs))(*operands))
        jax.effects_barrier()  # on a GPU the failure may surface only through the side effect's token
    _forget_failed_effects()
    return handler_message(info.value)


def _forget_failed_effects() -> None:
    """A failed side-effecting call leaves its runtime token failed, and JAX re-raises that error at every later
    barrier and at exit; tests that fail on purpose drop it (JAX's own clear_backends does the same)."""
    tokens = getattr(getattr(jax._src, "dispatch", None), "runtime_tokens", None)
    if tokens is not None and hasattr(tokens, "clear"):
        tokens.clear()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cpu_handler_refuses_with_the_contract_message(case):
    assert call_message(case, jax.devices("cpu")[0]) == case.message


# ---- through the public ops, where their Python checks let the call reach the handler -----------------------------

def test_permute_more_experts_than_the_kernels_take():
    x, ids = jnp.zeros((4, 8), F32), jnp.zeros((4, 2), I32)
    with pytest.raises(Exception) as info:
        jax.block_until_ready(ops.permute(x, ids, 8193)[0])
    assert handler_message(info.value) == "permute: num_experts must be <= 8192"
    assert ops.permute(x, ids, 8192)[1].shape == (8192,)  # the bound itself is accepted


def test_segment_sum_vmapped_past_the_batch_bound():
    data, ids = jnp.ones((65536, 3, 1), F32), jnp.zeros((65536, 3), I32)
    with pytest.raises(Exception) as info:
        jax.block_until_ready(jax.vmap(lambda d, i: ops.segment_sum(d, i, 2))(data, ids))
    assert handler_message(info.value) == "segment_sum: at most 65535 leading (batch) problems"
    out = jax.vmap(lambda d, i: ops.segment_sum(d, i, 2))(data[:65535], ids[:65535])
    np.testing.assert_array_equal(np.asarray(out[:2, :, 0]), [[3.0, 0.0], [3.0, 0.0]])
