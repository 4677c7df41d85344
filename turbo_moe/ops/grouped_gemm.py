"""Grouped GEMM: a drop-in for `jax.lax.ragged_dot` backed by the turbo_moe FFI kernels.

Row block g of `lhs` (its size is `group_sizes[g]`) is multiplied by `rhs[g]`. Group sizes stay on
the device (no host sync, static shapes). Runtime semantics: negative sizes count as 0, the
cumulative layout is clamped to M, and rows past `sum(group_sizes)` are zero.

The two kernels are JAX primitives, each linear in both float operands (like `dot_general`): a JVP
rule, a transpose rule (the data gradient is the grouped GEMM against the other layout of rhs, the
weight gradient the variable-K kernel, and the weight-gradient kernel's transposes are grouped GEMMs
again), a batching rule (vmap: one call over leading batch dims) and an FFI lowering. So reverse mode
calls the same kernels a hand-written VJP would, and forward mode, `linearize`, `hessian` and
grad-of-grad work too.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ensure_registered, make_varying, varying_axes, workspace

FLOAT32 = jnp.dtype(jnp.float32)


def grouped_gemm(lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None,
                 out_sharding=None, *, transpose_rhs: bool = False, zero_tail: bool = True):
    """(M, K) x (G, K, N) -> (M, N) with per-group weights; `(G, N, K)` when `transpose_rhs`.

    The arguments up to `out_sharding` are `jax.lax.ragged_dot`'s, in its order.

    Args:
      lhs: (M, K) rows sorted by group.
      rhs: (G, K, N), or (G, N, K) with `transpose_rhs=True` (saves a transpose for tied/down weights).
      group_sizes: integer (G,) array, rows per group, on the device (a Python list is a TypeError, as in
        ragged_dot).
      precision: validated as by `jax.lax.ragged_dot`. The kernels multiply exactly in float32 and accumulate in
        float32 for every precision (HIGHEST for float32 inputs; XLA's CPU dot ignores precision too); presets
        that round float32 operands (e.g. BF16_BF16_F32) are not emulated.
      preferred_element_type: output dtype. Default and dtype rules are `ragged_dot`'s (bf16 x f16 -> bf16).
      group_offset: None, or an integer () / (1,) array o: `group_sizes` holds the global groups and `rhs` the
        G_local = rhs.shape[0] local ones, groups o .. o + G_local - 1 (expert parallelism, as in megablox's gmm).
        Rows of other groups are zero. o must lie in [0, G - G_local] (it is clamped there). It costs a row
        rotation of lhs and of the output (a copy each).
      out_sharding: only None (explicit-sharding meshes are not supported).
      transpose_rhs: rhs is (G, N, K).
      zero_tail: False lets the rows past sum(group_sizes) stay unwritten, for a caller that reads only group
        rows (the expert block on worst-case EP buffers, mostly tail); the CUDA kernels then skip them, the CPU
        handlers fill them with NaN (so a reader of them shows). The data gradient takes the same setting.
    Returns:
      (M, N). Rows past sum(group_sizes) are zero (unspecified with zero_tail=False). Differentiable in lhs and rhs
      to any order, in forward and reverse mode.

    Dtypes: bfloat16, float16 and float32 operands (promoted to one) run the kernels; 8-bit floats (fp8) are upcast
    to bfloat16 exactly and run them too. Other dtypes (integers, e.g. int8 with preferred_element_type=int32,
    float64) run `jax.lax.ragged_dot_general` with the same semantics.
    """
    _check_array("lhs", lhs)
    _check_array("rhs", rhs)
    _check_array("group_sizes", group_sizes)
    transpose_rhs = _checks.static_bool("transpose_rhs", transpose_rhs)
    zero_tail = _checks.static_bool("zero_tail", zero_tail)
    _check_out_sharding(out_sharding)
    layout = "(G, N, K)" if transpose_rhs else "(G, K, N)"
    _checks.check_rank("lhs", lhs, 2, "(M, K)")
    _checks.check_rank("rhs", rhs, 3, layout)
    _checks.check_rank("group_sizes", group_sizes, 1, "(G,)")
    _checks.check_integer("group_sizes", group_sizes)
    _check_contraction(lhs, rhs, transpose_rhs, layout)
    offset = group_offset_scalar(group_offset)
    _check_group_count(group_sizes.shape[0], rhs.shape[0], offset is not None, rhs.shape)
    out_dtype = result_dtype(lhs.dtype, rhs.dtype, precision, preferred_element_type)
    return ragged_rows(lhs, rhs, _checks.as_int32(group_sizes), offset, transpose_rhs=transpose_rhs,
                       out_dtype=out_dtype, precision=precision, zero_tail=zero_tail)


def grouped_gemm_weight_grad(lhs, d_out, group_sizes, *, preferred_element_type=None):
    """Variable-K grouped GEMM: (M, K), (M, N) -> (G, K, N), out[g] = lhs[rows_g]^T @ d_out[rows_g].

    The weight gradient of `grouped_gemm` (differentiable itself). Empty groups give zeros; deterministic (no
    atomics). bfloat16, float16 or float32 inputs; `ragged_dot_general` with a ragged contracting dimension
    takes any dtype.
    """
    _checks.check_rank("lhs", lhs, 2, "(M, K)")
    _checks.check_rank("d_out", d_out, 2, "(M, N)")
    _checks.check_rank("group_sizes", group_sizes, 1, "(G,)")
    _checks.check_integer("group_sizes", group_sizes)
    if d_out.shape[0] != lhs.shape[0]:
        raise ValueError(f"d_out (M, N) must have M={lhs.shape[0]} rows like lhs, got {d_out.shape}")
    _checks.float_dtype("lhs", lhs.dtype)
    _checks.float_dtype("d_out", d_out.dtype)
    compute = jnp.promote_types(lhs.dtype, d_out.dtype)
    out_dtype = compute if preferred_element_type is None else _checks.float_dtype(
        "preferred_element_type", preferred_element_type)
    return _weight_grad_call(lhs.astype(compute), d_out.astype(compute), _checks.as_int32(group_sizes),
                             jnp.dtype(out_dtype))


def check_operands(lhs, rhs, group_sizes, transpose_rhs: bool, n_name: str):
    """Names the argument and the expected layout for a bad forward call of a float-only kernel; returns the
    promoted compute dtype. n_name: how the layout strings spell the output width ("N", or "2F" for
    grouped_gemm_swiglu)."""
    layout = f"(G, {n_name}, K)" if transpose_rhs else f"(G, K, {n_name})"
    _checks.check_rank("lhs", lhs, 2, "(M, K)")
    _checks.check_rank("rhs", rhs, 3, layout)
    _checks.check_rank("group_sizes", group_sizes, 1, "(G,)")
    _checks.check_integer("group_sizes", group_sizes)
    _checks.float_dtype("lhs", lhs.dtype)
    _checks.float_dtype("rhs", rhs.dtype)
    _check_contraction(lhs, rhs, transpose_rhs, layout)
    _check_group_count(group_sizes.shape[0], rhs.shape[0], False, rhs.shape)
    return jnp.promote_types(lhs.dtype, rhs.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Checks, dtype rules and the group offset (shared with ragged_dot_general)

def _check_array(name: str, x) -> None:
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise TypeError(f"{name} must be a jax.Array or numpy.ndarray, got {type(x).__name__} (as in "
                        "jax.lax.ragged_dot; wrap a list in jnp.asarray)")


def _check_out_sharding(out_sharding) -> None:
    if out_sharding is not None:
        raise NotImplementedError(f"out_sharding={out_sharding!r}: only None is supported (explicit-sharding "
                                  "meshes are not; shard the inputs, or call it inside shard_map)")


def _check_contraction(lhs, rhs, transpose_rhs: bool, layout: str) -> None:
    rhs_k = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if rhs_k != lhs.shape[1]:
        raise ValueError(f"rhs {layout} has contraction size {rhs_k} but lhs (M, K) has K={lhs.shape[1]} "
                         f"(lhs {lhs.shape}, rhs {rhs.shape}, transpose_rhs={transpose_rhs})")


def _check_group_count(n_sizes: int, n_rhs: int, with_offset: bool, rhs_shape) -> None:
    if with_offset and n_rhs > n_sizes:
        raise ValueError(f"with group_offset, rhs holds G_local <= G local groups: rhs {rhs_shape} has "
                         f"{n_rhs} but group_sizes has G={n_sizes}")
    if not with_offset and n_sizes != n_rhs:
        raise ValueError(f"group_sizes must have shape (G,) = ({n_rhs},) to match rhs {rhs_shape}, "
                         f"got ({n_sizes},)")


def group_offset_scalar(group_offset):
    """None, or the first local group as an int32 scalar; an integer () or (1,) array (or Python int)."""
    if group_offset is None:
        return None
    if isinstance(group_offset, (bool, np.bool_)):
        raise TypeError(f"group_offset must be an integer () or (1,) array, got {group_offset!r}")
    offset = group_offset if isinstance(group_offset, (jax.Array, np.ndarray)) else np.asarray(group_offset)
    _checks.check_integer("group_offset", offset)
    if offset.shape not in ((), (1,)):
        raise ValueError(f"group_offset must have shape () or (1,), got {offset.shape}")
    return _checks.as_int32(jnp.reshape(offset, ()))


def result_dtype(lhs_dtype, rhs_dtype, precision, preferred_element_type) -> np.dtype:
    """The output dtype `jax.lax.ragged_dot` gives (XLA's rule: the "higher" input type, not NumPy promotion, so
    bf16 x f16 -> bf16); it also validates `precision` and `preferred_element_type` as ragged_dot does."""
    if preferred_element_type is not None:
        try:
            preferred_element_type = jnp.dtype(preferred_element_type)
        except TypeError as e:
            raise TypeError(f"preferred_element_type must be a dtype or None, got {preferred_element_type!r}") from e
    args = (jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype), precision, preferred_element_type)
    try:
        return _cached_result_dtype(*args)
    except TypeError as e:
        if "unhashable" not in str(e):
            raise
        return _cached_result_dtype.__wrapped__(*args)  # e.g. precision as a list


@functools.lru_cache(maxsize=256)
def _cached_result_dtype(lhs_dtype, rhs_dtype, precision, preferred_element_type) -> np.dtype:
    out = jax.eval_shape(
        functools.partial(jax.lax.ragged_dot, precision=precision, preferred_element_type=preferred_element_type),
        jax.ShapeDtypeStruct((1, 1), lhs_dtype), jax.ShapeDtypeStruct((1, 1, 1), rhs_dtype),
        jax.ShapeDtypeStruct((1,), jnp.int32))
    return jnp.dtype(out.dtype)


def _kernel_input_dtype(dtype):
    """The dtype an operand enters the kernels as, or None (the kernels cannot take it exactly)."""
    dtype = jnp.dtype(dtype)
    if dtype in _checks.FLOAT_DTYPES:
        return dtype
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:  # fp8 (and smaller): exact in bfloat16
        small, bf16 = jnp.finfo(dtype), jnp.finfo(jnp.bfloat16)
        if (small.nmant <= bf16.nmant and small.maxexp <= bf16.maxexp
                and float(small.smallest_subnormal) >= float(bf16.smallest_subnormal)):
            return jnp.dtype(jnp.bfloat16)
    return None


def kernel_dtypes(lhs_dtype, rhs_dtype, out_dtype):
    """(compute dtype, kernel output dtype) where the kernels compute this product exactly as ragged_dot
    defines it, else None (integers, float64, complex: the caller runs jax.lax.ragged_dot_general)."""
    a, b = _kernel_input_dtype(lhs_dtype), _kernel_input_dtype(rhs_dtype)
    out_dtype = jnp.dtype(out_dtype)
    if a is None or b is None or not jnp.issubdtype(out_dtype, jnp.floating) or out_dtype.itemsize > 4:
        return None
    return jnp.promote_types(a, b), (out_dtype if out_dtype in _checks.FLOAT_DTYPES else FLOAT32)


def clamped_sizes(group_sizes, rows: int):
    """(..., G) sizes of the kernels' layout: negative sizes count as 0, nothing past `rows`."""
    ends = jnp.minimum(jnp.cumsum(jnp.clip(group_sizes, 0, rows), axis=-1), rows)
    return jnp.diff(ends, axis=-1, prepend=jnp.zeros_like(ends[..., :1]))


RAGGED_ROWS = jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])  # (M, K) x (G, K, N)
RAGGED_ROWS_T = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])  # (M, K) x (G, N, K)


