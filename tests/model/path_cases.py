"""Test helpers for the MoE path table: the marks a row needs, and CPU stand-ins for jax's Pallas
Mosaic-GPU ragged-dot kernels so that the `pallas` path's plumbing (padding, masking, custom_vjp, the
table rows, shard_map typing) runs in CPU tests. The real kernels run only on a Hopper GPU:
benchmarks/pallas_path_check.py checks them there.

The fakes keep the kernels' contracts: dims must divide by the blocks (the wrapper pads), rows outside
the groups are left unwritten (NaN here), negative group sizes poison the result (the wrapper clamps).
"""

import jax
import jax.numpy as jnp
import pytest

from tests.model.conftest import requires_turbo


def needs(row) -> list:
    """pytest marks for a row of turbo_moe.model.paths.PATHS: the FFI library for the turbo kernels."""
    return [requires_turbo] if row.exchange == "permute" or row.gemm == "turbo" else []


def _fake_ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps, grid_block_n,
                     transpose_rhs=False, **_):
    del max_concurrent_steps, grid_block_n
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    assert lhs.dtype == rhs.dtype, (lhs.dtype, rhs.dtype)
    assert m % block_m == 0 and k % block_k == 0 and n % block_n == 0, (lhs.shape, rhs.shape)
    w = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
    out = jax.lax.ragged_dot(lhs, w, group_sizes, preferred_element_type=jnp.float32)  # (M, N)
    rows = jax.lax.broadcasted_iota(jnp.int32, (m, 1), 0)
    written = (rows < jnp.sum(group_sizes)) & jnp.all(group_sizes >= 0)
    return jnp.where(written, out, jnp.nan).astype(lhs.dtype)


def _fake_transposed_ragged_dot(lhs, rhs, *, group_sizes, block_m, block_n, block_k, max_concurrent_steps,
                                grid_block_n, **_):
    """lhs (T, M), rhs (T, N) -> (G, M, N): each group's rows contracted."""
    del max_concurrent_steps, grid_block_n
    (t, m), n = lhs.shape, rhs.shape[1]
    assert lhs.dtype == rhs.dtype and t % block_k == 0 and m % block_m == 0 and n % block_n == 0
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(t)
    member = (rows[:, None] >= ends - group_sizes) & (rows[:, None] < ends)  # (T, G)
    out = jnp.einsum("tm,tn,tg->gmn", lhs.astype(jnp.float32), rhs.astype(jnp.float32), member.astype(jnp.float32))
    return jnp.where(jnp.all(group_sizes >= 0), out, jnp.nan).astype(lhs.dtype)


@pytest.fixture
def fake_pallas(monkeypatch):
    """Runs the `pallas` path on the CPU through the fakes (and tells it the device is a Hopper)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    from turbo_moe.ops import pallas_gemm

    monkeypatch.setattr(ragged_dot_mgpu, "ragged_dot", _fake_ragged_dot)
    monkeypatch.setattr(transposed_ragged_dot_mgpu, "transposed_ragged_dot", _fake_transposed_ragged_dot)
    monkeypatch.setattr(pallas_gemm, "hopper_problem", lambda: None)
