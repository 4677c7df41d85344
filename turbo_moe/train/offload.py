"""The optimizer's state in host memory between steps (`TrainConfig.optimizer_state_memory="host"`).

What only the update reads, `TrainState.opt_state` (the AdamW moments) and `TrainState.master_low` (with
master_weights="split", the master weights' low 16 bits), keeps its layout but lives in the devices' "pinned_host"
memory: its NamedShardings `.with_memory_kind("pinned_host")`. The train step brings it to the device for the update
(`to_device`) and its out_shardings send the new state back; the init program's out_shardings and a checkpoint
restore's target shardings put it there directly. What the forward pass reads (params, router biases) stays on the
device, and so do scalars (optax's step count): they free nothing and the schedule reads them.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

HOST = "pinned_host"
DEVICE = "device"
OFFLOADED_FIELDS = ("opt_state", "master_low")  # TrainState fields read by the update alone


def check_host_memory(mesh: Mesh) -> None:
    """Refuse a mesh whose devices have no pinned host memory kind, naming the config field."""
    here = jax.process_index()  # another process's devices list no memories here
    device = next((d for d in mesh.devices.flat if d.process_index == here), mesh.devices.flat[0])
    kinds = [memory.kind for memory in device.addressable_memories()]
    if HOST not in kinds:
        raise ValueError(f"TrainConfig.optimizer_state_memory='host' keeps the optimizer state in {HOST!r} memory, "
                         f"but the {device.platform} devices have none (their memory kinds: {kinds}); set it to "
                         f"'device'")


def host_shardings(state_sharding, abstract_state):
    """`state_sharding` (a TrainState of NamedShardings) with the OFFLOADED_FIELDS' leaves of rank >= 1 in pinned
    host memory; `abstract_state` (the same tree of ShapeDtypeStructs) gives the ranks."""

    def place(sharding, shape):
        return sharding.with_memory_kind(HOST) if len(shape.shape) else sharding

    return state_sharding._replace(**{name: jax.tree.map(place, getattr(state_sharding, name),
                                                          getattr(abstract_state, name))
                                      for name in OFFLOADED_FIELDS})


def to_device(tree: Any, shardings: Any) -> Any:
    """Inside a jitted step: the leaves of `tree` whose sharding is in host memory, copied to the device."""

    def move(x, sharding):
        return jax.device_put(x, sharding.with_memory_kind(DEVICE)) if sharding.memory_kind == HOST else x

    return jax.tree.map(move, tree, shardings)


def on_device(state, stored):
    """`state` (a TrainState, traced) with the OFFLOADED_FIELDS that `stored` (its shardings) keeps on the host
    brought to the device."""
    return state._replace(**{name: to_device(getattr(state, name), getattr(stored, name))
                             for name in OFFLOADED_FIELDS})
