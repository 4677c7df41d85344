"""AdamW's second moment stored in a low-precision dtype (`TrainConfig.moments_dtype`).

optax has `mu_dtype` but no `nu_dtype`: `with_adam_nu_dtype` wraps optax's own adamw (its arithmetic unchanged, on a
float32 copy of the stored nu) and rounds only the nu kept for the next step. A bfloat16 nu is rounded stochastically:
round-to-nearest (DeepSeek-V3's description) drops the increment (1 - b2) g^2 whenever it is under half an ulp of nu,
so a bf16 nu runs low (measured: docs/configuration.md); stochastic rounding keeps the stored value unbiased. Its random bits are a
counter hash of (step, leaf, element): no PRNG state, the same bits on any sharding, fused into the update's pass.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def _is_adam(node) -> bool:
    return isinstance(node, optax.ScaleByAdamState)


def _map_adam_nu(state, fn):
    """`state` (any optax state tree) with fn(adam_state) -> new nu applied to every ScaleByAdamState in it (found by
    type, not position: adamw's state nests it in chain / masked states)."""
    return jax.tree.map(lambda node: node._replace(nu=fn(node)) if _is_adam(node) else node, state, is_leaf=_is_adam)


def _hash32(x: jax.Array) -> jax.Array:
    """uint32 -> uint32 mixing (murmur3's finaliser): consecutive counters give unrelated bits."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def stochastic_round_to_bf16(x: jax.Array, seed: jax.Array) -> jax.Array:
    """float32 -> bfloat16 rounded up with probability (x - down) / ulp: unbiased, E[result] = x. Adds 16 random bits
    below bf16's last kept bit and truncates. `seed` (uint32 scalar) picks the bits; the element's flat index varies
    them. Finite inputs (a carry out of the top mantissa bit correctly bumps the exponent)."""
    if x.dtype != jnp.float32:
        raise ValueError(f"stochastic_round_to_bf16 expects float32, got {x.dtype}")
    index = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)  # an iota: XLA fuses it
    noise = _hash32(index * jnp.uint32(0x9E3779B1) + seed) & jnp.uint32(0xFFFF)
    bits = (jax.lax.bitcast_convert_type(x, jnp.uint32) + noise) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(bits, jnp.float32).astype(jnp.bfloat16)  # exact: the low bits are zero


def with_adam_nu_dtype(inner: optax.GradientTransformation, nu_dtype) -> optax.GradientTransformationExtraArgs:
    """`inner` (optax's own Adam/AdamW) with its second moment stored in `nu_dtype`: rounded stochastically to
    bfloat16, cast to any other dtype. The state has the same tree as `inner`'s: only nu's dtype differs."""
    dtype = jnp.dtype(nu_dtype)

    def store(adam: optax.ScaleByAdamState):
        if dtype != jnp.bfloat16:
            return jax.tree.map(lambda v: v.astype(dtype), adam.nu)
        # a seed per (step, leaf): optax's count is this step's number
        step = jnp.asarray(adam.count).astype(jnp.uint32) * jnp.uint32(0x27D4EB2F)
        leaves, treedef = jax.tree.flatten(adam.nu)
        return jax.tree.unflatten(treedef, [stochastic_round_to_bf16(
            v.astype(jnp.float32), _hash32(step + jnp.uint32(0x165667B1 * (i + 1) & 0xFFFFFFFF)))
            for i, v in enumerate(leaves)])

    def init(params):
        return _map_adam_nu(inner.init(params), lambda adam: jax.tree.map(lambda v: v.astype(dtype), adam.nu))

    def update(updates, state, params=None, **extra_args):
        # optax's own update on a float32 copy of the stored nu: the new moment and this step's update are
        # computed unrounded, only the nu kept for the next step is rounded (optax returns nu in the old one's dtype).
        upcast = _map_adam_nu(state, lambda adam: jax.tree.map(lambda v: v.astype(jnp.float32), adam.nu))
        updates, state = inner.update(updates, upcast, params, **extra_args)
        return updates, _map_adam_nu(state, store)

    return optax.GradientTransformationExtraArgs(init, update)
