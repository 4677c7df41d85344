"""permute_fp8 (the permute's row copy writing FP8 E4M3 rows and 1x128 scales) on the CPU: bit for bit the jnp
quantiser (`quantize_rows`, itself checked against ml_dtypes in test_grouped_gemm_fp8.py) of permute's rows, with
dropped copies, empty experts, rows past the groups, every input dtype, FP8 subnormals and ties; bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.ops import permute, permute_fp8, permute_rows, permute_rows_fp8
from turbo_moe.ops.grouped_gemm_fp8 import quantize_rows
from turbo_moe.ops.permute_fp8 import permute_fp8_call


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)


def assert_bit_identical(q, scale, rows):
    q_ref, scale_ref = jax.jit(quantize_rows)(rows)
    assert q.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
    assert q.shape == q_ref.shape and scale.shape == scale_ref.shape
    np.testing.assert_array_equal(bits(scale), bits(scale_ref))
    np.testing.assert_array_equal(bits(q), bits(q_ref))


def tokens(t, h, dtype, rng):
    """Per-element magnitudes over ~16 binades (so a tile holds E4M3 subnormals and values that round to 0), a row of
    zeros, a tile of exact E4M3 ties and negative zeros."""
    x = rng.standard_normal((t, h)) * np.exp2(rng.integers(-8, 8, (t, h)))
    x[1] = 0.0
    x[2, :128] = 0.0
    x[2, 0] = -0.0
    # 448 * 2^-10 .. : the amax maps to 448, so multiples of 2^-10 * (odd) land on E4M3 rounding ties
    x[3, :128] = (np.arange(128) + 0.5) * (448.0 / 128.0)
    x[3, 127] = 448.0
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_matches_the_jnp_quantiser_of_permutes_rows(dtype):
    rng = np.random.default_rng(0)
    t, h, k, e = 67, 384, 3, 7
    x = tokens(t, h, dtype, rng)
    ids = rng.integers(0, e, (t, k)).astype(np.int32)
    ids[ids == 4] = 5          # expert 4 empty
    ids[::5, 1] = -1           # dropped copies: rows past sum(group_sizes)
    ids[::7, 2] = e + 3        # out of range is dropped too
    q, scale, group_sizes, handle = jax.jit(permute_fp8, static_argnums=2)(x, ids, e)
    rows, group_sizes_ref, handle_ref = permute(x, ids, e)
    np.testing.assert_array_equal(group_sizes, group_sizes_ref)
    np.testing.assert_array_equal(handle.row_index, handle_ref.row_index)
    assert int(group_sizes[4]) == 0 and int(group_sizes.sum()) < t * k
    assert_bit_identical(q, scale, rows)
    tail = int(group_sizes.sum())
    assert not bits(q[tail:]).any() and np.all(np.asarray(scale[tail:]) == 1.0)  # a zero row's quantisation


def test_every_copy_dropped_and_one_expert():
    rng = np.random.default_rng(1)
    x = tokens(9, 128, jnp.bfloat16, rng)
    q, scale, group_sizes, _ = permute_fp8(x, np.full((9, 2), -1, np.int32), 3)
    assert not np.asarray(group_sizes).any() and not bits(q).any() and np.all(np.asarray(scale) == 1.0)
    ids = np.zeros((9, 2), np.int32)
    q, scale, _, _ = permute_fp8(x, ids, 1)
    assert_bit_identical(q, scale, permute(x, ids, 1)[0])


def test_rows_variant_and_unwritten_tail():
    rng = np.random.default_rng(2)
    x = tokens(40, 256, jnp.bfloat16, rng)
    ids = rng.integers(-1, 4, (40, 2)).astype(np.int32)
    _, group_sizes, handle = permute(x, ids, 4)
    x2 = tokens(40, 256, jnp.bfloat16, rng)  # new rows through the same routing
    q, scale = permute_rows_fp8(x2, handle, group_sizes)
    assert_bit_identical(q, scale, permute_rows(x2, handle, group_sizes))
    q, scale, group_sizes, _ = permute_fp8_call(x, jnp.asarray(ids), 4, zero_tail=False)
    valid = int(group_sizes.sum())
    assert_bit_identical(q[:valid], scale[:valid], permute(x, ids, 4)[0][:valid])
    assert np.isnan(np.asarray(scale[valid:])).all()  # the CPU poisons the rows the caller promised not to read


def test_vmap_matches_each_problem():
    rng = np.random.default_rng(3)
    x = jnp.stack([tokens(20, 128, jnp.bfloat16, rng) for _ in range(2)])
    ids = rng.integers(-1, 3, (2, 20, 2)).astype(np.int32)
    q, scale, group_sizes, _ = jax.vmap(lambda a, b: permute_fp8(a, b, 3))(x, ids)
    for b in range(2):
        q_b, scale_b, gs_b, _ = permute_fp8(x[b], ids[b], 3)
        np.testing.assert_array_equal(group_sizes[b], gs_b)
        np.testing.assert_array_equal(bits(q[b]), bits(q_b))
        np.testing.assert_array_equal(bits(scale[b]), bits(scale_b))


@pytest.mark.parametrize("h", [0, 100, 192])
def test_width_not_a_multiple_of_128_is_refused(h):
    x = jnp.zeros((4, h), jnp.bfloat16)
    with pytest.raises(ValueError, match=rf"x \(T, H\) must have H a positive multiple of 128.*got H={h}"):
        permute_fp8(x, np.zeros((4, 1), np.int32), 2)
    if h:  # the kernels' contract refuses it too (a direct FFI call)
        with pytest.raises(Exception, match="permute_fp8: x's H must be a positive multiple of 128"):
            permute_fp8_call(x, jnp.zeros((4, 1), jnp.int32), 2)


def test_other_bad_input_names_the_argument():
    x = jnp.zeros((4, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="expert_ids"):
        permute_fp8(x, np.zeros((5, 1), np.int32), 2)
    with pytest.raises(TypeError, match="x"):
        permute_fp8(jnp.zeros((4, 128), jnp.int32), np.zeros((4, 1), np.int32), 2)
    with pytest.raises(TypeError, match="handle"):
        permute_rows_fp8(x, np.zeros((4, 1), np.int32), jnp.zeros((2,), jnp.int32))
