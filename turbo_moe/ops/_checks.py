"""Trace-time argument checks shared by the ops: errors name the argument and what was expected.

Integer operands reach the kernels as int32. A wider dtype (int64 under x64, uint32, uint64, or a
NumPy int64 array, which JAX would otherwise truncate to int32) is narrowed by value, never by
wrapping: an expert id or row index out of range stays out of range (2**32 + 1 must not become 1),
and a group size saturates at the int32 maximum.
"""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
INT32_MAX = int(np.iinfo(np.int32).max)


def float_dtype(name: str, dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {dtype}")
    return dtype


def check_rank(name: str, x, rank: int, layout: str) -> None:
    shape = tuple(x.shape) if hasattr(x, "shape") else tuple(jnp.shape(x))  # an array, or an array-like pytree
    if len(shape) != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {shape}")


def check_integer(name: str, x) -> None:
    if not jnp.issubdtype(_dtype(x), jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got dtype {_dtype(x)}")


def static_int(name: str, value, *, minimum: int = 1, maximum: int = INT32_MAX) -> int:
    """A static (Python) integer argument in [minimum, maximum]; bools and floats are TypeErrors."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a Python int (static), got {type(value).__name__} {value!r}")
    if not minimum <= int(value) <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")
    return int(value)


def static_bool(name: str, value) -> bool:
    """A static (Python or NumPy) bool argument; anything else (a traced array, 0/1, a string) is a TypeError."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python bool (static), got {type(value).__name__} {value!r}")
    return bool(value)


def _dtype(x) -> np.dtype:
    # The array's own dtype: jnp.result_type would report a NumPy int64 as int32 without x64.
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def _narrow(x, fix):
    """x as an int32 jax array; dtypes wider than int32 go through ``fix(xp, x)`` in their own dtype."""
    dtype = _dtype(x)
    if dtype.itemsize < 4 or dtype == np.int32:  # every value fits: a plain cast is exact
        return jnp.asarray(x).astype(np.int32)
    if isinstance(x, jax.Array):
        return fix(jnp, x)
    return jnp.asarray(fix(np, np.asarray(x)))  # before JAX sees it: without x64 it would wrap


def as_int32(x) -> jax.Array:
    """Group sizes as int32, saturating: negative stays <= 0 (counts as 0), huge becomes INT32_MAX."""
    return _narrow(x, lambda xp, v: xp.clip(v, 0, INT32_MAX).astype(np.int32))


def rows_per_problem(valid_rows, h) -> jax.Array:
    """An op's `valid_rows` for h (..., M, 2F): None (every row: M) or an integer array of h.shape[:-2], one count a
    (M, 2F) problem -> int32 (saturating)."""
    if valid_rows is None:
        return jnp.full(h.shape[:-2], h.shape[-2], jnp.int32)
    check_integer("valid_rows", valid_rows)
    if jnp.shape(valid_rows) != h.shape[:-2]:
        raise ValueError(f"valid_rows must be {h.shape[:-2]} (one count a (M, 2F) problem of h {h.shape}), "
                         f"got {jnp.shape(valid_rows)}")
    return as_int32(valid_rows)


def index_as_int32(x, bound: int) -> jax.Array:
    """Ids / row indices as int32: values in [0, bound) kept, any other value becomes -1 (none/dropped)."""
    def fix(xp, v):
        inside = (v >= 0) & (v < bound)  # compared in v's own dtype: no wrap
        return xp.where(inside, xp.where(inside, v, 0).astype(np.int32), -1).astype(np.int32)
    return _narrow(x, fix)


def expert_parallel_inputs(x, expert_ids, weights, num_experts, axis_name: str) -> tuple[int, int, int, int]:
    """The checks every expert-parallel dispatch makes of x (T, H), expert_ids (T, k), weights (T, k), num_experts
    and the mesh axis: returns (T, k, num_experts, P), P the axis size (num_experts must divide over it)."""
    check_rank("x", x, 2, "(T, H)")
    check_rank("expert_ids", expert_ids, 2, "(T, k)")
    check_rank("weights", weights, 2, "(T, k)")
    check_integer("expert_ids", expert_ids)
    float_dtype("x", x.dtype)
    T, k = expert_ids.shape
    if x.shape[0] != T or weights.shape != (T, k):
        raise ValueError(f"x (T, H), expert_ids (T, k) and weights (T, k) disagree: {x.shape}, {expert_ids.shape}, "
                         f"{weights.shape}")
    num_experts = static_int("num_experts", num_experts)
    P = jax.lax.axis_size(axis_name)
    if num_experts % P:
        raise ValueError(f"num_experts={num_experts} must be divisible by the size {P} of mesh axis {axis_name!r}")
    return T, k, num_experts, P