def ragged_rows(lhs, rhs, group_sizes, offset, *, transpose_rhs, out_dtype, precision, zero_tail):
    """The checked 2-D grouped GEMM: lhs (M, K), rhs (G_local, K, N) or (G_local, N, K), int32 group_sizes (G,),
    offset None or an int32 scalar -> (M, N) out_dtype."""
    if offset is not None:
        return _with_group_offset(lhs, rhs, group_sizes, offset, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                                  precision=precision, zero_tail=zero_tail)
    dtypes = kernel_dtypes(lhs.dtype, rhs.dtype, out_dtype)
    if dtypes is None:
        dims = RAGGED_ROWS_T if transpose_rhs else RAGGED_ROWS
        return jax.lax.ragged_dot_general(lhs, rhs, clamped_sizes(group_sizes, lhs.shape[0]), dims,
                                          precision=precision, preferred_element_type=out_dtype)
    compute, kernel_out = dtypes
    lhs, rhs = lhs.astype(compute), rhs.astype(compute)
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if pads_to_tiles(compute, kernel_out):
        k_pad, n_pad = -lhs.shape[1] % TILE_MULTIPLE, -n % TILE_MULTIPLE
        if k_pad or n_pad:
            lhs = _pad_last(lhs, k_pad)
            rhs = jnp.pad(rhs, ((0, 0), (0, n_pad), (0, k_pad)) if transpose_rhs else ((0, 0), (0, k_pad), (0, n_pad)))
    out = _gemm_call(lhs, rhs, group_sizes, transpose_rhs, kernel_out, zero_tail)
    return out[:, :n].astype(out_dtype)


