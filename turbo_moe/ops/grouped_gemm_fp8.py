"""FP8 grouped GEMM with DeepSeek-V3's fine-grained scaling (technical report, section 3.3).

`grouped_gemm_fp8(lhs, rhs, group_sizes)` computes what `grouped_gemm` does, (M, K) x (G, K, N) -> (M, N), with both
operands quantised to FP8 E4M3 on the way in:

- activations (lhs) per 1x128 tile along K, one float32 scale per row and 128 columns;
- weights (rhs) per 128x128 block, one float32 scale per block;
- the product accumulates in float32, each 128-deep K block's partial sum scaled and added into the float32
  accumulator ("promotion" every 128 elements of K, which per-128 scales need anyway).

The backward pass follows the report too: the data gradient quantises the output gradient per 1x128 tile (along N,
its contraction) against the same 128x128 weight blocks; the weight gradient quantises the activations and the output
gradient per 128x1 tile (128 rows of one column, the rows being its contraction), each group's rows padded to a
multiple of 128 so that no tile spans two groups. E5M2 may be chosen for the gradients (`grad_dtype`).

Implementations (`impl`): "auto" runs the Hopper kernel (kernels/cuda/grouped_gemm_fp8.cu) on a CUDA device and the
emulated path elsewhere; "emulated" always runs the emulated path. The emulated path quantises exactly as the kernel's
callers do (the same code, bit-exact FP8 values and scales; the float8 dtypes are ml_dtypes'), dequantises to
float32 and runs the float32 grouped GEMM kernels: it is the same math up to float32 summation order. It is jnp rather
than a C++ handler because the only FP8-specific work on the CPU is elementwise (quantise, dequantise), which XLA
fuses; the product is the existing float32 kernel. The one quantiser that is not elementwise, the weight gradient's
128x1 tiles in the group-padded layout, is an FFI op on every platform (`ops.quantize_group_columns`, bit-identical to
its jnp reference `quantize_group_columns_xla`). E5M2 gradients run the emulated product on every platform (the
CUDA kernel takes E4M3 only).

`grouped_gemm_fp8_quantized(lhs_q, lhs_scale, rhs, group_sizes)` takes rows already quantised per 1x128 tile (by
`permute_fp8`, in the permute's row copy). Both ops quantise the weights once per call: the forward's blocks, saved,
are the data gradient's too.

Differences from `grouped_gemm`: K and N must be multiples of 128; no vmap, `group_offset` or `transpose_rhs`; the
CUDA kernel writes bfloat16, so a float32 result on the GPU carries bfloat16 rounding (the emulated path's float32
result does not). Rows past sum(group_sizes) are zero.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call, workspace
from turbo_moe.ops.grouped_gemm import _check_array as check_array
from turbo_moe.ops.grouped_gemm import (
    clamped_sizes,
    grouped_gemm,
    grouped_gemm_weight_grad,
)
from turbo_moe.ops.quantize_group_columns import padded_rows, quantize_group_columns  # noqa: F401  (re-exported)

BLOCK = 128  # the scale tile along the contraction, and the weights' block edge
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
FP8_DTYPES = (E4M3, E5M2)
F32 = jnp.dtype(jnp.float32)
IMPLS = ("auto", "emulated")


# ----------------------------------------------------------------------------------------------------------------
# Quantisers: x ~= q * scale, |q| <= the format's largest finite value (amax of the tile maps onto it)

def _fp8_dtype(name: str, dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {dtype}")
    return dtype


def _scale_of(amax, fmax: float):
    """amax * (1/fmax) in float32; 1 for an all-zero tile. The quantisers then multiply by 1/scale: both spelled as
    the products XLA rewrites a division by a broadcast into, so the jitted and eager results and numpy agree bit for
    bit (a division rounds some ties of the FP8 cast differently)."""
    return jnp.where(amax > 0, amax * jnp.float32(1.0 / fmax), jnp.float32(1.0)).astype(F32)


def _quantize_tiles(t, axis: int, dtype):
    """t float32 with 128-wide tiles along `axis` -> (q, scale with `axis` reduced)."""
    fmax = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(t), axis=axis)
    scale = _scale_of(amax, fmax)
    q = jnp.clip(t * jnp.expand_dims(1.0 / scale, axis), -fmax, fmax).astype(dtype)
    return q, scale


def quantize_rows(x, dtype=E4M3):
    """Activations per 1x128 tile: x (M, K), K % 128 == 0 -> q (M, K) fp8, scale (M, K/128) float32."""
    dtype = _fp8_dtype("dtype", dtype)
    m, k = x.shape
    q, scale = _quantize_tiles(x.astype(F32).reshape(m, k // BLOCK, BLOCK), 2, dtype)
    return q.reshape(m, k), scale


def quantize_blocks(w, dtype=E4M3, *, transpose: bool = False):
    """Weights per 128x128 block: w (G, K, N), K, N % 128 == 0 -> q (G, K, N) fp8 ((G, N, K) with `transpose`, the
    forward kernel's K-contiguous layout; the values are the same), scale (G, K/128, N/128) float32."""
    dtype = _fp8_dtype("dtype", dtype)
    g, k, n = w.shape
    t = w.astype(F32).reshape(g, k // BLOCK, BLOCK, n // BLOCK, BLOCK)
    fmax = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(t), axis=(2, 4))  # (G, K/128, N/128)
    scale = _scale_of(amax, fmax)
    q = jnp.clip(t * (1.0 / scale)[:, :, None, :, None], -fmax, fmax).astype(dtype).reshape(g, k, n)
    return (jnp.swapaxes(q, 1, 2) if transpose else q), scale


def quantize_group_columns_xla(x, group_sizes, dtype=E4M3):
    """`quantize_group_columns` in jnp, the reference its kernels match bit for bit (tests, benchmarks): x (M, C),
    int32 group_sizes (G >= 1,) -> q_t (C, P) fp8, scale (P/128, C) float32. Group g's rows start at column
    sum_{h<g} ceil(size_h / 128) * 128 of q_t (sizes clamped as the forward clamps them); padding and rows past the
    groups are zero. XLA runs it as a gather into a float32 (P, C) copy, a reduction and a transpose."""
    dtype = _fp8_dtype("dtype", dtype)
    m, c = x.shape
    n_groups = group_sizes.shape[0]
    p = padded_rows(m, n_groups)
    sizes = clamped_sizes(group_sizes, m)  # (G,)
    padded = -(-sizes // BLOCK) * BLOCK
    padded_ends = jnp.cumsum(padded)
    # A gather (row p of the padded layout reads its source row, or zero), not a scatter: XLA's GPU gathers are fast.
    slots = jnp.arange(p)
    group = jnp.minimum(jnp.searchsorted(padded_ends, slots, side="right"), n_groups - 1)
    local = slots - (padded_ends - padded)[group]
    src = jnp.cumsum(sizes)[group] - sizes[group] + local
    x_pad = jnp.where((local < sizes[group])[:, None], x[jnp.where(local < sizes[group], src, 0)].astype(F32), 0.0)
    q, scale = _quantize_tiles(x_pad.reshape(p // BLOCK, BLOCK, c), 1, dtype)
    return q.reshape(p, c).T, scale


def dequantize_rows(q, scale):
    return q.astype(F32) * jnp.repeat(scale, BLOCK, axis=-1)


def dequantize_blocks(q, scale):
    """q (G, K, N), scale (G, K/128, N/128) -> (G, K, N) float32."""
    return q.astype(F32) * jnp.repeat(jnp.repeat(scale, BLOCK, axis=1), BLOCK, axis=2)


def _materialized(*fp8_arrays):
    """The FP8 values as such: without the barrier, XLA's GPU compiler (which allows excess precision by default)
    folds a float32 -> fp8 -> float32 round trip into the float32 value, and the emulation would skip the rounding."""
    return jax.lax.optimization_barrier(fp8_arrays)


# ----------------------------------------------------------------------------------------------------------------
# The two products on quantised operands (the kernels' contracts), emulated or on the Hopper kernel

def rows_product(lhs_q, lhs_scale, rhs_q_t, rhs_scale, group_sizes, *, out_dtype=F32, impl: str = "auto"):
    """(M, K) fp8 x (G, N, K) fp8 -> (M, N) out_dtype (the kernel's values are bfloat16): out[r] = deq(lhs)[r] @
    deq(rhs)[g(r)]^T with lhs_scale (M, K/128) and rhs_scale (G, K/128, N/128)."""
    def emulated(lq, ls, rq, rs, gs):
        lq, rq = _materialized(lq, rq)
        rhs = dequantize_blocks(jnp.swapaxes(rq, 1, 2), rs)  # (G, K, N)
        return grouped_gemm(dequantize_rows(lq, ls), rhs, gs, preferred_element_type=F32).astype(out_dtype)

    def kernel(lq, ls, rq, rs, gs):
        m, n, n_groups = lq.shape[0], rq.shape[1], rq.shape[0]
        out, _ = ffi_call("turbo_moe_grouped_gemm_fp8",
                          (jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
                           workspace("turbo_moe_grouped_gemm_fp8_workspace_bytes", n_groups, 0)),
                          lq, ls, rq, rs, gs)
        return out.astype(out_dtype)

    args = (lhs_q, lhs_scale, rhs_q_t, rhs_scale, group_sizes)
    if impl == "emulated" or lhs_q.dtype != E4M3 or rhs_q_t.dtype != E4M3:
        return emulated(*args)
    return jax.lax.platform_dependent(*args, cuda=kernel, default=emulated)


def weight_grad_product(lhs_t, lhs_t_scale, d_out_t, d_out_t_scale, group_sizes, rows: int, *, out_dtype=F32,
                        impl: str = "auto"):
    """(K, P) fp8, (N, P) fp8 in the group-padded layout of `quantize_group_columns` -> (G, K, N) out_dtype (the
    kernel's values are bfloat16): d_rhs[g] = deq(lhs_t)[:, cols_g] @ deq(d_out_t)[:, cols_g]^T."""
    def emulated(lq, ls, dq, ds, gs):
        lq, dq = _materialized(lq, dq)
        lhs = (lq.astype(F32).T.reshape(-1, BLOCK, lq.shape[0]) * ls[:, None, :]).reshape(-1, lq.shape[0])  # (P, K)
        d_out = (dq.astype(F32).T.reshape(-1, BLOCK, dq.shape[0]) * ds[:, None, :]).reshape(-1, dq.shape[0])
        padded = -(-clamped_sizes(gs, rows) // BLOCK) * BLOCK  # (G,): zero padding rows, summed as zeros
        return grouped_gemm_weight_grad(lhs, d_out, padded, preferred_element_type=F32).astype(out_dtype)

    def kernel(lq, ls, dq, ds, gs):
        k, n, n_groups = lq.shape[0], dq.shape[0], gs.shape[0]
        out, _ = ffi_call("turbo_moe_grouped_gemm_fp8_weight_grad",
                          (jax.ShapeDtypeStruct((n_groups, k, n), jnp.bfloat16),
                           workspace("turbo_moe_grouped_gemm_fp8_workspace_bytes", n_groups, 1)),
                          lq, ls, dq, ds, gs, rows=np.int64(rows))
        return out.astype(out_dtype)

    args = (lhs_t, lhs_t_scale, d_out_t, d_out_t_scale, group_sizes)
    if impl == "emulated" or lhs_t.dtype != E4M3 or d_out_t.dtype != E4M3:
        return emulated(*args)
    return jax.lax.platform_dependent(*args, cuda=kernel, default=emulated)


# ----------------------------------------------------------------------------------------------------------------
# The op

def _check_rhs(k: int, lhs_name: str, lhs_shape, rhs, group_sizes) -> None:
    """rhs (G, K, N) and group_sizes (G,) against the rows' K; K and N multiples of 128."""
    for name, x in (("rhs", rhs), ("group_sizes", group_sizes)):
        check_array(name, x)
    _checks.check_rank("rhs", rhs, 3, "(G, K, N)")
    _checks.check_rank("group_sizes", group_sizes, 1, "(G,)")
    _checks.check_integer("group_sizes", group_sizes)
    _checks.float_dtype("rhs", rhs.dtype)
    n_groups, rhs_k, n = rhs.shape
    if rhs_k != k:
        raise ValueError(f"rhs (G, K, N) has K={rhs_k} but {lhs_name} has K={k} ({lhs_name.split()[0]} {lhs_shape}, "
                         f"rhs {rhs.shape})")
    if k % BLOCK or k == 0:
        raise ValueError(f"{lhs_name} must have K a positive multiple of {BLOCK} (the FP8 scale tiles), got K={k}")
    if n % BLOCK:
        raise ValueError(f"rhs (G, K, N) must have N a multiple of {BLOCK} (the 128x128 weight blocks), got N={n}")
    if n_groups == 0:
        raise ValueError(f"rhs (G, K, N) must hold at least one group, got {rhs.shape}")
    if group_sizes.shape[0] != n_groups:
        raise ValueError(f"group_sizes must have shape (G,) = ({n_groups},) to match rhs {rhs.shape}, "
                         f"got {group_sizes.shape}")


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def grouped_gemm_fp8(lhs, rhs, group_sizes, *, preferred_element_type=None, grad_dtype=E4M3, impl: str = "auto"):
    """(M, K) x (G, K, N) -> (M, N) in FP8 with DeepSeek-V3's scaling; differentiable in lhs and rhs (custom VJP).

    Args:
      lhs: (M, K) bfloat16/float16/float32 rows sorted by group; K % 128 == 0.
      rhs: (G, K, N) bfloat16/float16/float32 weights; N % 128 == 0.
      group_sizes: integer (G,) rows per group, on the device (negative counts as 0, clamped to M as in grouped_gemm).
      preferred_element_type: output dtype, bfloat16/float16/float32; default the promoted input dtype.
      grad_dtype: FP8 format of the output gradient in the backward pass: float8_e4m3fn (DeepSeek-V3's choice, the
        default) or float8_e5m2.
      impl: "auto" (the Hopper kernel on CUDA, emulated elsewhere) or "emulated".
    Returns:
      (M, N); rows past sum(group_sizes) are zero. Gradients have lhs's and rhs's dtypes.
    """
    check_array("lhs", lhs)
    _checks.check_rank("lhs", lhs, 2, "(M, K)")
    _checks.float_dtype("lhs", lhs.dtype)
    _check_rhs(lhs.shape[1], "lhs (M, K)", lhs.shape, rhs, group_sizes)
    out_dtype = jnp.promote_types(lhs.dtype, rhs.dtype) if preferred_element_type is None else _checks.float_dtype(
        "preferred_element_type", preferred_element_type)
    grad_dtype = _fp8_dtype("grad_dtype", grad_dtype)
    _check_impl(impl)
    return _fp8_gemm(lhs, rhs, _checks.as_int32(group_sizes), jnp.dtype(out_dtype), grad_dtype, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fp8_gemm(lhs, rhs, group_sizes, out_dtype, grad_dtype, impl):
    return _fp8_gemm_fwd(lhs, rhs, group_sizes, out_dtype, grad_dtype, impl)[0]


def _fp8_gemm_fwd(lhs, rhs, group_sizes, out_dtype, grad_dtype, impl):
    lq, ls = quantize_rows(lhs)
    out, weights = _quantized_weights_product(lq, ls, rhs, group_sizes, out_dtype, impl)
    # Residuals: lhs (the weight gradient quantises it per 128x1; DeepSeek-V3 caches it in FP8 instead) and the
    # quantised weights, which the data gradient reads in their (G, K, N) layout: quantised once per call.
    return out, (lhs, weights, group_sizes, rhs[:0])


def _quantized_weights_product(lq, ls, rhs, group_sizes, out_dtype, impl):
    """rows (lq, ls) x rhs quantised per 128x128 block -> (out, (wq (G, K, N), ws)); the forward kernel reads the
    blocks K-contiguous, (G, N, K): the same values transposed (a 128x128 block's scale is transpose-invariant)."""
    wq, ws = quantize_blocks(rhs)
    out = rows_product(lq, ls, jnp.swapaxes(wq, 1, 2), ws, group_sizes, out_dtype=out_dtype, impl=impl)
    return out, (wq, ws)


def _weight_and_data_grads(lhs, weights, group_sizes, d_out, rhs_type, grad_dtype, impl, lhs_dtype):
    """(d_lhs or None, d_rhs) from the forward's quantised weights; lhs (M, K) the rows the weight gradient
    quantises per 128x1 tile."""
    wq, ws = weights
    m = lhs.shape[0]
    d_lhs = None
    if lhs_dtype is not None:  # d_out (M, N) per 1x128 along N against the same 128x128 weight blocks, (G, K, N)
        dq, ds = quantize_rows(d_out, grad_dtype)
        d_lhs = rows_product(dq, ds, wq, jnp.swapaxes(ws, 1, 2), group_sizes, out_dtype=lhs_dtype, impl=impl)
    # Weight gradient: lhs and d_out per 128x1 tile along the rows, in the group-padded layout (the FFI kernel on
    # every platform, the emulated path too: its CPU handler is bit-identical to the jnp quantiser).
    lq_t, ls_t = quantize_group_columns(lhs, group_sizes)
    dq_t, ds_t = quantize_group_columns(d_out, group_sizes, grad_dtype)
    d_rhs = weight_grad_product(lq_t, ls_t, dq_t, ds_t, group_sizes, m, out_dtype=rhs_type.dtype, impl=impl)
    return d_lhs, d_rhs


def _fp8_gemm_bwd(out_dtype, grad_dtype, impl, res, d_out):
    lhs, weights, group_sizes, rhs_type = res
    d_lhs, d_rhs = _weight_and_data_grads(lhs, weights, group_sizes, d_out, rhs_type, grad_dtype, impl, lhs.dtype)
    return d_lhs, d_rhs, None


_fp8_gemm.defvjp(_fp8_gemm_fwd, _fp8_gemm_bwd)


# ----------------------------------------------------------------------------------------------------------------
# The op on rows quantised beforehand (by `permute_fp8`, in the permute's copy)

def grouped_gemm_fp8_quantized(lhs_q, lhs_scale, rhs, group_sizes, *, preferred_element_type=None, grad_dtype=E4M3,
                               impl: str = "auto"):
    """`grouped_gemm_fp8` on rows already quantised per 1x128 tile: (lhs_q, lhs_scale) = quantize_rows(lhs) gives
    grouped_gemm_fp8(lhs, ...)'s forward bit for bit, without the pass that reads lhs to quantise it.

    Args:
      lhs_q: float8_e4m3fn (M, K) rows sorted by group, lhs_scale: float32 (M, K/128) (`permute_fp8`'s outputs).
      rhs, group_sizes, grad_dtype, impl: as `grouped_gemm_fp8`.
      preferred_element_type: output dtype; default rhs's dtype.
    Returns:
      (M, N). Differentiable in rhs (custom VJP): the weight gradient quantises the dequantised FP8 rows per 128x1
      tile (DeepSeek-V3's cached FP8 activations; `grouped_gemm_fp8` quantises the unquantised rows instead, so the
      two weight gradients differ by that second rounding). No gradient for the FP8 rows; a caller that needs one runs
      the data gradient (`GemmSet.data_grad`) on its output gradient.
    """
    check_array("lhs_q", lhs_q)
    check_array("lhs_scale", lhs_scale)
    _checks.check_rank("lhs_q", lhs_q, 2, "(M, K)")
    if lhs_q.dtype != E4M3:
        raise TypeError(f"lhs_q must be float8_e4m3fn (quantize_rows / permute_fp8), got {lhs_q.dtype}")
    m, k = lhs_q.shape
    _check_rhs(k, "lhs_q (M, K)", lhs_q.shape, rhs, group_sizes)
    if lhs_scale.shape != (m, k // BLOCK) or lhs_scale.dtype != F32:
        raise ValueError(f"lhs_scale must be float32 (M, K/128) = {(m, k // BLOCK)} for lhs_q {lhs_q.shape}, got "
                         f"{lhs_scale.dtype} {lhs_scale.shape}")
    out_dtype = rhs.dtype if preferred_element_type is None else _checks.float_dtype(
        "preferred_element_type", preferred_element_type)
    grad_dtype = _fp8_dtype("grad_dtype", grad_dtype)
    _check_impl(impl)
    return _fp8_gemm_quantized(lhs_q, lhs_scale, rhs, _checks.as_int32(group_sizes), jnp.dtype(out_dtype), grad_dtype,
                               impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fp8_gemm_quantized(lhs_q, lhs_scale, rhs, group_sizes, out_dtype, grad_dtype, impl):
    return _quantized_weights_product(lhs_q, lhs_scale, rhs, group_sizes, out_dtype, impl)[0]


def _fp8_gemm_quantized_fwd(lhs_q, lhs_scale, rhs, group_sizes, out_dtype, grad_dtype, impl):
    out, weights = _quantized_weights_product(lhs_q, lhs_scale, rhs, group_sizes, out_dtype, impl)
    return out, (lhs_q, lhs_scale, weights, group_sizes, rhs[:0])


def _fp8_gemm_quantized_bwd(out_dtype, grad_dtype, impl, res, d_out):
    lhs_q, lhs_scale, weights, group_sizes, rhs_type = res
    lhs = dequantize_rows(*_materialized(lhs_q, lhs_scale))  # (M, K) float32: the values the forward multiplied
    _, d_rhs = _weight_and_data_grads(lhs, weights, group_sizes, d_out, rhs_type, grad_dtype, impl, None)
    return None, None, d_rhs, None


_fp8_gemm_quantized.defvjp(_fp8_gemm_quantized_fwd, _fp8_gemm_quantized_bwd)
