"""Float32 master weights kept as their bf16 compute copy plus 16 low bits (`TrainConfig.master_weights="split"`).

A float32 x is hi + lo exactly when hi is x's top 16 bits rounded half up (a bfloat16, what the forward pass reads)
and lo is x's low 16 bits (uint16): the rounding direction is recoverable from lo alone (up iff lo >= 0x8000), so
x = ((bits(hi) - up) << 16) | lo. The optimizer joins the two, updates float32 as before and splits the result: it reads
and writes 2 + 2 bytes a weight where `cast_params_in_update` reads 4 and writes 4 + 2 (the float32 master and the
separate bf16 copy). hi differs from round-to-nearest-even only at exact ties (x's low 16 bits
0x8000, one value in 65536), where it rounds up in magnitude.

Edge cases: a finite x at or past bf16's largest value + half an ulp gets hi = +-inf (as round-to-nearest-even does)
and still joins back exactly (the carry is undone). A nan's hi is a nan of the same sign (its top bits with the quiet
bit set; rounding up could carry a nan into -0 or inf) and joins back without the carry: quiet nans come back bit for
bit, signalling ones quietened. No scheme can do better: hi nan + 16 bits name 2 * (2**23 - 2**16) values, fewer than
float32's 2 * (2**23 - 1) nans.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

_HALF = 0x8000  # lo at or above it: hi was rounded up
_QUIET = 0x0040  # bf16's top mantissa bit: set, it keeps a nan's hi a nan


def _check(name: str, value, dtype) -> None:
    got = getattr(value, "dtype", None)
    if got != dtype:
        raise TypeError(f"{name} must be a {jnp.dtype(dtype).name} array, got "
                        f"{got if got is not None else type(value).__name__}")


def split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 x -> (hi bfloat16, lo uint16) with join(hi, lo) == x bit for bit (nans: see the module doc)."""
    _check("split: x", x, jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (bits + jnp.uint32(_HALF)) >> 16  # half up in magnitude: the bits are sign-magnitude
    hi = jnp.where(jnp.isnan(x), (bits >> 16) | jnp.uint32(_QUIET), rounded).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(hi, jnp.bfloat16), (bits & 0xFFFF).astype(jnp.uint16)


def join(hi: jax.Array, lo: jax.Array) -> jax.Array:
    """(hi bfloat16, lo uint16) from `split` -> the float32 they came from."""
    _check("join: hi", hi, jnp.bfloat16)
    _check("join: lo", lo, jnp.uint16)
    if hi.shape != lo.shape:
        raise ValueError(f"join: hi and lo must have one shape, got {hi.shape} and {lo.shape}")
    hi_bits = jax.lax.bitcast_convert_type(hi, jnp.uint16).astype(jnp.uint32)
    lo_bits = lo.astype(jnp.uint32)
    up = ((lo_bits >= _HALF) & ~jnp.isnan(hi)).astype(jnp.uint32)  # a nan's hi was not rounded
    return jax.lax.bitcast_convert_type(((hi_bits - up) << 16) | lo_bits, jnp.float32)


def split_params(params, paths: frozenset):
    """nnx.State of float32 params -> (the same State with bf16 hi at `paths`, a State of the uint16 lo there).

    The lo variables are copies of the params' (`var.replace`): same type and metadata, so `state_shardings` lays
    each one out as its param."""
    flat, low = [], []
    for path, var in nnx.to_flat_state(params):
        if path in paths:
            hi, lo = split(var[...])
            flat.append((path, var.replace(hi)))
            low.append((path, var.replace(lo)))
        else:
            flat.append((path, var))
    return nnx.from_flat_state(flat), nnx.from_flat_state(low)


def joined_params(params, low):
    """`split_params`' inverse: float32 params from the hi at `low`'s paths and `low`."""
    lows = dict(nnx.to_flat_state(low))
    return nnx.from_flat_state([(path, var.replace(join(var[...], lows[path][...])) if path in lows else var)
                                for path, var in nnx.to_flat_state(params)])
