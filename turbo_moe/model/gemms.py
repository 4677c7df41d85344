"""The expert GEMMs a MoE path can pair with an exchange: `gemm(rows, w (E, K, N), group_sizes) -> out`.

- `ragged_dot`: `jax.lax.ragged_dot` (XLA; dense expansion on the GPU).
- `turbo`: `turbo_moe.ops.grouped_gemm` (our FFI kernels; CPU and CUDA).
- `einsum`: the batched einsum of capacity slots (E, B, C, K) x (E, K, N); group_sizes is None.
- `pallas`: jax's Pallas Mosaic-GPU `ragged_dot_mgpu` (`turbo_moe.ops.pallas_gemm`; Hopper only).

`GATE_UP_SWIGLU[name]`: the GEMMs that also come as one call returning (h, act = SwiGLU(h)) for the gate/up weights.

`require(name, moe_path)` raises at trace time when the devices cannot run a GEMM.
"""

from __future__ import annotations

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

    return ops.grouped_gemm_swiglu(rows, w, group_sizes)  # (M, K) x (E, K, 2F) -> (M, 2F), (M, F)


GATE_UP_SWIGLU = {"turbo": turbo_gate_up_swiglu}

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