def _with_group_offset(lhs, rhs, group_sizes, offset, **kw):
    """The local groups o .. o + G_local - 1 of the global layout: lhs rotated so that group o starts at row 0, the
    local groups' sizes, and the output rotated back (rows outside the local groups are the tail: zero)."""
    m, n_local, n_groups = lhs.shape[0], rhs.shape[0], group_sizes.shape[0]
    ends = jnp.cumsum(clamped_sizes(group_sizes, m))  # (G,) clamped group ends
    o = jnp.clip(offset, 0, n_groups - n_local)
    start = jnp.where(o > 0, ends[jnp.maximum(o - 1, 0)], 0)
    local = clamped_sizes(jax.lax.dynamic_slice_in_dim(group_sizes, o, n_local), m - start)  # (G_local,)
    out = ragged_rows(jnp.roll(lhs, -start, axis=0), rhs, local, None, **kw)
    return jnp.roll(out, start, axis=0)


def ragged_contracting(lhs, rhs, group_sizes, *, out_dtype, precision):
    """The checked weight-gradient product: lhs (M, K), rhs (M, N), int32 group_sizes (G,) -> (G, K, N)."""
    dtypes = kernel_dtypes(lhs.dtype, rhs.dtype, out_dtype)
    if dtypes is None:
        dims = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), [0], [])
        return jax.lax.ragged_dot_general(lhs, rhs, clamped_sizes(group_sizes, lhs.shape[0]), dims,
                                          precision=precision, preferred_element_type=out_dtype)
    compute, kernel_out = dtypes
    k, n = lhs.shape[1], rhs.shape[1]
    lhs, rhs = lhs.astype(compute), rhs.astype(compute)
    if pads_to_tiles(compute, kernel_out):
        lhs, rhs = _pad_last(lhs, -k % TILE_MULTIPLE), _pad_last(rhs, -n % TILE_MULTIPLE)
    return _weight_grad_call(lhs, rhs, group_sizes, kernel_out)[:, :k, :n].astype(out_dtype)


