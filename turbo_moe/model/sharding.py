"""Sharding declared on the parameters: logical axis names in each variable's metadata, and the rule
that turns them into a `PartitionSpec` on a ("data", "expert") mesh.

A parameter names the dims that have a meaning for sharding in its `logical_axes` metadata:
`"expert"` (split over the expert mesh axis) and `"layer"` (the stacked layer axis of a `BlockStack`,
never split: the scan slices it). Every other dim is `None`. The rule (ZeRO-3 / FSDP):

- routed-expert states: E over "expert", and the largest other dim that divides over "data";
- every other state: its largest dim that divides over all devices ("data" and "expert" together);
- what does not divide stays replicated on that axis (small vectors, odd sizes).

Optimizer moments mirror the parameter tree (same variables, same metadata), so they get the same
specs; scalars (step counts) are replicated. XLA gathers each layer's slice inside the scan body.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from turbo_moe.model.mesh import DATA_AXIS, EXPERT_AXIS

LAYER_AXIS = "layer"
METADATA_KEY = "logical_axes"


def logical_axes(var: nnx.Variable) -> tuple:
    """The variable's logical axis names, one per dim (None where none was declared)."""
    ndim = len(jax.tree.leaves(var)[0].shape)
    axes = tuple(var.get_metadata().get(METADATA_KEY) or ())
    if len(axes) > ndim:
        raise ValueError(f"logical_axes {axes} name more dims than the variable's {ndim}")
    return axes + (None,) * (ndim - len(axes))


def with_leading_axis(state: Any, name: str) -> Any:
    """Prepend `name` to the logical axes of every variable in `state` (whose arrays gained axis 0)."""

    def add(var):
        if not isinstance(var, nnx.Variable):
            return var
        declared = tuple(var.get_metadata().get(METADATA_KEY) or ())
        ndim = len(jax.tree.leaves(var)[0].shape)
        inner = declared + (None,) * (ndim - 1 - len(declared))
        return var.replace(**{METADATA_KEY: (name,) + inner})

    return jax.tree.map(add, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _split_largest(shape: tuple, spec: list, taken: set, mesh_axes: tuple, size: int) -> None:
    """Put `mesh_axes` (of total `size`) on the largest free dim of `shape` divisible by `size`."""
    if size <= 1:
        return
    free = [d for d in range(len(shape)) if d not in taken and shape[d] % size == 0 and shape[d] >= size]
    if free:
        best = max(free, key=lambda d: (shape[d], -d))
        spec[best] = mesh_axes if len(mesh_axes) > 1 else mesh_axes[0]


def partition_spec(shape: tuple, axes: tuple, mesh_shape: Mapping[str, int], *, fsdp: bool = True) -> P:
    """PartitionSpec of one state leaf of `shape` with logical `axes` on a mesh of `mesh_shape`."""
    spec: list = [None] * len(shape)
    taken = {d for d, a in enumerate(axes) if a == LAYER_AXIS}
    n_expert = mesh_shape.get(EXPERT_AXIS, 1)
    n_data = mesh_shape.get(DATA_AXIS, 1)
    if EXPERT_AXIS in axes:
        e = axes.index(EXPERT_AXIS)
        taken.add(e)
        if n_expert > 1:
            if shape[e] % n_expert:
                raise ValueError(f"expert dim {shape[e]} of a {shape} state does not divide over the "
                                 f"{n_expert} devices of the {EXPERT_AXIS!r} mesh axis")
            spec[e] = EXPERT_AXIS
        if fsdp:
            _split_largest(shape, spec, taken, (DATA_AXIS,), n_data)
    elif fsdp:
        names = tuple(a for a in (DATA_AXIS, EXPERT_AXIS) if mesh_shape.get(a, 1) > 1)
        _split_largest(shape, spec, taken, names, math.prod(mesh_shape.get(a, 1) for a in names))
    return P(*spec)


def state_shardings(abstract_state: Any, mesh: Mesh, *, fsdp: bool = True) -> Any:
    """NamedShardings for a state (params, optimizer moments, ...) by its variables' metadata, same
    tree structure as the state. Leaves outside nnx variables (optimizer step counts) are replicated."""
    mesh_shape = dict(mesh.shape)

    def choose(leaf):
        if not isinstance(leaf, nnx.Variable):
            return NamedSharding(mesh, P())
        shape = tuple(jax.tree.leaves(leaf)[0].shape)
        sharding = NamedSharding(mesh, partition_spec(shape, logical_axes(leaf), mesh_shape, fsdp=fsdp))
        return jax.tree.map(lambda _: sharding, leaf)  # keeps the variable node and its metadata

    return jax.tree.map(choose, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
