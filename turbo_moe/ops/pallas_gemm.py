"""Grouped GEMM on jax's Pallas Mosaic-GPU kernels (Hopper only): a drop-in for `jax.lax.ragged_dot`.

forward and dgrad: `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` (dgrad with
`transpose_rhs`); wgrad: `transposed_ragged_dot_mgpu.transposed_ragged_dot` (the ragged dimension is
the contraction). Same runtime semantics as `turbo_moe.ops.grouped_gemm`: negative sizes count as 0,
the layout is clamped to M, rows past sum(group_sizes) are zero (the kernel leaves them unwritten, so
they are masked here), empty groups give zero weight gradients.

The kernels want K a multiple of block_k, N of block_n and (wgrad) the weight dims of block_m/block_n;
ragged row groups need no alignment (the kernel's tiles follow group boundaries). Dimensions that do
not divide are zero-padded here (a copy; MoE shapes such as `reduced`'s divide, so nothing is padded).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops.varying import make_varying, match_varying, varying_axes

# The tiles benchmarks/grouped_gemm.py measured on an H100 (as jax's own example tunes them).
BLOCKS = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=8)
DTYPES = (jnp.bfloat16, jnp.float16)  # wgmma operand types the kernels are written for


def hopper_problem() -> str | None:
    """Why the default devices cannot run the kernels (None on a Hopper GPU)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return f"the default device is {device.device_kind!r} (platform {device.platform})"
    capability = str(getattr(device, "compute_capability", "unknown"))
    if not capability.startswith("9."):
        return f"the default device is {device.device_kind!r} (compute capability {capability}, not 9.x)"
    return None


def pallas_grouped_gemm(lhs, rhs, group_sizes, *, preferred_element_type=None, precision=None):
    """(M, K) x (G, K, N) -> (M, N): row group g (group_sizes[g] rows) times rhs[g]; as `jax.lax.ragged_dot`.

    lhs, rhs: bfloat16 or float16 (promoted to one type). group_sizes: int (G,). preferred_element_type:
    output dtype (accumulation is float32, the kernel rounds to the input type first). precision: ignored.
    Differentiable in lhs and rhs. Raises ValueError at trace time unless the default device is Hopper.
    """
    del precision
    _checks.check_rank("lhs", lhs, 2, "(M, K)")
    _checks.check_rank("rhs", rhs, 3, "(G, K, N)")
    _checks.check_rank("group_sizes", group_sizes, 1, "(G,)")
    _checks.check_integer("group_sizes", group_sizes)
    compute = jnp.promote_types(lhs.dtype, rhs.dtype)
    if compute not in [jnp.dtype(d) for d in DTYPES]:
        raise TypeError(f"lhs/rhs: the Pallas Mosaic-GPU grouped GEMM takes bfloat16 or float16, got "
                        f"{lhs.dtype} and {rhs.dtype} (run the model with dtype='bfloat16')")
    if rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"rhs (G, K, N) has K={rhs.shape[1]} but lhs (M, K) has K={lhs.shape[1]}")
    if group_sizes.shape[0] != rhs.shape[0]:
        raise ValueError(f"group_sizes must have shape (G,) = ({rhs.shape[0]},), got {group_sizes.shape}")
    problem = hopper_problem()
    if problem:
        raise ValueError(f"pallas_grouped_gemm needs a Hopper GPU (sm_90) for jax's Mosaic-GPU kernels; {problem}")
    out = _pallas_gemm(lhs.astype(compute), rhs.astype(compute), _checks.as_int32(group_sizes))
    return out if preferred_element_type is None else out.astype(preferred_element_type)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_to(a, multiples):
    """Zero-pads each dim of `a` up to a multiple of `multiples[i]` (1: left alone)."""
    pads = [(0, _round_up(n, m) - n) for n, m in zip(a.shape, multiples)]
    return jnp.pad(a, pads) if any(hi for _, hi in pads) else a


def _clamped_sizes(group_sizes, m: int):
    """(sizes (G,), total ()) with negative sizes as 0 and the cumulative layout clamped to M."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), m)
    return jnp.diff(ends, prepend=0).astype(jnp.int32), ends[-1]


def _typed(fn, *args):
    """Runs a kernel on operands of one shard_map varying type and types its result alike
    (pallas_call results carry no varying axes; the kernels are per-shard anyway)."""
    axes = frozenset().union(*(varying_axes(a) for a in args))
    out = fn(*(make_varying(a, axes) for a in args))
    return make_varying(out, axes)


def _ragged(lhs, rhs, group_sizes, transpose_rhs: bool):
    """(M, K) x (G, K, N) (or (G, N, K) when transpose_rhs) -> (M, N); rows past the groups zero."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bn, bk = BLOCKS["block_m"], BLOCKS["block_n"], BLOCKS["block_k"]
    sizes, total = _clamped_sizes(group_sizes, m)
    lhs_p = _pad_to(lhs, (bm, bk))  # padded rows are in no group
    rhs_p = _pad_to(rhs, (1, bn, bk) if transpose_rhs else (1, bk, bn))
    kernel = functools.partial(ragged_dot_mgpu.ragged_dot, transpose_rhs=transpose_rhs, **BLOCKS)
    out = _typed(lambda a, b, s: kernel(a, b, group_sizes=s), lhs_p, rhs_p, sizes)[:m, :n]  # (M, N)
    rows = jax.lax.broadcasted_iota(jnp.int32, (m, 1), 0)
    return jnp.where(rows < total, out, jnp.zeros((), out.dtype))  # unwritten rows -> 0


def _wgrad(lhs, d_out, group_sizes):
    """(M, K), (M, N) -> (G, K, N): lhs[rows_g]^T @ d_out[rows_g]; empty groups give zeros."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    m, k = lhs.shape
    n = d_out.shape[1]
    bm, bn, bk = BLOCKS["block_m"], BLOCKS["block_n"], BLOCKS["block_k"]
    sizes, _ = _clamped_sizes(group_sizes, m)
    # The ragged (row) dim is the kernel's contraction, read in block_k tiles; K, N are its output tiles.
    lhs_p, d_out_p = _pad_to(lhs, (bk, bm)), _pad_to(d_out, (bk, bn))
    kernel = functools.partial(transposed_ragged_dot_mgpu.transposed_ragged_dot, **BLOCKS)
    return _typed(lambda a, b, s: kernel(a, b, group_sizes=s), lhs_p, d_out_p, sizes)[:, :k, :n]


@jax.custom_vjp
def _pallas_gemm(lhs, rhs, group_sizes):
    return _ragged(lhs, rhs, group_sizes, transpose_rhs=False)


def _pallas_gemm_fwd(lhs, rhs, group_sizes):
    return _ragged(lhs, rhs, group_sizes, transpose_rhs=False), (lhs, rhs, group_sizes)


def _pallas_gemm_bwd(residuals, d_out):
    lhs, rhs, group_sizes = residuals
    d_out = d_out.astype(lhs.dtype)  # (M, N)
    d_lhs = _ragged(d_out, rhs, group_sizes, transpose_rhs=True)  # (M, K) = d_out @ rhs[g]^T per group
    d_rhs = _wgrad(lhs, d_out, group_sizes).astype(rhs.dtype)  # (G, K, N)
    return match_varying(d_lhs, lhs), match_varying(d_rhs, rhs), None


_pallas_gemm.defvjp(_pallas_gemm_fwd, _pallas_gemm_bwd)