# The Hopper kernels (TMA) need K and N multiples of 8 two-byte elements (16 bytes); other widths ran the portable
# kernel at ~20 TFLOP/s (docs/notes/peers.md). Zero columns cost a copy of the operands and change no sum.
TILE_MULTIPLE = 8


def pads_to_tiles(compute, kernel_out) -> bool:
    """Whether the operands are zero-padded to TILE_MULTIPLE: on GPUs, for the half-precision kernels."""
    return (jax.default_backend() == "gpu" and jnp.dtype(compute) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and jnp.dtype(kernel_out) == jnp.dtype(compute))


def _pad_last(x, pad: int):
    return jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, pad),)) if pad else x


# ----------------------------------------------------------------------------------------------------------------
# The primitives

# The workspace counter's dtype codes (kernels/cuda/grouped_gemm.cu).
_DTYPE_CODE = {jnp.dtype(jnp.bfloat16): 0, jnp.dtype(jnp.float16): 1, jnp.dtype(jnp.float32): 2}


def _workspace(group_sizes, dtype, weight_grad):
    """group_sizes: an array or an abstract value (the lowering sizes the workspace from its batch dims)."""
    return workspace("turbo_moe_grouped_gemm_workspace_bytes", 1, group_sizes.shape[-1], _DTYPE_CODE[jnp.dtype(dtype)],
                     int(weight_grad), batch=group_sizes.shape[:-1])


