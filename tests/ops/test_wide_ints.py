"""Integer operands wider than int32 are narrowed by value, never wrapped; static ints are checked.

Without x64 JAX truncates a NumPy int64 array to int32 (2**32 + 1 -> 1), so an out-of-range expert id
would reach expert 1; the ops narrow such inputs first (README: "Expert ids outside [0, E) drop that
copy"; "negative sizes count as 0, the layout is clamped to M").
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from turbo_moe.ops import PermuteHandle, grouped_gemm, grouped_gemm_weight_grad, moe_dispatch, permute, unpermute

T, K, E, H = 6, 2, 4, 8
WRAPS = [2**32 + 1, -(2**32) + 2, 2**40, -(2**63)]  # each wraps into [0, E) when truncated to int32


def _ids_with(wide_values, dtype):
    ids = np.array([[0, 1], [2, 3], [1, 1], [3, 0], [2, 2], [0, 3]], dtype=np.int64)
    bad = ids.copy().astype(dtype)
    positions = [(0, 1), (1, 0), (3, 1), (5, 0)][:len(wide_values)]
    for (t, j), v in zip(positions, wide_values):
        bad[t, j] = v
    dropped = ids.copy()
    for t, j in positions:
        dropped[t, j] = -1
    return bad, dropped.astype(np.int32)


def _x():
    return jax.random.normal(jax.random.key(0), (T, H), jnp.float32)  # float32 under x64 too


@pytest.mark.parametrize("dtype, values", [
    (np.int64, WRAPS), (np.uint64, [2**32 + 1, 2**40, 2**64 - 1]), (np.uint32, [2**31 + 1, 2**32 - 1])])
def test_wide_expert_ids_out_of_range_drop_the_copy(dtype, values):
    bad, dropped = _ids_with(values, dtype)
    got = permute(_x(), bad, E)
    want = permute(_x(), jnp.asarray(dropped), E)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    assert int(got[1].sum()) == T * K - len(values)  # the wide ids reached no expert


def test_int64_ids_under_x64_drop_the_copy():
    bad, dropped = _ids_with(WRAPS, np.int64)
    with enable_x64():
        ids = jnp.asarray(bad)
        assert ids.dtype == jnp.int64
        got = jax.jit(lambda x, i: permute(x, i, E))(_x(), ids)
    want = permute(_x(), jnp.asarray(dropped), E)
    np.testing.assert_array_equal(np.asarray(got[2].row_index), np.asarray(want[2].row_index))


def test_wide_group_sizes_saturate_instead_of_wrapping():
    lhs = jax.random.normal(jax.random.key(1), (T, H))
    rhs = jax.random.normal(jax.random.key(2), (2, H, 3))
    wide = np.array([2**32 + 1, -(2**32) + 5], np.int64)  # wrapped: [1, 5]
    want = grouped_gemm(lhs, rhs, jnp.array([T, 0], jnp.int32))  # saturated: all rows in group 0
    np.testing.assert_array_equal(np.asarray(grouped_gemm(lhs, rhs, wide)), np.asarray(want))
    d_out = jnp.ones((T, 3))
    np.testing.assert_array_equal(np.asarray(grouped_gemm_weight_grad(lhs, d_out, wide)),
                                  np.asarray(grouped_gemm_weight_grad(lhs, d_out, jnp.array([T, 0], jnp.int32))))
    with enable_x64():
        got = grouped_gemm(lhs, rhs, jnp.asarray(wide))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    sizes = np.array([2**31 + 7, 0], np.uint32)  # as int32 this would be negative, i.e. empty
    np.testing.assert_array_equal(np.asarray(grouped_gemm(lhs, rhs, sizes)), np.asarray(want))


def test_wide_row_index_out_of_range_contributes_nothing():
    y = jax.random.normal(jax.random.key(3), (T * K, H))
    rows = np.arange(T * K, dtype=np.int64).reshape(T, K)
    bad = rows.copy()
    bad[0, 0] = 2**32  # wrapped: row 0
    want_rows = rows.astype(np.int32)
    want_rows[0, 0] = -1
    w = jnp.ones((T, K))
    got = unpermute(y, PermuteHandle(bad), w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(unpermute(y, PermuteHandle(jnp.asarray(want_rows)), w)))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(y[1]))


@pytest.mark.parametrize("num_experts, error, message", [
    (True, TypeError, "num_experts must be a Python int"),
    (4.0, TypeError, "num_experts must be a Python int"),
    ("4", TypeError, "num_experts must be a Python int"),
    (0, ValueError, r"num_experts must be in \[1, 2147483647\]"),
    (2**31, ValueError, r"num_experts must be in \[1, 2147483647\]"),
])
def test_num_experts_must_be_a_static_int(num_experts, error, message):
    with pytest.raises(error, match=message):
        permute(_x(), jnp.zeros((T, K), jnp.int32), num_experts)


def test_numpy_integer_num_experts_is_accepted():
    assert permute(_x(), jnp.zeros((T, K), jnp.int32), np.int64(E))[1].shape == (E,)


def test_float_row_index_names_the_argument():
    with pytest.raises(TypeError, match="handle.row_index must be an integer array"):
        unpermute(jnp.ones((T * K, H)), PermuteHandle(jnp.zeros((T, K), jnp.float32)), jnp.ones((T, K)))
    with pytest.raises(ValueError, match="handle.row_index must have rank 2"):
        unpermute(jnp.ones((T * K, H)), PermuteHandle(jnp.zeros((T * K,), jnp.int32)), jnp.ones((T, K)))


def _dispatch(ranks, ids, capacity=None, num_experts=E):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:ranks]), ("expert",))
    spec = jax.sharding.PartitionSpec("expert")

    def body(x, i, w):
        rx, rids, rw, handle = moe_dispatch(x, i, w, num_experts=num_experts, axis_name="expert",
                                            capacity=capacity)
        return rids, handle.counts

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 2))(
        _x(), ids, jnp.ones((T, K), jnp.float32))


def test_moe_dispatch_wide_ids_and_bad_statics():
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    bad, dropped = _ids_with(WRAPS, np.int64)
    want = _dispatch(2, jnp.asarray(dropped))
    with enable_x64():
        got = _dispatch(2, jnp.asarray(bad))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(TypeError, match="capacity must be a Python int"):
        _dispatch(2, jnp.asarray(dropped), capacity=True)
    with pytest.raises(TypeError, match="num_experts must be a Python int"):
        _dispatch(2, jnp.asarray(dropped), num_experts=4.0)
