"""The model's normal initializer, and one switch that draws all of a model's normal parameters at once.

Why: XLA:CPU compiles every `jax.random` call site of an init program as its own random-bits graph, and the
CPU init is compile-bound (docs/notes/newcomer.md). Under `one_draw(key, total)` every `normal(std)` parameter
is instead a slice of ONE flat standard-normal draw of `total` elements, scaled by its std: one call site.
`vmap_layers` keeps that true for stacked layers (a slab per layer, sliced inside the vmap).

Outside `one_draw` (GPU, multi-device meshes, any direct construction of the model) `normal` is flax's
`nnx.initializers.normal`, bit for bit. Under it the values differ from per-parameter draws but are as random:
the slices are disjoint, so no two parameters share a draw. `count_normal(create, key)` finds `total` with an
abstract trace (jax.eval_shape: nothing is computed).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx


class _Flat:
    """Hands out consecutive slices of `flat` (None: only counts the elements asked for)."""

    def __init__(self, flat: jax.Array | None):
        self.flat, self.used = flat, 0

    def take(self, n: int) -> jax.Array | None:
        start, self.used = self.used, self.used + n
        if self.flat is None:
            return None
        if self.used > self.flat.shape[-1]:
            raise ValueError(f"one_draw: the model asked for more than the {self.flat.shape[-1]} normal elements "
                             f"drawn (count_normal and the init traced different models)")
        return self.flat[..., start:self.used]


_ACTIVE: contextvars.ContextVar[_Flat | None] = contextvars.ContextVar("turbo_moe_normal_draw", default=None)


def normal(stddev: float) -> Callable:
    """nnx.initializers.normal(stddev), or a slice of the active `one_draw` (times stddev)."""
    flax_normal = nnx.initializers.normal(stddev)

    def init(key, shape, dtype=jnp.float32, **kwargs):
        draw = _ACTIVE.get()
        if draw is None:
            return flax_normal(key, shape, dtype, **kwargs)
        values = draw.take(math.prod(shape))
        if values is None:  # counting (under eval_shape): only the shape matters
            return jnp.zeros(shape, dtype)
        return (values.reshape(shape) * stddev).astype(dtype)

    return init


@contextlib.contextmanager
def _using(draw: _Flat):
    token = _ACTIVE.set(draw)
    try:
        yield draw
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def one_draw(key: jax.Array, total: int):
    """Within it, the model's normal parameters are slices of one `total`-element normal draw from `key`."""
    with _using(_Flat(jax.random.normal(key, (total,), jnp.float32))) as draw:
        yield draw


def count_normal(create: Callable[[jax.Array], Any], key: jax.Array) -> int:
    """How many normal elements `create(key)` draws through `normal` (an abstract trace; nothing is computed)."""
    draw = _Flat(None)

    def counted(k):  # a fresh function each call: a cached trace would count nothing
        with _using(draw):
            return create(k)

    jax.eval_shape(counted, key)
    return draw.used


def vmap_layers(new_layer: Callable[[jax.Array], Any], keys: jax.Array) -> Any:
    """jax.vmap(new_layer)(keys); under `one_draw`, each layer's normal parameters come from its own row of one
    slab taken from the draw, so that the layers differ as their keys do."""
    draw = _ACTIVE.get()
    if draw is None:
        return jax.vmap(new_layer)(keys)
    per_layer = _Flat(None)
    with _using(per_layer):  # a fresh function: a cached trace of `new_layer` would count nothing
        jax.eval_shape(lambda key: new_layer(key), keys[0])
    n_layers = keys.shape[0]
    slab = draw.take(n_layers * per_layer.used)
    if slab is None:  # counting
        with _using(per_layer):
            return jax.vmap(new_layer)(keys)

    def layer(key, row):
        with _using(_Flat(row)):
            return new_layer(key)

    return jax.vmap(layer)(keys, slab.reshape(n_layers, per_layer.used))