def _bind(prim, *args, **params):
    """Inside shard_map the FFI call needs operands of one varying-axes type: all are cast to the union of their
    axes before the primitive (autodiff transposes these casts into the psums a replicated operand's gradient
    needs), and the result varies over the same axes."""
    ensure_registered()
    axes = frozenset().union(*(varying_axes(a) for a in args))
    return prim.bind(*(make_varying(a, axes) for a in args), **params)


def _gemm_call(lhs, rhs, group_sizes, transpose_rhs, out_dtype, zero_tail=True):
    """The kernel on operands of one float dtype: (..., M, K) x (..., G, K, N) | (..., G, N, K) -> (..., M, N)."""
    return _bind(grouped_gemm_p, lhs, rhs, group_sizes, transpose_rhs=bool(transpose_rhs),
                 out_dtype=jnp.dtype(out_dtype), zero_tail=bool(zero_tail))


def _weight_grad_call(lhs, d_out, group_sizes, out_dtype):
    """The kernel on operands of one float dtype: (..., M, K), (..., M, N) -> (..., G, K, N)."""
    return _bind(weight_grad_p, lhs, d_out, group_sizes, out_dtype=jnp.dtype(out_dtype))


def _result_aval(like, shape, dtype):
    # Typed like the operands inside shard_map (they share one varying-axes type), replicated otherwise.
    sharding = jax.sharding.NamedSharding(like.sharding.mesh, jax.sharding.PartitionSpec())
    return like.update(shape=tuple(shape), dtype=dtype, weak_type=False, sharding=sharding)


def _gemm_abstract_eval(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, zero_tail):
    n = rhs.shape[-2] if transpose_rhs else rhs.shape[-1]
    return _result_aval(lhs, lhs.shape[:-1] + (n,), out_dtype)


def _weight_grad_abstract_eval(lhs, d_out, group_sizes, *, out_dtype):
    return _result_aval(lhs, lhs.shape[:-2] + (group_sizes.shape[-1], lhs.shape[-1], d_out.shape[-1]), out_dtype)


