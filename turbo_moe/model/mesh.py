"""The device mesh, in one place: its axis names, how it is built, and how per-device code runs on it.

A mesh has two axes, ("data", "expert"). Tokens (the batch) are split over every device; routed experts over
"expert" (turbo_moe.model.sharding has the rule for every state). Functions take an explicit `mesh` or, when
traced inside `jax.sharding.use_abstract_mesh`, the ambient one.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

DATA_AXIS = "data"
EXPERT_AXIS = "expert"
MESH_AXES = (DATA_AXIS, EXPERT_AXIS)


def make_mesh(devices: list | None = None, expert_parallel: int = 1) -> Mesh:
    """(n_devices / expert_parallel, expert_parallel) mesh over ("data", "expert").

    Consecutive devices share an expert group, so the expert all-to-alls stay within a host when
    expert_parallel divides the devices per host."""
    devices = jax.devices() if devices is None else devices
    if not isinstance(expert_parallel, int) or expert_parallel <= 0 or len(devices) % expert_parallel:
        raise ValueError(f"expert_parallel must be a positive int dividing the {len(devices)} devices, "
                         f"got {expert_parallel!r}")
    return Mesh(np.asarray(devices).reshape(len(devices) // expert_parallel, expert_parallel), MESH_AXES)


def mesh_or_ambient(mesh=None):
    """`mesh`, or the ambient abstract mesh; raises when there is neither."""
    if mesh is not None:
        return mesh
    ambient = jax.sharding.get_abstract_mesh()
    if ambient is None or ambient.empty:
        raise ValueError("mesh: no mesh given and no ambient mesh set (use `jax.set_mesh(mesh)` or pass mesh=)")
    return ambient


def mesh_shape(mesh=None) -> dict:
    """{axis: size} of `mesh` (or the ambient mesh); {} when there is none."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh is None or mesh.empty:
            return {}
    return dict(mesh.shape)


def expert_axis_size(mesh=None, expert_axis: str = EXPERT_AXIS) -> int:
    """Size of `expert_axis` in `mesh` (or the ambient mesh); 1 when there is no mesh or no such axis."""
    return mesh_shape(mesh).get(expert_axis, 1)


def mesh_device_count(mesh=None) -> int:
    """Devices of `mesh` (or the ambient mesh); 1 when there is none."""
    return math.prod(mesh_shape(mesh).values())


def mesh_platform(mesh) -> str:
    """The platform of `mesh`'s devices; JAX's default backend for an abstract mesh, which names none."""
    if isinstance(mesh, Mesh) and mesh.devices.size:
        return mesh.devices.flat[0].platform
    return jax.default_backend()


def batch_sharded(fn: Callable, *, mesh=None) -> Callable:
    """`fn(x, *replicated)` run per device on its shard of x's leading (batch) axis inside `shard_map`, on a mesh of
    more than one device; `fn` itself otherwise, or when the batch does not divide over the devices. For FFI
    calls whose rows are independent (the router's choice): XLA's partitioner would replicate them instead, each
    device running the whole global batch."""
    n_devices = mesh_device_count(mesh)
    if n_devices <= 1:
        return fn

    def run(x, *replicated):
        if x.shape[0] % n_devices:
            return fn(x, *replicated)
        m = mesh_or_ambient(mesh)
        axes = tuple(m.axis_names)
        return jax.shard_map(fn, mesh=m, in_specs=(P(axes), *(P() for _ in replicated)), out_specs=P(axes))(
            x, *replicated)

    return run


def batch_summed(fn: Callable, *, mesh=None) -> Callable:
    """`fn(*batched)` run per device on its shard of every operand's leading (batch) axis inside `shard_map`, the
    devices' results summed (psum), on a mesh of more than one device; `fn` itself otherwise, or when the batch does
    not divide over the devices. For FFI reductions over the batch (the embedding's segment-sum backward), which
    XLA's partitioner would run whole on every device after gathering the batch."""
    n_devices = mesh_device_count(mesh)
    if n_devices <= 1:
        return fn

    def run(*batched):
        if batched[0].shape[0] % n_devices:
            return fn(*batched)
        m = mesh_or_ambient(mesh)
        axes = tuple(m.axis_names)
        local = lambda *shards: jax.lax.psum(fn(*shards), axes)
        return jax.shard_map(local, mesh=m, in_specs=tuple(P(axes) for _ in batched), out_specs=P())(*batched)

    return run
