"""segment_sum (rows summed by id, sorted, no atomics) against a float64 numpy sum and jax.ops.segment_sum: dtypes,
widths that are not multiples of 8, absent and dropped ids, very skewed ids, batch (vmap) dims, the gradient, the
kernel's fixed addition order (bit for bit), and the errors that name the argument."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.ops import segment_sum

STRANDS = 8  # the kernels' strided partial sums (kernels/{cpu,cuda}/segment_sum.*)
TOLERANCE = {jnp.float32: 2e-6, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}  # relative to the largest |sum|


def reference(data, ids, num_segments):
    out = np.zeros((num_segments,) + data.shape[1:])
    keep = (ids >= 0) & (ids < num_segments)
    np.add.at(out, ids[keep], np.asarray(data, np.float64)[keep])
    return out


def kernel_order(data, ids, num_segments):
    """The kernels' float32 arithmetic: per id, STRANDS strided partial sums over its rows in row order, added
    strand 0 first, rounded once to data's dtype."""
    rows = np.asarray(data.astype(jnp.float32)).reshape(len(ids), -1)
    out = np.zeros((num_segments, rows.shape[1]), np.float32)
    for v in range(num_segments):
        members = np.flatnonzero(ids == v)
        strands = np.zeros((STRANDS, rows.shape[1]), np.float32)
        for j, r in enumerate(members):
            strands[j % STRANDS] += rows[r]
        total = np.zeros(rows.shape[1], np.float32)
        for s in strands:
            total += s
        out[v] = total
    return np.asarray(jnp.asarray(out).astype(data.dtype).astype(jnp.float32)).reshape((num_segments,) + data.shape[1:])


def skewed_ids(rng, n, num_segments):
    """Zipf ids (one id takes a third or more of the rows), most ids absent, some dropped on each side."""
    ids = np.minimum(rng.zipf(1.2, n) - 1, num_segments - 1)
    ids[rng.random(n) < 0.05] = -1
    ids[rng.random(n) < 0.05] = num_segments + 3
    return ids


def assert_close(got, expect, dtype):
    scale = max(np.abs(expect).max(), 1e-30)
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - expect).max() / scale, TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("n, d, num_segments", [(300, 37, 50), (2000, 8, 7), (513, 1, 1000), (64, 136, 3)])
def test_matches_float64_and_the_kernel_order(dtype, n, d, num_segments):
    rng = np.random.default_rng(n + d)
    data = jnp.asarray(rng.standard_normal((n, d)), dtype)
    ids = skewed_ids(rng, n, num_segments)
    got = segment_sum(data, jnp.asarray(ids, jnp.int32), num_segments)
    assert got.shape == (num_segments, d) and got.dtype == dtype
    assert_close(got, reference(np.asarray(data, np.float64), ids, num_segments), dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), kernel_order(data, ids, num_segments))


def test_absent_ids_give_zero_rows_and_dropped_rows_count_nowhere():
    data = jnp.ones((6, 3))
    got = np.asarray(segment_sum(data, jnp.asarray([4, -1, 4, 9, 0, -7]), 5))
    np.testing.assert_array_equal(got, [[1] * 3, [0] * 3, [0] * 3, [0] * 3, [2] * 3])


def test_wide_integer_ids_are_dropped_not_wrapped():
    ids = np.asarray([2 ** 32 + 1, 1, 2 ** 40], np.int64)  # 2**32 + 1 must not become 1
    got = np.asarray(segment_sum(jnp.ones((3, 2)), ids, 4))
    np.testing.assert_array_equal(got[1], [1, 1])
    assert got.sum() == 2


def test_equals_jax_segment_sum_with_trailing_dims_and_sorted_ids():
    rng = np.random.default_rng(3)
    data = jnp.asarray(rng.standard_normal((500, 3, 5)), jnp.float32)
    ids = np.sort(rng.integers(0, 40, 500))
    expect = jax.ops.segment_sum(data, jnp.asarray(ids), 40)
    for assume_sorted in (False, True):
        got = segment_sum(data, jnp.asarray(ids), 40, indices_are_sorted=assume_sorted)
        np.testing.assert_allclose(got, expect, rtol=1e-5, atol=1e-5)


def test_empty_input_gives_zeros():
    got = segment_sum(jnp.zeros((0, 4), jnp.bfloat16), jnp.zeros((0,), jnp.int32), 3)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.zeros((3, 4)))


def test_vmap_sums_each_problem():
    rng = np.random.default_rng(5)
    data = jnp.asarray(rng.standard_normal((3, 200, 9)), jnp.float32)
    ids = rng.integers(-1, 12, (3, 200))
    got = jax.vmap(lambda x, i: segment_sum(x, i, 11))(data, jnp.asarray(ids))
    for b in range(3):
        assert_close(got[b], reference(np.asarray(data[b]), ids[b], 11), jnp.float32)


def test_gradient_gathers_rows_and_zeroes_dropped_ones():
    rng = np.random.default_rng(7)
    data = jnp.asarray(rng.standard_normal((100, 6)), jnp.float32)
    ids = jnp.asarray(skewed_ids(rng, 100, 20))
    weight = jnp.asarray(rng.standard_normal((20, 6)), jnp.float32)
    ours = jax.grad(lambda x: jnp.sum(segment_sum(x, ids, 20) * weight))(data)
    theirs = jax.grad(lambda x: jnp.sum(jax.ops.segment_sum(x, ids, 20) * weight))(data)
    np.testing.assert_array_equal(ours, theirs)


def test_repeat_calls_give_the_same_bits():
    rng = np.random.default_rng(9)
    data = jnp.asarray(rng.standard_normal((4000, 64)), jnp.bfloat16)
    ids = jnp.asarray(np.minimum(rng.zipf(1.1, 4000) - 1, 99))
    fn = jax.jit(lambda x, i: segment_sum(x, i, 100))
    first = np.asarray(fn(data, ids), np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(fn(data, ids), np.float32), first)


@pytest.mark.parametrize("data, ids, num_segments, error, match", [
    (jnp.zeros((4, 2), jnp.int32), jnp.zeros((4,), jnp.int32), 3, TypeError, "data must be bfloat16, float16 or float32"),
    (jnp.zeros((4, 2)), jnp.zeros((4,)), 3, TypeError, "segment_ids must be an integer array"),
    (jnp.zeros((4, 2)), jnp.zeros((4, 1), jnp.int32), 3, ValueError, r"segment_ids must have rank 1 \(N,\)"),
    (jnp.zeros((4, 2)), jnp.zeros((5,), jnp.int32), 3, ValueError, "segment_ids .* N=4 entries like data"),
    (jnp.zeros((4, 2)), jnp.zeros((4,), jnp.int32), 0, ValueError, r"num_segments must be in \[1,"),
    (jnp.zeros((4, 2)), jnp.zeros((4,), jnp.int32), 2.0, TypeError, "num_segments must be a Python int"),
    (jnp.zeros(()), jnp.zeros((1,), jnp.int32), 2, ValueError, r"data must have rank >= 1"),
])
def test_bad_input_names_the_argument(data, ids, num_segments, error, match):
    with pytest.raises(error, match=match):
        segment_sum(data, ids, num_segments)
