"""GEMM sets: the grouped GEMMs an expert FFN runs, one frozen `GemmSet` per kind, all in one table.

A set holds the forward GEMM, its data and weight gradients and, optionally, the gate/up GEMM fused with SwiGLU:
    forward(rows (M, K), w (E, K, N), group_sizes (E,) int32, zero_tail=True) -> (M, N) = rows @ w[group of row]
        differentiable. zero_tail=False lets the rows past sum(group_sizes) stay unwritten, for a caller that reads
        only group rows (a set may zero them anyway).
    data_grad(d_out (M, N), w (E, K, N), group_sizes, zero_tail=True) -> (M, K) = d_out @ w[g]^T
    weight_grad(lhs (M, K), d_out (M, N), group_sizes) -> (E, K, N): lhs[rows_g]^T @ d_out[rows_g]
    gate_up_swiglu(rows (M, K), w (E, K, 2F), group_sizes) -> (h (M, 2F), act = SwiGLU(h) (M, F)), or None;
        rows past the groups unwritten.
    permute_forward(tokens (T, K), expert_ids int32 (T, k), E, w (E, K, N)) -> (out (T*k, N), group_sizes (E,),
        row_index (T, k)), or None: permute + forward for a set that reads its rows in its own format, forward only
        (`expert_block` uses it; its backward rebuilds the bf16 rows).
`ops.expert_block` and `ops.expert_ffn` take a set (or its name in GEMM_SETS); adding a GEMM is adding one set.

- `turbo`: `grouped_gemm` (our FFI kernels; CPU and CUDA), with `grouped_gemm_swiglu` fused.
- `ragged_dot`: `jax.lax.ragged_dot` (XLA; dense expansion on the GPU).
- `pallas`: jax's Pallas Mosaic-GPU `ragged_dot_mgpu` (`pallas_gemm`; Hopper only).
- `einsum`: the batched einsum of capacity slots (E, B, C, K) x (E, K, N); group_sizes is None (dense_cf).
- `fp8`: `grouped_gemm_fp8` (E4M3 with DeepSeek-V3's 1x128 / 128x128 scales; the CUTLASS kernel on Hopper, exact
  emulation elsewhere), gradients through its VJP (data gradients in FP8, weight gradients in FP8 or bf16 by its
  measured per-shape rule); K and N multiples of 128. In `expert_block` every FP8 row is written by its producer
  (`producer_quantized`): the permute's copy (`permute_fp8`), SwiGLU (`swiglu_quantize`), the backward's row gather of
  the output gradient (`permute_rows_fp8_call`) and SwiGLU's one-pass backward (`swiglu_combine_grad_fp8`); weights
  may come as `fp8_weights`, made once a step (docs/notes/fp8-end-to-end.md).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from turbo_moe.ops.grouped_gemm import grouped_gemm, grouped_gemm_weight_grad
from turbo_moe.ops.grouped_gemm_fp8 import (
    data_grad_fp8_quantized,
    forward_fp8_quantized,
    grouped_gemm_fp8,
    grouped_gemm_fp8_quantized,
)
from turbo_moe.ops.grouped_gemm_swiglu import grouped_gemm_swiglu
from turbo_moe.ops import pallas_gemm
from turbo_moe.ops.permute_fp8 import permute_fp8_call, permute_rows_fp8_call
from turbo_moe.ops.swiglu_combine_grad import swiglu_combine_grad_fp8
from turbo_moe.ops.swiglu_quantize import swiglu_quantize


@dataclasses.dataclass(frozen=True)
class ProducerQuantized:
    """The FP8 rows of a set whose GEMMs read them quantised by the kernels that produce them, so that no pass reads a
    bf16 tensor again only to quantise it (`expert_block` calls these instead of SwiGLU, the backward's row gather,
    SwiGLU's backward and the set's forward / data gradient on bf16 rows):
        swiglu(h (M, 2F), valid_rows) -> (act_q (M, F), act_scale (M, F/128)): SwiGLU written in FP8
        permute_rows(x (T, D), row_index, group_sizes, zero_tail) -> (rows, q, scale): the copy in bf16 and FP8
        swiglu_grad(h, g_act, w_rows, valid_rows) -> (d_h, d_h_q, d_h_scale, d_w_rows, act_w)
        forward(q, scale, w, group_sizes, out_dtype=...) -> (M, N);  data_grad(q, scale, w, group_sizes,
        out_dtype=...) -> (M, K) = d_out @ w[g]^T
    The gather and SwiGLU's backward are bit for bit their bf16 producers followed by `quantize_rows` (tests); SwiGLU's
    act is the fused kernels' float32 formula rounded to h's dtype (XLA's SwiGLU rounds its own way)."""

    swiglu: Callable
    permute_rows: Callable
    swiglu_grad: Callable
    forward: Callable
    data_grad: Callable


@dataclasses.dataclass(frozen=True)
class GemmSet:
    """One grouped GEMM with its gradients (signatures in the module docstring)."""

    name: str
    forward: Callable
    data_grad: Callable
    weight_grad: Callable
    gate_up_swiglu: Callable | None = None
    # Why the default devices cannot run the set, or None: checked at trace time (`unavailable`).
    device_problem: Callable[[], "str | None"] = lambda: None
    permute_forward: Callable | None = None
    # K and N of every GEMM (the FFN's widths D and F) must be multiples of this (fp8: its 128-wide scale tiles).
    width_multiple: int = 1
    # The block's backward runs SwiGLU's gradient as one kernel pass (`swiglu_combine_grad`) though the forward has no
    # fused gate/up + SwiGLU (sets with `gate_up_swiglu` always do).
    swiglu_backward_kernel: bool = False
    # FP8 rows written by their producers (`ProducerQuantized`); implies the one-pass SwiGLU backward.
    producer_quantized: ProducerQuantized | None = None

    def without_fused_swiglu(self) -> "GemmSet":
        """The same GEMMs with SwiGLU left to XLA (`ModelConfig`'s CPU default: its fusion is faster there)."""
        return dataclasses.replace(self, gate_up_swiglu=None, swiglu_backward_kernel=False, producer_quantized=None)


def gradients_by_autodiff(forward: Callable) -> tuple[Callable, Callable]:
    """(data_grad, weight_grad) of a differentiable forward, through its VJP (for the XLA GEMMs)."""

    def data_grad(d_out, w, group_sizes, zero_tail=True):
        rows = jax.ShapeDtypeStruct(d_out.shape[:-1] + (w.shape[-2],), d_out.dtype)
        _, vjp = jax.vjp(lambda r: forward(r, w, group_sizes, zero_tail), jnp.zeros(rows.shape, rows.dtype))
        return vjp(d_out)[0]

    def weight_grad(lhs, d_out, group_sizes):
        n_groups = lhs.shape[0] if group_sizes is None else jnp.shape(group_sizes)[0]  # None: slots (E, ..., K)
        shape = (n_groups, lhs.shape[-1], d_out.shape[-1])
        _, vjp = jax.vjp(lambda w: forward(lhs, w, group_sizes), jnp.zeros(shape, lhs.dtype))
        return vjp(d_out)[0]

    return data_grad, weight_grad


def _turbo_forward(rows, w, group_sizes, zero_tail=True):
    return grouped_gemm(rows, w, group_sizes, zero_tail=zero_tail)  # (M, K) x (E, K, N) -> (M, N)


def _turbo_data_grad(d_out, w, group_sizes, zero_tail=True):
    return grouped_gemm(d_out, w, group_sizes, transpose_rhs=True, zero_tail=zero_tail)  # (M, N) x (E, K, N)^T


def _turbo_gate_up_swiglu(rows, w, group_sizes):
    return grouped_gemm_swiglu(rows, w, group_sizes, zero_tail=False)  # (M, K) x (E, K, 2F) -> (M, 2F), (M, F)


def _ragged_dot_forward(rows, w, group_sizes, zero_tail=True):
    del zero_tail  # XLA writes every row
    return jax.lax.ragged_dot(rows, w, group_sizes)  # (M, K) x (E, K, N) -> (M, N)


def _pallas_forward(rows, w, group_sizes, zero_tail=True):
    del zero_tail  # rows past the groups are masked to zero
    return pallas_gemm.pallas_grouped_gemm(rows, w, group_sizes)  # (M, K) x (E, K, N) -> (M, N)


def _pallas_problem() -> str | None:
    problem = pallas_gemm.hopper_problem()  # looked up at call time (tests stand in for the device)
    return problem and ("its GEMM is jax's Pallas Mosaic-GPU ragged_dot_mgpu, which needs a Hopper GPU "
                        f"(sm_90, e.g. H100/H200); {problem}")


def _einsum_forward(slots, w, group_sizes, zero_tail=True):
    del group_sizes, zero_tail  # every slot of expert e is multiplied by w[e]; empty slots are zero rows
    return jnp.einsum("ebck,ekn->ebcn", slots, w)  # (E, B, C, K) x (E, K, N) -> (E, B, C, N)


def _fp8_forward(rows, w, group_sizes, zero_tail=True):
    del zero_tail  # rows past the groups are written as zeros
    return grouped_gemm_fp8(rows, w, group_sizes)  # (M, K) x (E, K, N) -> (M, N), FP8 products, float32 sums


def _fp8_permute_forward(tokens, expert_ids, n_experts, w):
    with jax.named_scope("permute"):  # the rows are written once, in FP8 with their scales: never in bf16
        q, scale, group_sizes, row_index = permute_fp8_call(tokens, expert_ids, n_experts)
    with jax.named_scope("grouped_gemm"):
        return grouped_gemm_fp8_quantized(q, scale, w, group_sizes), group_sizes, row_index


def _set(name, forward, **kw) -> GemmSet:
    data_grad, weight_grad = gradients_by_autodiff(forward)
    return GemmSet(name, forward, kw.pop("data_grad", data_grad), kw.pop("weight_grad", weight_grad), **kw)


GEMM_SETS: dict[str, GemmSet] = {s.name: s for s in (
    _set("turbo", _turbo_forward, data_grad=_turbo_data_grad, weight_grad=grouped_gemm_weight_grad,
         gate_up_swiglu=_turbo_gate_up_swiglu),
    _set("ragged_dot", _ragged_dot_forward),
    _set("pallas", _pallas_forward, device_problem=_pallas_problem),
    _set("einsum", _einsum_forward),
    _set("fp8", _fp8_forward, permute_forward=_fp8_permute_forward, width_multiple=128, swiglu_backward_kernel=True,
         producer_quantized=ProducerQuantized(swiglu_quantize, permute_rows_fp8_call, swiglu_combine_grad_fp8,
                                              forward_fp8_quantized, data_grad_fp8_quantized)),
)}


def gemm_set(gemms: "GemmSet | str", argument: str = "gemms") -> GemmSet:
    """A GemmSet, or the set of that name in GEMM_SETS (ValueError naming `argument` otherwise)."""
    if isinstance(gemms, GemmSet):
        return gemms
    if isinstance(gemms, str) and gemms in GEMM_SETS:
        return GEMM_SETS[gemms]
    raise ValueError(f"{argument} must be a GemmSet or one of {tuple(GEMM_SETS)}, got {gemms!r}")
