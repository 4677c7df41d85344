"""The expert GEMMs a MoE path can pair with an exchange: `gemm(rows, w (E, K, N), group_sizes) -> out`.

- `ragged_dot`: `jax.lax.ragged_dot` (XLA; dense expansion on the GPU).
- `turbo`: `turbo_moe.ops.grouped_gemm` (our FFI kernels; CPU and CUDA).
- `einsum`: the batched einsum of capacity slots (E, B, C, K) x (E, K, N); group_sizes is None.
- `pallas`: jax's Pallas Mosaic-GPU `ragged_dot_mgpu` (`turbo_moe.ops.pallas_gemm`; Hopper only).

`SWIGLU_KERNELS[name]`: the GEMMs that the expert block's SwiGLU kernels (`swiglu_impl="kernel"`) pair with: the
gate/up GEMM and SwiGLU as one call returning (h, act), and the down GEMM's data and weight gradients as separate
calls (the weight gradient's lhs, act * w, comes out of `ops.swiglu_combine_grad`, which needs the data gradient),
and the block's other GEMMs. They leave the rows past the groups unwritten (`zero_tail=False`): the expert block
reads only group rows, and under expert parallelism its buffers are the dropless worst case, P * T * k rows of
which ~T * k are real (zero-filling the rest cost more than the GEMMs at EP=4: docs/performance.md).

`require(name, moe_path)` raises at trace time when the devices cannot run a GEMM.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from turbo_moe.model.experts import GroupedGemm


def ragged_dot_gemm(rows, w, group_sizes):
    return jax.lax.ragged_dot(rows, w, group_sizes)  # (M, K) x (E, K, N) -> (M, N)


def turbo_gemm(rows, w, group_sizes):
    from turbo_moe import ops  # imported here so the other GEMMs work without the FFI library

    return ops.grouped_gemm(rows, w, group_sizes)  # (M, K) x (E, K, N) -> (M, N)


def einsum_gemm(slots, w, group_sizes):
    del group_sizes  # every slot of expert e is multiplied by w[e]; empty slots are zero rows
    return jnp.einsum("ebck,ekn->ebcn", slots, w)  # (E, B, C, K) x (E, K, N) -> (E, B, C, N)


def pallas_gemm(rows, w, group_sizes):
    from turbo_moe.ops.pallas_gemm import pallas_grouped_gemm

    return pallas_grouped_gemm(rows, w, group_sizes)  # (M, K) x (E, K, N) -> (M, N)


def turbo_gate_up_swiglu(rows, w, group_sizes):
    from turbo_moe import ops

    # (M, K) x (E, K, 2F) -> (M, 2F), (M, F)
    return ops.grouped_gemm_swiglu(rows, w, group_sizes, zero_tail=False)


def turbo_data_grad(d_out, w, group_sizes):
    from turbo_moe import ops

    # (M, N) x (E, K, N)^T -> (M, K)
    return ops.grouped_gemm(d_out, w, group_sizes, transpose_rhs=True, zero_tail=False)


def turbo_weight_grad(lhs, d_out, group_sizes):
    from turbo_moe import ops

    return ops.grouped_gemm_weight_grad(lhs, d_out, group_sizes)  # (M, K), (M, N) -> (E, K, N)


def turbo_gemm_group_rows(rows, w, group_sizes):
    from turbo_moe import ops

    return ops.grouped_gemm(rows, w, group_sizes, zero_tail=False)  # (M, K) x (E, K, N) -> (M, N)


class SwigluKernels(NamedTuple):
    gate_up_swiglu: Callable  # (rows, w_gate_up, group_sizes) -> (h, act = SwiGLU(h))
    data_grad: Callable  # (d_out, w, group_sizes) -> d_out @ w[g]^T
    weight_grad: Callable  # (lhs, d_out, group_sizes) -> lhs[rows_g]^T @ d_out[rows_g]
    gemm: Callable  # (rows, w, group_sizes) -> rows @ w[g], differentiable; rows past the groups unwritten


SWIGLU_KERNELS = {"turbo": SwigluKernels(turbo_gate_up_swiglu, turbo_data_grad, turbo_weight_grad,
                                         turbo_gemm_group_rows)}


def swiglu_kernels(gemm: str, swiglu_impl: str) -> SwigluKernels | None:
    """The SwiGLU kernels `ModelConfig.swiglu_impl` asks of GEMM `gemm`, or None (XLA's SwiGLU): "kernel" where the GEMM
    has them, "auto" only on GPUs too (decided at trace time, like attention_impl "cudnn_unpadded")."""
    if swiglu_impl == "kernel" or (swiglu_impl == "auto" and jax.default_backend() == "gpu"):
        return SWIGLU_KERNELS.get(gemm)
    return None

GEMMS: dict[str, GroupedGemm] = {
    "ragged_dot": ragged_dot_gemm,
    "turbo": turbo_gemm,
    "einsum": einsum_gemm,
    "pallas": pallas_gemm,
}


def require(gemm: str, moe_path: str) -> None:
    """ValueError naming `moe_path` when the default devices cannot run `gemm` (checked at trace time)."""
    if gemm == "pallas":
        from turbo_moe.ops.pallas_gemm import hopper_problem

        problem = hopper_problem()
        if problem:
            raise ValueError(f"moe_path={moe_path!r}: its GEMM is jax's Pallas Mosaic-GPU ragged_dot_mgpu, "
                             f"which needs a Hopper GPU (sm_90, e.g. H100/H200); {problem}. "
                             "Use moe_path='turbo' or 'ragged' here.")
