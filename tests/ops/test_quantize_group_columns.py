"""quantize_group_columns (the FP8 weight gradient's 128x1 quantiser, transposed into the group-padded layout) on the
CPU: bit for bit the jnp reference `quantize_group_columns_xla` with empty groups, M not a multiple of 8, skewed
routing, rows past the groups, odd widths, every input dtype, both FP8 formats, values at the FP8 maximum and zeros;
bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.ops import quantize_group_columns
from turbo_moe.ops.grouped_gemm_fp8 import E4M3, E5M2, quantize_group_columns_xla
from turbo_moe.ops.quantize_group_columns import padded_rows


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)


def assert_matches_reference(x, sizes, fp8):
    sizes = jnp.asarray(sizes, jnp.int32)
    q_t, scale = jax.jit(quantize_group_columns, static_argnums=2)(x, sizes, fp8)
    q_ref, scale_ref = jax.jit(quantize_group_columns_xla, static_argnums=2)(x, sizes, fp8)
    p = padded_rows(x.shape[0], sizes.shape[0])
    assert q_t.dtype == fp8 and scale.dtype == jnp.float32
    assert q_t.shape == q_ref.shape == (x.shape[1], p) and scale.shape == scale_ref.shape == (p // 128, x.shape[1])
    np.testing.assert_array_equal(bits(scale), bits(scale_ref))
    np.testing.assert_array_equal(bits(q_t), bits(q_ref))
    return q_t, scale


def rows(m, c, dtype, rng, fp8=E4M3):
    """Magnitudes over ~16 binades (FP8 subnormals, values that round to 0), a zero row, negative zeros, a column of
    exact rounding ties at the format's maximum."""
    x = rng.standard_normal((m, c)) * np.exp2(rng.integers(-8, 8, (m, c)))
    fmax = float(jnp.finfo(fp8).max)
    if m > 2:
        x[1] = 0.0
        x[2, 0] = -0.0
    if m >= 128:
        x[:128, -1] = (np.arange(128) + 0.5) * (fmax / 128.0)
        x[127, -1] = fmax
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_matches_the_jnp_reference(dtype, fp8):
    rng = np.random.default_rng(0)
    m, c = 517, 200  # M not a multiple of 8, C not a multiple of 64
    sizes = [130, 0, 1, 255, 0, 128, 3]  # empty groups, a group of one row, exact multiples of 128
    assert sum(sizes) == m
    assert_matches_reference(rows(m, c, dtype, rng, fp8), sizes, fp8)


@pytest.mark.parametrize("sizes", [
    [0, 0, 300, 0],           # every row in one group (very skewed routing)
    [50, 7, 20],              # sum < M: rows past the groups are not read
    [-5, 400, 90],            # a negative size counts as 0; the sum clamps to M
    [2**31 - 1, 4],           # a huge size clamps to M, the next group is empty
    [0, 0, 0],                # no rows at all in the groups
])
def test_clamped_and_partial_layouts(sizes):
    rng = np.random.default_rng(1)
    x = rows(301, 33, jnp.bfloat16, rng)
    q_t, scale = assert_matches_reference(x, sizes, E4M3)
    if sum(max(s, 0) for s in sizes) == 0:
        assert not bits(q_t).any() and np.all(np.asarray(scale) == 1.0)  # all padding: zeros, scale 1


