"""Trace-time argument checks shared by the ops: errors name the argument and what was expected."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def float_dtype(name: str, dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be bfloat16, float16 or float32, got {dtype}")
    return dtype


def check_rank(name: str, x, rank: int, layout: str) -> None:
    if jnp.ndim(x) != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {tuple(jnp.shape(x))}")


def check_integer(name: str, x) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32), got dtype {jnp.result_type(x)}")


def as_int32(x) -> jax.Array:
    return jnp.asarray(x).astype(np.int32)
