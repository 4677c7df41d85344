"""`jax.lax.ragged_dot_general` on the grouped GEMM kernels, for the dimension numbers MoE code uses.

Supported (one contracting and one free dimension per operand, any number of batch dimensions):
  - ragged non-contracting (mode 1, `ragged_dot`): lhs [b..., m, k] ragged in m, rhs [g, b..., k, n] (any order of
    rhs's dims) -> [b..., m, n]: `grouped_gemm`, over the batch dims as one batched call;
  - ragged contracting (mode 2, the weight gradient): lhs [b..., m, k] and rhs [b..., m, n] ragged in the contracted
    m -> [g, b..., k, n]: `grouped_gemm_weight_grad`.
Layouts other than the kernels' ((..., M, K), (..., G, K|N, N|K) and (..., M, K), (..., M, N)) cost a transpose
(a copy) of the operand. Ragged batch dimensions (mode 3), several contracting or free dimensions per operand, and
group_offset with a ragged contracting dimension raise NotImplementedError naming the dimension numbers.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops.grouped_gemm import (_check_array, _check_group_count, _check_out_sharding, group_offset_scalar,
                                        ragged_contracting, ragged_rows, result_dtype)


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers: jax.lax.RaggedDotDimensionNumbers,
                       precision=None, preferred_element_type=None, group_offset=None, out_sharding=None):
    """`jax.lax.ragged_dot_general`'s signature and semantics (see the module docstring for what is supported).

    group_sizes: (G,) or (b..., G) integers. group_offset (ragged non-contracting only): as in `grouped_gemm`, the
    rhs group dimension holds the G_local groups from group_offset on. Dtypes, precision and the runtime semantics
    of group sizes are `grouped_gemm`'s; rows past the groups are zero."""
    for name, x in (("lhs", lhs), ("rhs", rhs), ("group_sizes", group_sizes)):
        _check_array(name, x)
    _check_out_sharding(out_sharding)
    _checks.check_integer("group_sizes", group_sizes)
    dims = ragged_dot_dimension_numbers
    if not isinstance(dims, jax.lax.RaggedDotDimensionNumbers):
        raise TypeError(f"ragged_dot_dimension_numbers must be a jax.lax.RaggedDotDimensionNumbers, got {dims!r}")
    (l_contract, r_contract), (l_batch, r_batch) = dims.dot_dimension_numbers
    l_free = _free(lhs.ndim, l_contract, l_batch, (), "lhs", dims)
    if len(dims.lhs_ragged_dimensions) != 1:
        raise ValueError(f"ragged_dot_dimension_numbers must have exactly one lhs ragged dimension, got {dims}")
    ragged = dims.lhs_ragged_dimensions[0]
    if not 0 <= ragged < lhs.ndim:
        raise ValueError(f"the lhs ragged dimension {ragged} is out of range for lhs of rank {lhs.ndim} ({dims})")
    if len(l_contract) != 1 or len(r_contract) != 1 or len(l_batch) != len(r_batch):
        raise NotImplementedError(f"ragged_dot_general supports one contracting dimension per operand and matching "
                                  f"batch dimensions, got {dims}")
    for a, b in zip((*l_contract, *l_batch), (*r_contract, *r_batch)):
        if lhs.shape[a] != rhs.shape[b]:
            raise ValueError(f"lhs dimension {a} (size {lhs.shape[a]}) and rhs dimension {b} (size {rhs.shape[b]}) "
                             f"are contracted or batched together by {dims}: sizes must match")
    batch_shape = tuple(lhs.shape[d] for d in l_batch)
    out_dtype = result_dtype(lhs.dtype, rhs.dtype, precision, preferred_element_type)
    if ragged in l_free:  # mode 1: the grouped GEMM
        r_free = _free(rhs.ndim, r_contract, r_batch, dims.rhs_group_dimensions, "rhs", dims)
        if len(dims.rhs_group_dimensions) != 1:
            raise ValueError(f"a ragged non-contracting lhs dimension needs exactly one rhs group dimension, got {dims}")
        (group,) = dims.rhs_group_dimensions
        offset = group_offset_scalar(group_offset)
        _check_group_count(group_sizes.shape[-1], rhs.shape[group], offset is not None, rhs.shape)
        transpose_rhs = r_contract[0] > r_free[0]  # keep rhs's own order of K and N: no copy where it is (G, N, K)
        a = jnp.transpose(lhs, (*l_batch, ragged, *l_contract))  # (b..., M, K)
        b = jnp.transpose(rhs, (*r_batch, group, *sorted((*r_contract, *r_free))))  # (b..., G, K, N) | (b..., G, N, K)
        gs = _batched_sizes(group_sizes, batch_shape, dims)

        def one(a, b, gs):
            return ragged_rows(a, b, gs, offset, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                               precision=precision, zero_tail=True)
        return _over_batch(one, batch_shape, a, b, gs)  # (b..., M, N): dot_general's order
    if ragged in l_contract:  # mode 2: the weight gradient
        r_free = _free(rhs.ndim, r_contract, r_batch, dims.rhs_group_dimensions, "rhs", dims)
        if dims.rhs_group_dimensions:
            raise ValueError(f"a ragged contracting lhs dimension takes no rhs group dimension, got {dims}")
        if group_offset is not None:
            raise NotImplementedError(f"group_offset with a ragged contracting dimension ({dims})")
        a = jnp.transpose(lhs, (*l_batch, ragged, *l_free))  # (b..., M, K)
        b = jnp.transpose(rhs, (*r_batch, *r_contract, *r_free))  # (b..., M, N)
        gs = _batched_sizes(group_sizes, batch_shape, dims)

        def one(a, b, gs):
            return ragged_contracting(a, b, gs, out_dtype=out_dtype, precision=precision)
        out = _over_batch(one, batch_shape, a, b, gs)  # (b..., G, K, N)
        return jnp.moveaxis(out, len(batch_shape), 0)  # (G, b..., K, N)
    raise NotImplementedError(f"ragged_dot_general: a ragged batch dimension (lhs dimension {ragged}) is not "
                              f"supported, got {dims}")


