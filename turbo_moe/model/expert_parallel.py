"""Expert parallelism: the MoE paths inside `shard_map`, routed experts split over an `expert` axis.

    path = ep_moe_path("turbo", mesh=mesh, ep_exchange="deepep")   # mesh axes e.g. ("data", "expert")
    y, stats = path(x, routing, weights)   # same signature and results as the one-device path

Tokens (the batch dim B) are split over every mesh axis; the routed experts' weights are split over
`expert` on their leading E dim (rank p owns experts [p*E/P, (p+1)*E/P)) and replicated over the other
axes (their gradients are summed over those axes by shard_map's autodiff). Stats are summed over
every rank, so `expert_load` and `dropped_fraction` equal the one-device values.

Each path's exchange and GEMM come from its (moe_path, ep_exchange) row of `paths.PATHS`: dense_cf
moves capacity slots with `all_to_all`, ragged uses the ragged exchange whatever ep_exchange says,
turbo and pallas take ep_exchange="deepep" (moe_dispatch/moe_combine; ep_capacity_factor in (0, 1) caps
the slots, overflow counted as dropped) or "ragged_all_to_all". All buffers are static worst cases.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from turbo_moe.model.ep_exchange import deepep_capacity
from turbo_moe.model.experts import ExpertStats, ExpertWeights
from turbo_moe.model.mesh import (  # noqa: F401  (expert_axis_size, mesh_device_count: re-exported)
    EXPERT_AXIS, expert_axis_size, mesh_device_count, mesh_or_ambient, mesh_platform)
from turbo_moe.model.paths import ExpertFfn, build_stage, device_gemms, path_row, run_stage
from turbo_moe.model.router import Routing
from turbo_moe.ops.ragged_exchange import default_impl
from turbo_moe.ops.varying import make_varying

def _varying_like(w: ExpertWeights, axes: tuple[str, ...]) -> ExpertWeights:
    """Expert weights typed as varying over every mesh axis, like the tokens they meet.

    They are replicated over the non-expert axes; this cast's transpose sums their gradients over
    those axes. Doing it here also gives the FFI ops' custom_vjps operands of one varying type."""
    return jax.tree.map(lambda a: make_varying(a, frozenset(axes)), w)  # every leaf (Fp8Weights have four)


def ep_moe_path(path: str, *, mesh=None, expert_axis: str = EXPERT_AXIS, capacity_factor: float = 1.25,
                ep_exchange: str = "deepep", ep_capacity_factor: float = 0.0, exchange_impl: str | None = None,
                ep_layout: str = "auto", expert_backward: str = "block", swiglu_impl: str = "auto"):
    """A MoE path `(x (B, S, D), routing, weights) -> (y, ExpertStats)` running expert-parallel.

    mesh: a Mesh with an `expert_axis` (None: the ambient mesh of `jax.set_mesh`). B must divide by
    the number of devices and E by the expert-axis size. exchange_impl: "native" ragged_all_to_all or
    the "emulated" one (CPU); default by the mesh's platform. ep_layout: deepep's dispatch layout
    (`ModelConfig.ep_layout`). expert_backward ("block" | "autodiff"), swiglu_impl ("auto" | "kernel" | "xla"): each
    rank's local experts' backward and SwiGLU; the model always runs the defaults, the others are test references.
    """
    row = path_row(path, ep_exchange)  # a ValueError naming the argument for a pair the table lacks
    if not (isinstance(ep_capacity_factor, (int, float)) and math.isfinite(ep_capacity_factor)):
        raise ValueError(f"ep_capacity_factor: must be a finite number, got {ep_capacity_factor!r}")
    mesh = mesh_or_ambient(mesh)
    if expert_axis not in mesh.axis_names:
        raise ValueError(f"mesh: has axes {mesh.axis_names}, no expert axis {expert_axis!r}")
    impl = exchange_impl or default_impl(mesh_platform(mesh))
    batch_axes = tuple(mesh.axis_names)  # tokens are split over every device
    n_devices = math.prod(dict(mesh.shape).values())
    n_ranks = dict(mesh.shape)[expert_axis]

    def run(x: jax.Array, routing: Routing, weights: ExpertWeights) -> tuple[jax.Array, ExpertStats]:
        b, s, _ = x.shape
        k = routing.expert_ids.shape[-1]
        n_experts = weights.n_experts
        if n_experts % n_ranks:
            raise ValueError(f"n_experts={n_experts} must be divisible by the {expert_axis!r} axis size {n_ranks}")
        if b % n_devices:
            raise ValueError(f"x: batch {b} must be divisible by the {n_devices} devices of the mesh "
                             f"{dict(mesh.shape)}")
        gemms = device_gemms(row, path, swiglu_impl)
        capacity = deepep_capacity(b * s // n_devices, ep_capacity_factor)

        def sharded(x, ids, combine_w, w):
            ffn = ExpertFfn(_varying_like(w.astype(x.dtype), batch_axes), gemms)  # this rank's experts
            stage = build_stage(row, ffn, expert_backward == "block", seq_len=s, capacity_factor=capacity_factor,
                                axis_name=expert_axis, impl=impl, capacity=capacity, layout=ep_layout)
            y, done = run_stage(stage, x, ids, combine_w, n_experts)
            load = jnp.zeros((n_experts,), jnp.float32).at[ids.reshape(-1)].add(1.0)  # (E,) before drops
            load = jax.lax.psum(load, batch_axes)
            total = b * s * k  # every copy of the global batch
            not_done = jax.lax.psum(done.astype(jnp.int32), batch_axes) * -1 + total  # exact integer count
            return y, load, not_done.astype(jnp.float32) / total

        tokens_spec, experts_spec = P(batch_axes), P(expert_axis)
        y, load, dropped = jax.shard_map(
            sharded, mesh=mesh,
            in_specs=(tokens_spec, tokens_spec, tokens_spec, ExpertWeights(experts_spec, experts_spec)),
            out_specs=(tokens_spec, P(), P()),
        )(x, routing.expert_ids, routing.weights.astype(jnp.float32), weights)
        return y, ExpertStats(load, dropped)

    return run


def data_parallel_moe_path(local_path: Callable, *, mesh=None):
    """A one-device MoE path run per device inside `shard_map` on a mesh without expert parallelism.

    Each device runs its own tokens against the whole (gathered) expert weights. Without this, XLA's
    partitioner replicates the FFI custom calls: every device would run the whole global batch.
    """
    mesh = mesh_or_ambient(mesh)
    batch_axes = tuple(mesh.axis_names)
    n_devices = mesh_device_count(mesh)

    def run(x: jax.Array, routing: Routing, weights: ExpertWeights) -> tuple[jax.Array, ExpertStats]:
        if x.shape[0] % n_devices:
            raise ValueError(f"x: batch {x.shape[0]} must be divisible by the {n_devices} devices of the mesh "
                             f"{dict(mesh.shape)}")

        def sharded(x, ids, combine_w, w):
            y, stats = local_path(x, Routing(ids, combine_w, None), _varying_like(w, batch_axes))
            # Every device holds the same number of copies, so the mean of the fractions is exact.
            return y, jax.lax.psum(stats.expert_load, batch_axes), jax.lax.pmean(stats.dropped_fraction, batch_axes)

        tokens_spec = P(batch_axes)
        y, load, dropped = jax.shard_map(
            sharded, mesh=mesh,
            in_specs=(tokens_spec, tokens_spec, tokens_spec, ExpertWeights(P(), P())),
            out_specs=(tokens_spec, P(), P()),
        )(x, routing.expert_ids, routing.weights.astype(jnp.float32), weights)
        return y, ExpertStats(load, dropped)

    return run