def _lowering(target: str, weight_grad: bool):
    """jax.ffi's lowering of `target`, with the workspace result the handler also writes (dropped here)."""
    rule = jax.ffi.ffi_lowering(target)

    def lower(ctx, *operands, out_dtype, **attributes):
        ws = _workspace(ctx.avals_in[2], ctx.avals_in[0].dtype, weight_grad)
        ctx = ctx.replace(avals_out=[*ctx.avals_out, _result_aval(ctx.avals_in[2], ws.shape, ws.dtype)])
        return rule(ctx, *operands, **attributes)[:1]
    return lower


def _transpose_gemm(ct, lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, zero_tail):
    # out = lhs @ rhs[g]: d_lhs = ct @ rhs[g]^T (the kernel on the other layout), d_rhs = the weight gradient.
    if ad.is_undefined_primal(lhs) and ad.is_undefined_primal(rhs):
        raise ValueError("grouped_gemm is bilinear: it cannot be transposed in both operands at once")
    if type(ct) is ad.Zero:
        return None, None, None
    if ad.is_undefined_primal(lhs):
        compute = lhs.aval.dtype
        return _gemm_call(ct.astype(compute), rhs, group_sizes, not transpose_rhs, compute, zero_tail), None, None
    compute = rhs.aval.dtype
    ct = ct.astype(compute)
    d_rhs = (_weight_grad_call(ct, lhs, group_sizes, compute) if transpose_rhs  # (G, N, K)
             else _weight_grad_call(lhs, ct, group_sizes, compute))  # (G, K, N)
    return None, d_rhs, None


def _transpose_weight_grad(ct, lhs, d_out, group_sizes, *, out_dtype):
    # out[g] = lhs_g^T @ d_out_g: d_lhs = d_out @ ct[g]^T, d_d_out = lhs @ ct[g]; rows past the groups get zeros.
    if ad.is_undefined_primal(lhs) and ad.is_undefined_primal(d_out):
        raise ValueError("grouped_gemm_weight_grad is bilinear: it cannot be transposed in both operands at once")
    if type(ct) is ad.Zero:
        return None, None, None
    if ad.is_undefined_primal(lhs):
        compute = lhs.aval.dtype
        return _gemm_call(d_out, ct.astype(compute), group_sizes, True, compute), None, None
    compute = d_out.aval.dtype
    return None, _gemm_call(lhs, ct.astype(compute), group_sizes, False, compute), None


def _batch(prim, args, dims, **params):
    """vmap: every operand gets the batch dim in front (broadcast where unbatched); the kernels take leading dims."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    args = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
    return prim.bind(*args, **params), 0


@functools.lru_cache(maxsize=None)
def _jitted(prim, params: tuple):
    return jax.jit(functools.partial(prim.bind, **dict(params)))


def _define(name: str, abstract_eval, transpose, weight_grad: bool) -> Primitive:
    prim = Primitive(name)
    prim.def_impl(lambda *args, **params: _jitted(prim, tuple(sorted(params.items())))(*args))
    prim.def_abstract_eval(abstract_eval)
    # Linear in each float operand: the tangent is prim(d_a, b) + prim(a, d_b); group sizes have none.
    ad.defjvp(prim, lambda t, a, b, gs, **p: _bind(prim, t, b, gs, **p),
              lambda t, a, b, gs, **p: _bind(prim, a, t, gs, **p), None)
    ad.primitive_transposes[prim] = transpose
    batching.primitive_batchers[prim] = functools.partial(_batch, prim)
    mlir.register_lowering(prim, _lowering(name, weight_grad))
    return prim


grouped_gemm_p = _define("turbo_moe_grouped_gemm", _gemm_abstract_eval, _transpose_gemm, False)
weight_grad_p = _define("turbo_moe_grouped_gemm_weight_grad", _weight_grad_abstract_eval, _transpose_weight_grad, True)