def _free(ndim: int, contract, batch, group, name: str, dims) -> list[int]:
    """The one free (non-contracting, non-batch, non-group) dimension of an operand."""
    used = (*contract, *batch, *group)
    if any(not 0 <= d < ndim for d in used) or len(set(used)) != len(used):
        raise ValueError(f"{name} of rank {ndim}: ragged_dot_dimension_numbers name dimensions out of range or twice, "
                         f"got {dims}")
    free = [d for d in range(ndim) if d not in used]
    if len(free) != 1:
        raise NotImplementedError(f"ragged_dot_general supports one free dimension of {name}, got {len(free)} "
                                  f"(rank {ndim}) with {dims}")
    return free


def _batched_sizes(group_sizes, batch_shape, dims):
    """(b..., G) int32 group sizes: (G,) broadcast over the batch, or already (b..., G)."""
    gs = _checks.as_int32(group_sizes)
    if gs.ndim == 1:
        return jnp.broadcast_to(gs, (*batch_shape, gs.shape[0]))
    if gs.shape[:-1] != batch_shape:
        raise ValueError(f"group_sizes must have shape (G,) or (b..., G) with batch shape {batch_shape} "
                         f"from {dims}, got {gs.shape}")
    return gs


def _over_batch(fn, batch_shape, *args):
    """fn over the leading batch dims of every argument, as one vmap (one batched kernel call)."""
    if not batch_shape:
        return fn(*args)
    flat = [x.reshape((math.prod(batch_shape), *x.shape[len(batch_shape):])) for x in args]
    out = jax.vmap(fn)(*flat)
    return out.reshape((*batch_shape, *out.shape[1:]))
