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
multiple of 128 so that no tile spans two groups. E5M2 may be chosen for the gradients (`grad_dtype`). The weight
gradient runs in FP8 only where that measured faster than the bf16 grouped GEMM on the unquantised operands
(`weight_grad`, `weight_grad_in_fp8`).

Implementations (`impl`): "auto" runs the Hopper kernel (kernels/cuda/grouped_gemm_fp8.cu) on a CUDA device and the
emulated path elsewhere; "emulated" always runs the emulated path. The emulated path quantises exactly as the kernel's
callers do (the same code, bit-exact FP8 values and scales; the float8 dtypes are ml_dtypes'), dequantises to
float32 and runs the float32 grouped GEMM kernels: it is the same math up to float32 summation order. It is jnp rather
than a C++ handler because the only FP8-specific work on the CPU is elementwise (quantise, dequantise), which XLA
fuses; the product is the existing float32 kernel. The quantisers are FFI ops on every platform, each bit-identical to
its jnp reference: the 1x128 rows `ops.quantize_rows` (jnp `quantize_rows`) and the weight gradient's 128x1 tiles in
the group-padded layout `ops.quantize_group_columns` (jnp `quantize_group_columns_xla`); the weights' 128x128 blocks
are jnp (`quantize_blocks`, once per call or once per step with `fp8_weights`). E5M2 gradients run the emulated product on every platform (the
CUDA kernel takes E4M3 only).

`grouped_gemm_fp8_quantized(lhs_q, lhs_scale, rhs, group_sizes)` takes rows already quantised per 1x128 tile (by
`permute_fp8`, in the permute's row copy). Both ops quantise a bf16 rhs once per call (the forward's blocks, saved,
are the data gradient's too), or take the blocks made once, `ops.fp8_weights(w)`, for every call of an optimizer
step.

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
from turbo_moe.ops.fp8_scaling import (  # noqa: F401  (re-exported: the references tests and benchmarks import)
    BLOCK,
    E4M3,
    E5M2,
    F32,
    FP8_DTYPES,
    Fp8Weights,
    dequantize_blocks,
    dequantize_rows,
    fp8_dtype,
    quantize_blocks,
    quantize_rows,
    quantize_tiles,
)
from turbo_moe.ops.quantize_group_columns import padded_rows, quantize_group_columns  # noqa: F401  (re-exported)
from turbo_moe.ops.quantize_rows import quantize_rows_call

IMPLS = ("auto", "emulated")
WEIGHT_GRADS = ("auto", "fp8", "bf16")

def quantize_group_columns_xla(x, group_sizes, dtype=E4M3):
    """`quantize_group_columns` in jnp, the reference its kernels match bit for bit (tests, benchmarks): x (M, C),
    int32 group_sizes (G >= 1,) -> q_t (C, P) fp8, scale (P/128, C) float32. Group g's rows start at column
    sum_{h<g} ceil(size_h / 128) * 128 of q_t (sizes clamped as the forward clamps them); padding and rows past the
    groups are zero. XLA runs it as a gather into a float32 (P, C) copy, a reduction and a transpose."""
    dtype = fp8_dtype("dtype", dtype)
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
    q, scale = quantize_tiles(x_pad.reshape(p // BLOCK, BLOCK, c), 1, dtype)
    return q.reshape(p, c).T, scale


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
# Which product the weight gradient runs

# The weight gradient in FP8 pays only where its kernel's gain over the bf16 kernel outweighs the two 128x1 passes it
# needs (`quantize_group_columns` of lhs and of the output gradient, 3 bytes an element each): measured on an H200
# (docs/notes/fp8.md, "Each GEMM in the precision that measures faster"), FP8 won only with both widths large and
# many rows per group. Below these, bf16: the op's residual lhs and the output gradient go to `grouped_gemm`'s
# bf16 weight gradient as they are (no quantisation pass at all).
FP8_WEIGHT_GRAD_MIN_WIDTH = 4096  # min(K, N)
FP8_WEIGHT_GRAD_MIN_ROWS_PER_GROUP = 1024  # M / G


def _check_weight_grad(weight_grad: str) -> None:
    if weight_grad not in WEIGHT_GRADS:
        raise ValueError(f"weight_grad must be one of {WEIGHT_GRADS}, got {weight_grad!r}")


def weight_grad_in_fp8(m: int, k: int, n: int, n_groups: int, weight_grad: str = "auto") -> bool:
    """Whether the weight gradient of an (M, K) x (G, K, N) FP8 GEMM runs in FP8: `weight_grad` "fp8" / "bf16", or
    "auto": FP8 where it measured faster (min(K, N) >= FP8_WEIGHT_GRAD_MIN_WIDTH and M / G >=
    FP8_WEIGHT_GRAD_MIN_ROWS_PER_GROUP), bf16 elsewhere."""
    _check_weight_grad(weight_grad)
    if weight_grad != "auto":
        return weight_grad == "fp8"
    return min(k, n) >= FP8_WEIGHT_GRAD_MIN_WIDTH and m >= FP8_WEIGHT_GRAD_MIN_ROWS_PER_GROUP * n_groups


# ----------------------------------------------------------------------------------------------------------------
# The op

def _check_fp8_weights(rhs: Fp8Weights) -> None:
    """The four leaves of an Fp8Weights agree (they come from `fp8_weights`; a hand-built one is checked)."""
    for name in Fp8Weights._fields:
        check_array(f"rhs.{name}", getattr(rhs, name))
    _checks.check_rank("rhs.master", rhs.master, 3, "(G, K, N)")
    g, k, n = rhs.master.shape
    want = {"q_nk": ((g, n, k), E4M3), "q_kn": ((g, k, n), E4M3),
            "scale": ((g, k // BLOCK, n // BLOCK), F32)}
    for name, (shape, dtype) in want.items():
        leaf = getattr(rhs, name)
        if leaf.shape != shape or leaf.dtype != dtype:
            raise ValueError(f"rhs.{name} must be {dtype} {shape} for rhs.master {rhs.master.shape} (make rhs with "
                             f"ops.fp8_weights), got {leaf.dtype} {leaf.shape}")


def _check_rhs(k: int, lhs_name: str, lhs_shape, rhs, group_sizes) -> None:
    """rhs (G, K, N) (an array or `Fp8Weights`) and group_sizes (G,) against the rows' K; K and N multiples of 128."""
    if isinstance(rhs, Fp8Weights):
        _check_fp8_weights(rhs)
    else:
        check_array("rhs", rhs)
        _checks.check_rank("rhs", rhs, 3, "(G, K, N)")
    check_array("group_sizes", group_sizes)
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


def _check_options(impl: str, weight_grad: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    _check_weight_grad(weight_grad)


def grouped_gemm_fp8(lhs, rhs, group_sizes, *, preferred_element_type=None, grad_dtype=E4M3, weight_grad="auto",
                     impl: str = "auto"):
    """(M, K) x (G, K, N) -> (M, N) in FP8 with DeepSeek-V3's scaling; differentiable in lhs and rhs (custom VJP).

    Args:
      lhs: (M, K) bfloat16/float16/float32 rows sorted by group; K % 128 == 0.
      rhs: (G, K, N) bfloat16/float16/float32 weights, N % 128 == 0, quantised per 128x128 block at every call; or
        `ops.fp8_weights(w)`, the same blocks made once (the result and the gradients are the same; the gradient
        goes to w).
      group_sizes: integer (G,) rows per group, on the device (negative counts as 0, clamped to M as in grouped_gemm).
      preferred_element_type: output dtype, bfloat16/float16/float32; default the promoted input dtype.
      grad_dtype: FP8 format of the output gradient in the backward pass: float8_e4m3fn (DeepSeek-V3's choice, the
        default) or float8_e5m2.
      weight_grad: the weight gradient's product: "fp8" (lhs and the output gradient quantised per 128x1), "bf16"
        (the bf16 grouped GEMM on them as they are), or "auto" (`weight_grad_in_fp8`: FP8 where it measured faster).
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
    grad_dtype = fp8_dtype("grad_dtype", grad_dtype)
    _check_options(impl, weight_grad)
    return _fp8_gemm(lhs, rhs, _checks.as_int32(group_sizes), jnp.dtype(out_dtype), grad_dtype, weight_grad, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fp8_gemm(lhs, rhs, group_sizes, out_dtype, grad_dtype, weight_grad, impl):
    return _fp8_gemm_fwd(lhs, rhs, group_sizes, out_dtype, grad_dtype, weight_grad, impl)[0]


def _fp8_gemm_fwd(lhs, rhs, group_sizes, out_dtype, grad_dtype, weight_grad, impl):
    lq, ls = quantize_rows_call(lhs, E4M3)  # one kernel pass, bit for bit the jnp quantize_rows
    out, weights = _quantized_weights_product(lq, ls, rhs, group_sizes, out_dtype, impl)
    # Residuals: lhs (the weight gradient reads it, in bf16 or quantised per 128x1; DeepSeek-V3 caches it in FP8
    # instead) and the weights' blocks in the data gradient's (G, K, N) layout.
    return out, (lhs, weights, group_sizes, _empty_like(rhs))


def _empty_like(rhs):
    """rhs with no groups: its dtype and, for Fp8Weights, its kind, carried to the backward for free."""
    return jax.tree.map(lambda a: a[:0], rhs)


def _rhs_cotangent(rhs_type, d_rhs):
    """The cotangent of rhs: d_rhs (in rhs's dtype) itself, or for Fp8Weights in its master leaf (the FP8 leaves
    get none)."""
    return Fp8Weights(d_rhs, None, None, None) if isinstance(rhs_type, Fp8Weights) else d_rhs


def _quantized_weights_product(lq, ls, rhs, group_sizes, out_dtype, impl):
    """rows (lq, ls) x rhs's 128x128 blocks -> (out, (wq (G, K, N), ws)). The forward kernel reads the blocks
    K-contiguous, (G, N, K): the same values transposed (a 128x128 block's scale is transpose-invariant). A bf16 rhs
    is quantised here; Fp8Weights bring both layouts."""
    wq_t, (wq, ws) = _weight_blocks(rhs)
    out = rows_product(lq, ls, wq_t, ws, group_sizes, out_dtype=out_dtype, impl=impl)
    return out, (wq, ws)


def _weight_blocks(rhs):
    """rhs's 128x128 FP8 blocks: (q (G, N, K) for the forward, (q (G, K, N), scales (G, K/128, N/128))), made here
    from an array or brought by `Fp8Weights`."""
    if isinstance(rhs, Fp8Weights):
        return rhs.q_nk, (rhs.q_kn, rhs.scale)
    wq, ws = quantize_blocks(rhs)
    return jnp.swapaxes(wq, 1, 2), (wq, ws)


def data_grad_fp8_quantized(d_out_q, d_out_scale, rhs, group_sizes, *, out_dtype=jnp.bfloat16, impl: str = "auto"):
    """d_out @ rhs[g]^T from an output gradient its producer quantised per 1x128 tile along N (`permute_rows_fp8_call`,
    `swiglu_combine_grad_fp8`): (M, N) fp8 + (M, N/128) float32 scales, rhs (G, K, N) (an array, its 128x128 blocks
    made here, or `Fp8Weights`) -> (M, K) out_dtype. Bit for bit `grouped_gemm_fp8`'s data gradient of the unquantised
    output gradient, without its quantisation pass. A backward-pass building block: no VJP. Rows past
    sum(group_sizes) are zero."""
    _, (wq, ws) = _weight_blocks(rhs)
    return rows_product(d_out_q, d_out_scale, wq, jnp.swapaxes(ws, 1, 2), _checks.as_int32(group_sizes),
                        out_dtype=out_dtype, impl=impl)


def forward_fp8_quantized(lhs_q, lhs_scale, rhs, group_sizes, *, out_dtype=jnp.bfloat16, impl: str = "auto"):
    """`grouped_gemm_fp8_quantized`'s forward product alone (no VJP), for a custom backward that runs its own
    gradients (`expert_block`): rows quantised by their producer (`swiglu_quantize`) x rhs -> (M, N) out_dtype."""
    return _quantized_weights_product(lhs_q, lhs_scale, rhs, _checks.as_int32(group_sizes), out_dtype, impl)[0]


def _weight_and_data_grads(lhs, weights, group_sizes, d_out, rhs_type, grad_dtype, weight_grad, impl, lhs_dtype):
    """(d_lhs or None, d_rhs) from the forward's quantised weights; lhs (M, K) the rows the weight gradient reads."""
    wq, ws = weights
    m, k = lhs.shape
    d_lhs = None
    if lhs_dtype is not None:  # d_out (M, N) per 1x128 along N against the same 128x128 weight blocks, (G, K, N)
        dq, ds = quantize_rows_call(d_out, grad_dtype)
        d_lhs = rows_product(dq, ds, wq, jnp.swapaxes(ws, 1, 2), group_sizes, out_dtype=lhs_dtype, impl=impl)
    if not weight_grad_in_fp8(m, k, d_out.shape[1], wq.shape[0], weight_grad):
        bf16 = jnp.bfloat16
        d_rhs = grouped_gemm_weight_grad(lhs.astype(bf16), d_out.astype(bf16), group_sizes,
                                         preferred_element_type=rhs_type.dtype)
        return d_lhs, d_rhs
    # FP8: lhs and d_out per 128x1 tile along the rows, in the group-padded layout (the FFI kernel on every platform,
    # the emulated path too: its CPU handler is bit-identical to the jnp quantiser).
    lq_t, ls_t = quantize_group_columns(lhs, group_sizes)
    dq_t, ds_t = quantize_group_columns(d_out, group_sizes, grad_dtype)
    d_rhs = weight_grad_product(lq_t, ls_t, dq_t, ds_t, group_sizes, m, out_dtype=rhs_type.dtype, impl=impl)
    return d_lhs, d_rhs


def _fp8_gemm_bwd(out_dtype, grad_dtype, weight_grad, impl, res, d_out):
    lhs, weights, group_sizes, rhs_type = res
    d_lhs, d_rhs = _weight_and_data_grads(lhs, weights, group_sizes, d_out, rhs_type, grad_dtype, weight_grad, impl,
                                          lhs.dtype)
    return d_lhs, _rhs_cotangent(rhs_type, d_rhs), None


_fp8_gemm.defvjp(_fp8_gemm_fwd, _fp8_gemm_bwd)


# ----------------------------------------------------------------------------------------------------------------
# The op on rows quantised beforehand (by `permute_fp8`, in the permute's copy)

def grouped_gemm_fp8_quantized(lhs_q, lhs_scale, rhs, group_sizes, *, preferred_element_type=None, grad_dtype=E4M3,
                               weight_grad="auto", impl: str = "auto"):
    """`grouped_gemm_fp8` on rows already quantised per 1x128 tile: (lhs_q, lhs_scale) = quantize_rows(lhs) gives
    grouped_gemm_fp8(lhs, ...)'s forward bit for bit, without the pass that reads lhs to quantise it.

    Args:
      lhs_q: float8_e4m3fn (M, K) rows sorted by group, lhs_scale: float32 (M, K/128) (`permute_fp8`'s outputs).
      rhs, group_sizes, grad_dtype, weight_grad, impl: as `grouped_gemm_fp8` (rhs an array or `Fp8Weights`).
      preferred_element_type: output dtype; default rhs's dtype.
    Returns:
      (M, N). Differentiable in rhs (custom VJP): the weight gradient reads the dequantised FP8 rows (DeepSeek-V3's
      cached FP8 activations; `grouped_gemm_fp8` reads the unquantised rows instead, so the two weight gradients differ
      by that rounding). No gradient for the FP8 rows; a caller that needs one runs the data gradient
      (`GemmSet.data_grad`) on its output gradient.
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
    grad_dtype = fp8_dtype("grad_dtype", grad_dtype)
    _check_options(impl, weight_grad)
    return _fp8_gemm_quantized(lhs_q, lhs_scale, rhs, _checks.as_int32(group_sizes), jnp.dtype(out_dtype), grad_dtype,
                               weight_grad, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fp8_gemm_quantized(lhs_q, lhs_scale, rhs, group_sizes, out_dtype, grad_dtype, weight_grad, impl):
    return _quantized_weights_product(lhs_q, lhs_scale, rhs, group_sizes, out_dtype, impl)[0]


def _fp8_gemm_quantized_fwd(lhs_q, lhs_scale, rhs, group_sizes, out_dtype, grad_dtype, weight_grad, impl):
    out, weights = _quantized_weights_product(lhs_q, lhs_scale, rhs, group_sizes, out_dtype, impl)
    return out, (lhs_q, lhs_scale, weights, group_sizes, _empty_like(rhs))


def _fp8_gemm_quantized_bwd(out_dtype, grad_dtype, weight_grad, impl, res, d_out):
    lhs_q, lhs_scale, weights, group_sizes, rhs_type = res
    lhs = dequantize_rows(*_materialized(lhs_q, lhs_scale))  # (M, K) float32: the values the forward multiplied
    _, d_rhs = _weight_and_data_grads(lhs, weights, group_sizes, d_out, rhs_type, grad_dtype, weight_grad, impl,
                                      None)
    return None, None, _rhs_cotangent(rhs_type, d_rhs), None


_fp8_gemm_quantized.defvjp(_fp8_gemm_quantized_fwd, _fp8_gemm_quantized_bwd)