@pytest.mark.parametrize("m,c", [(1, 1), (7, 3), (129, 130)])
def test_small_and_odd_shapes(m, c):
    rng = np.random.default_rng(2)
    x = rows(m, c, jnp.float32, rng)
    assert_matches_reference(x, [m // 2, m - m // 2], E5M2)


def test_no_rows():
    """M = 0 (the reference's gather cannot index an empty x): every tile is padding, zeros with scale 1."""
    q_t, scale = quantize_group_columns(jnp.zeros((0, 5), jnp.bfloat16), jnp.asarray([0, 0], jnp.int32))
    assert q_t.shape == (5, padded_rows(0, 2)) == (5, 256) and scale.shape == (2, 5)
    assert not bits(q_t).any() and np.all(np.asarray(scale) == 1.0)


def test_rows_past_the_groups_are_not_read():
    x = np.random.default_rng(3).standard_normal((200, 16)).astype(np.float32)
    sizes = jnp.asarray([60, 40], jnp.int32)
    poisoned = x.copy()
    poisoned[100:] = np.nan  # not part of any group
    a = quantize_group_columns(jnp.asarray(x), sizes)
    b = quantize_group_columns(jnp.asarray(poisoned), sizes)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(bits(u), bits(v))


def test_tiles_dequantise_to_the_rows():
    """The layout itself, independent of the reference: group g's rows at its 128-aligned columns, per-tile scales."""
    rng = np.random.default_rng(4)
    sizes = [70, 0, 140]
    x = rng.uniform(-2, 2, (210, 8)).astype(np.float32)
    q_t, scale = quantize_group_columns(jnp.asarray(x), jnp.asarray(sizes, jnp.int32))
    deq = np.asarray(q_t, np.float32) * np.repeat(np.asarray(scale), 128, axis=0).T  # (C, P)
    np.testing.assert_allclose(deq[:, 0:70].T, x[:70], rtol=2**-3)
    np.testing.assert_allclose(deq[:, 128:268].T, x[70:210], rtol=2**-3)
    assert not deq[:, 70:128].any() and not deq[:, 268:].any()
    assert np.max(np.abs(np.asarray(q_t[:, :128], np.float32))) == 448.0  # the tile's amax maps onto the maximum


def test_inside_jit_with_traced_sizes_and_vjp_of_fp8_gemm():
    """grouped_gemm_fp8's weight gradient runs through the kernel and still equals the reference quantiser's."""
    from turbo_moe.ops import grouped_gemm_fp8
    from turbo_moe.ops.grouped_gemm_fp8 import weight_grad_product

    rng = np.random.default_rng(5)
    m, k, n, g = 300, 128, 128, 3
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) * 0.05, jnp.bfloat16)
    sizes = jnp.asarray([100, 0, 170], jnp.int32)
    d_out = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    _, vjp = jax.vjp(lambda w: grouped_gemm_fp8(lhs, w, sizes, weight_grad="fp8", impl="emulated"), rhs)
    (d_rhs,) = jax.jit(vjp)(d_out)
    lq, ls = quantize_group_columns_xla(lhs, sizes)
    dq, ds = quantize_group_columns_xla(d_out, sizes)
    ref = weight_grad_product(lq, ls, dq, ds, sizes, m, out_dtype=rhs.dtype, impl="emulated")
    np.testing.assert_array_equal(bits(d_rhs.astype(jnp.float32)), bits(ref.astype(jnp.float32)))


def test_bad_input_names_the_argument():
    x = jnp.zeros((10, 4), jnp.bfloat16)
    sizes = jnp.asarray([5, 5], jnp.int32)
    with pytest.raises(ValueError, match="x must have rank 2"):
        quantize_group_columns(jnp.zeros((2, 10, 4)), sizes)
    with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32"):
        quantize_group_columns(jnp.zeros((10, 4), jnp.int32), sizes)
    with pytest.raises(ValueError, match="C >= 1"):
        quantize_group_columns(jnp.zeros((10, 0)), sizes)
    with pytest.raises(ValueError, match="group_sizes must have rank 1"):
        quantize_group_columns(x, sizes[None])
    with pytest.raises(TypeError, match="group_sizes must be an integer array"):
        quantize_group_columns(x, sizes.astype(jnp.float32))
    with pytest.raises(TypeError, match="dtype must be float8_e4m3fn or float8_e5m2"):
        quantize_group_columns(x, sizes, jnp.bfloat16)
    with pytest.raises(TypeError, match="x must be a jax.Array"):
        quantize_group_columns([[1.0]], sizes)
