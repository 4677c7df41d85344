"""Sum of rows by segment id, deterministic and without atomics: a drop-in for the common call of
`jax.ops.segment_sum` (and the backward of an embedding lookup, `model/embedding.py`).

XLA's GPU scatter-add serialises on repeated ids (the frequent tokens of real text; docs/performance.md). Here XLA sorts the ids (one small sort of N int32 pairs) and the kernel sums each
id's rows in float32 in a fixed order (kernels/{cpu,cuda}/segment_sum.*): cost N x D reads + V x D writes whatever
the ids' distribution, the same bits on the CPU and the GPU, and the same bits run to run.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from turbo_moe.ops import _checks
from turbo_moe.ops._ffi import ffi_call, match_varying


def segment_sum(data, segment_ids, num_segments: int, *, indices_are_sorted: bool = False):
    """out[v] = sum of data[i] over the i with segment_ids[i] == v.

    Args:
      data: (N, ...) bfloat16/float16/float32.
      segment_ids: integer (N,). An id outside [0, num_segments) drops its row (as `jax.ops.segment_sum` does).
      num_segments: V, static.
      indices_are_sorted: the ids are already ascending (the sort is skipped; unsorted ids then give an
        unspecified result, as in JAX).
    Returns (V, ...) in data's dtype: float32 sums rounded once; rows of absent ids are zero.
    Differentiable in `data` (its gradient gathers the incoming rows: `g[segment_ids]`, zero for dropped rows).
    """
    if jnp.ndim(data) < 1:
        raise ValueError(f"data must have rank >= 1 (N, ...), got shape {tuple(jnp.shape(data))}")
    _checks.float_dtype("data", jnp.result_type(data))
    _checks.check_rank("segment_ids", segment_ids, 1, "(N,)")
    _checks.check_integer("segment_ids", segment_ids)
    n = data.shape[0]
    if segment_ids.shape[0] != n:
        raise ValueError(f"segment_ids (N,) must have N={n} entries like data (N, ...), got {segment_ids.shape}")
    num_segments = _checks.static_int("num_segments", num_segments)
    ids = _checks.index_as_int32(segment_ids, num_segments)  # out of range -> -1: sorts first, dropped
    rows = data.reshape(n, math.prod(data.shape[1:]))
    summed = _segment_sum(rows, ids, num_segments, bool(indices_are_sorted))
    return summed.reshape((num_segments,) + data.shape[1:])


def _call(rows, ids, num_segments, indices_are_sorted):
    if indices_are_sorted:
        sorted_ids, order = ids, jax.lax.iota(jnp.int32, ids.shape[0])
    else:  # stable: equal ids keep their row order, so the sums' order is fixed
        sorted_ids, order = jax.lax.sort((ids, jax.lax.iota(jnp.int32, ids.shape[0])), num_keys=1, is_stable=True)
    out = jax.ShapeDtypeStruct((num_segments, rows.shape[1]), rows.dtype)
    return ffi_call("turbo_moe_segment_sum", out, rows, sorted_ids, order)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _segment_sum(rows, ids, num_segments, indices_are_sorted):
    return _call(rows, ids, num_segments, indices_are_sorted)


def _fwd(rows, ids, num_segments, indices_are_sorted):
    return _call(rows, ids, num_segments, indices_are_sorted), (ids, rows[:0])  # rows[:0]: the dtype, no data


def _bwd(num_segments, indices_are_sorted, residuals, g):
    ids, rows_type = residuals
    # Dropped rows (-1) point past the table and read the fill value.
    d_rows = jnp.take(g, jnp.where(ids >= 0, ids, num_segments), axis=0, mode="fill", fill_value=0)
    return match_varying(d_rows.astype(rows_type.dtype), rows_type), None


_segment_sum.defvjp(_fwd, _bwd)
