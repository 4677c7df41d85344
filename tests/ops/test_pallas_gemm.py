"""pallas_grouped_gemm's wrapper (padding, clamping, masking, custom_vjp) on the CPU through fakes of jax's
Mosaic-GPU kernels that keep their contracts; the kernels themselves: benchmarks/pallas_path_check.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.model.path_cases import fake_pallas  # noqa: F401  (fixture)
from turbo_moe.ops.pallas_gemm import pallas_grouped_gemm

CASES = [  # (M, K, N, group sizes): sizes not multiples of 8, empty groups, short and clamped layouts
    (200, 96, 80, [50, 0, 107, 43]),  # K, N need padding; group edges inside the kernel's tiles
    (256, 128, 128, [0, 256, 0, 0]),  # one group, the others empty
    (130, 64, 256, [7, 0, 13, 0, 50]),  # sum 70 < M: rows past the groups are zero
    (64, 64, 128, [40, -5, 40]),  # negative counts as 0, the layout is clamped to M
]


def reference(lhs, rhs, sizes):
    """float32 ragged_dot of the clamped layout (negative sizes 0, at most M rows)."""
    ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), lhs.shape[0])
    clamped = jnp.asarray(np.diff(ends, prepend=0), jnp.int32)
    return jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), clamped)


@pytest.mark.parametrize("m,k,n,sizes", CASES)
def test_forward_and_grads_match_float32_ragged_dot(m, k, n, sizes, fake_pallas):
    keys = jax.random.split(jax.random.key(m + k + n), 3)
    lhs = jax.random.normal(keys[0], (m, k)).astype(jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (len(sizes), k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    probe = jax.random.normal(keys[2], (m, n))
    group_sizes = jnp.asarray(sizes, jnp.int32)

    out = jax.jit(pallas_grouped_gemm)(lhs, rhs, group_sizes)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    want = reference(lhs, rhs, np.asarray(sizes))
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=2e-2)
    covered = min(int(np.maximum(sizes, 0).sum()), m)
    assert np.all(np.asarray(out[covered:], np.float32) == 0.0), "rows past the groups must be zero"

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32) * probe)

    got = jax.jit(jax.grad(loss(lambda a, b: pallas_grouped_gemm(a, b, group_sizes)), argnums=(0, 1)))(lhs, rhs)
    ref = jax.grad(loss(lambda a, b: reference(a, b, np.asarray(sizes))), argnums=(0, 1))(lhs, rhs)
    for g, r in zip(got, ref):
        assert g.dtype == jnp.bfloat16
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g / np.abs(r).max(), r / np.abs(r).max(), rtol=2e-2, atol=2e-2)
    empty = [i for i, s in enumerate(sizes) if s <= 0]
    assert np.all(np.asarray(got[1])[empty] == 0), "empty groups get zero weight gradients"


def test_needs_hopper_and_half_precision():
    lhs, rhs, sizes = jnp.ones((8, 64), jnp.bfloat16), jnp.ones((2, 64, 128), jnp.bfloat16), jnp.array([4, 4])
    with pytest.raises(ValueError, match="Hopper GPU"):
        pallas_grouped_gemm(lhs, rhs, sizes)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        pallas_grouped_gemm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    with pytest.raises(ValueError, match="K=32"):
        pallas_grouped_gemm(lhs[:, :32], rhs, sizes)
