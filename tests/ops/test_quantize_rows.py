"""quantize_rows (activations in FP8 per 1x128 tile, one kernel) on the CPU: bit for bit the jnp quantiser
(`fp8_scaling.quantize_rows`, itself checked against ml_dtypes in test_grouped_gemm_fp8.py) for every input dtype
and both FP8 formats, on inputs spanning many binades with FP8 subnormals, exact rounding ties, zero tiles and rows,
negative zeros; M = 0 and M not a multiple of 8; leading dims and vmap; NaN and infinity as documented; bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe import ops
from turbo_moe.ops import permute_fp8
from turbo_moe.ops.fp8_scaling import quantize_rows as quantize_rows_xla
from turbo_moe.ops.quantize_rows import quantize_rows_call

FP8 = {"e4m3": jnp.dtype(jnp.float8_e4m3fn), "e5m2": jnp.dtype(jnp.float8_e5m2)}
INPUTS = [jnp.bfloat16, jnp.float16, jnp.float32]


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)


def reference(x, fp8):
    """The jnp quantiser on (rows, K), reshaped back to x's leading dims."""
    q, scale = jax.jit(quantize_rows_xla, static_argnums=1)(x.reshape(-1, x.shape[-1]), fp8)
    return q.reshape(x.shape), scale.reshape(x.shape[:-1] + (-1,))


def assert_matches_reference(x, fp8):
    q, scale = jax.jit(ops.quantize_rows, static_argnums=1)(x, fp8)
    q_ref, scale_ref = reference(x, fp8)
    assert q.dtype == fp8 and scale.dtype == jnp.float32
    assert q.shape == x.shape and scale.shape == x.shape[:-1] + (x.shape[-1] // 128,)
    np.testing.assert_array_equal(bits(scale), bits(scale_ref))
    np.testing.assert_array_equal(bits(q), bits(q_ref))
    return q, scale


def tie_tile(fp8):
    """127 midpoints between neighbouring finite FP8 values (subnormals included, alternating signs) and fmax: the
    tile's scale is exactly 1, so every midpoint reaches the FP8 cast as an exact tie (representable in every input
    dtype)."""
    values = np.arange(0x80, dtype=np.uint8).view(fp8).astype(np.float64)  # the non-negative codes, in order
    values = values[np.isfinite(values)]
    mids = (values[:-1] + values[1:]) / 2
    tile = np.resize(mids, 127) * np.where(np.arange(127) % 2, -1.0, 1.0)
    return np.append(tile, float(jnp.finfo(fp8).max))


def activations(m, k, dtype, fp8, rng):
    """Per-element magnitudes over ~16 binades (FP8 subnormals and values that round to 0 inside a tile), per-tile
    exponents over a wider range (float16 keeps to its own), an all-zero row, an all-zero tile with a negative zero, a
    tile of exact ties and five of near-ties."""
    spread = 8 if dtype == jnp.float16 else 40
    x = rng.standard_normal((m, k)) * np.exp2(rng.integers(-8, 8, (m, k)))
    x *= np.repeat(np.exp2(rng.integers(-spread // 2, spread // 2, (m, k // 128))), 128, axis=1)
    if m > 8:
        x[1] = 0.0
        x[2, -128:] = 0.0
        x[2, -126] = -0.0
        x[3, :128] = tie_tile(fp8)
        # near-ties under other scales: where x * (1/scale) and a division x / scale round apart
        for i, factor in enumerate([0.7, 0.3, 0.55, 0.9, 0.123]):
            x[4 + i, :128] = tie_tile(fp8) * factor
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", INPUTS)
@pytest.mark.parametrize("m", [301, 1])
def test_matches_the_jnp_quantiser_bit_for_bit(m, dtype, fp8):
    rng = np.random.default_rng([m, INPUTS.index(dtype), list(FP8).index(fp8)])
    x = activations(m, 512, dtype, FP8[fp8], rng)
    q, scale = assert_matches_reference(x, FP8[fp8])
    if m > 8:
        assert not bits(q[1]).any() and np.all(np.asarray(scale[1]) == 1.0)  # a zero row: codes 0, scale 1
        assert np.asarray(scale[2, -1]) == 1.0 and bits(q)[2, -126] == 0x80  # a zero tile keeps the sign of -0
        assert np.asarray(scale[3, 0]) == 1.0  # the ties reached the cast unscaled


def test_the_lowered_program_calls_the_kernel():
    x = jnp.zeros((8, 128), jnp.bfloat16)
    assert "turbo_moe_quantize_rows" in jax.jit(ops.quantize_rows).lower(x).as_text()


@pytest.mark.parametrize("fp8", FP8)
def test_no_rows(fp8):
    q, scale = ops.quantize_rows(jnp.zeros((0, 256), jnp.bfloat16), FP8[fp8])
    assert q.shape == (0, 256) and q.dtype == FP8[fp8] and scale.shape == (0, 2) and scale.dtype == jnp.float32
    q, scale = ops.quantize_rows(jnp.zeros((3, 0, 128), jnp.float32), FP8[fp8])
    assert q.shape == (3, 0, 128) and scale.shape == (3, 0, 1)


@pytest.mark.parametrize("fp8", FP8)
def test_leading_dims_and_vmap_are_independent_problems(fp8):
    rng = np.random.default_rng(7)
    x = jnp.stack([jnp.stack([activations(13, 256, jnp.bfloat16, FP8[fp8], rng) for _ in range(3)])
                   for _ in range(2)])  # (2, 3, 13, 256)
    q, scale = assert_matches_reference(x, FP8[fp8])
    q_v, scale_v = jax.vmap(jax.vmap(lambda a: ops.quantize_rows(a, FP8[fp8])))(x)
    np.testing.assert_array_equal(bits(q_v), bits(q))
    np.testing.assert_array_equal(bits(scale_v), bits(scale))


def test_is_permute_fp8_without_the_permutation():
    """permute_fp8 runs the same row step: with one expert and one copy a token, its rows are x's in order."""
    rng = np.random.default_rng(8)
    x = activations(21, 640, jnp.bfloat16, FP8["e4m3"], rng)
    q_p, scale_p, _, _ = permute_fp8(x, np.zeros((21, 1), np.int32), 1)
    q, scale = ops.quantize_rows(x)
    np.testing.assert_array_equal(bits(q), bits(q_p))
    np.testing.assert_array_equal(bits(scale), bits(scale_p))


@pytest.mark.parametrize("fp8", FP8)
def test_nan_and_infinity_as_documented(fp8):
    """The kernels skip NaN in a tile's amax and clip NaN to -fmax (as permute_fp8 does); the jnp reference propagates
    NaN. Tiles without a NaN or infinity still agree bit for bit."""
    fp8 = FP8[fp8]
    fmax = float(jnp.finfo(fp8).max)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[0, 3] = np.nan    # tile (0, 0): scale from the other values
    x[1, 130] = np.inf  # tile (1, 1): scale inf, the other values quantise to zero
    x[2, 256:384] = 0.0
    x[2, 300] = np.nan  # tile (2, 2): otherwise zero, scale 1
    q_codes, scale = ops.quantize_rows(jnp.asarray(x), fp8)
    q_ref, scale_ref = reference(jnp.asarray(x), fp8)
    q, scale = np.asarray(q_codes).astype(np.float32), np.asarray(scale)
    clean = np.ones((4, 4), bool)
    clean[0, 0] = clean[1, 1] = clean[2, 2] = False
    np.testing.assert_array_equal(bits(scale[clean]), bits(np.asarray(scale_ref)[clean]))
    tiles_clean = np.repeat(clean, 128, axis=1)
    np.testing.assert_array_equal(bits(q_codes)[tiles_clean], bits(q_ref)[tiles_clean])
    others = np.delete(x[0, :128], 3)
    assert scale[0, 0] == np.float32(np.abs(others).max()) * np.float32(1 / fmax) and q[0, 3] == -fmax
    assert scale[1, 1] == np.inf and q[1, 130] == -fmax and not np.delete(q[1, 128:256], 2).any()
    assert scale[2, 2] == 1.0 and q[2, 300] == -fmax and not np.delete(q[2, 256:384], 44).any()
    assert np.asarray(scale_ref)[0, 0] == 1.0 and np.isnan(np.asarray(q_ref, np.float32)[0, 3])  # the reference's


# ---- bad input ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 100, 192])
def test_width_not_a_multiple_of_128_is_refused(k):
    x = jnp.zeros((4, k), jnp.bfloat16)
    with pytest.raises(ValueError, match=rf"x \(\.\.\., M, K\) must have K a positive multiple of 128.*got K={k}"):
        ops.quantize_rows(x)
    if k:  # the kernels' contract refuses it too (a direct FFI call)
        with pytest.raises(Exception, match="quantize_rows: x's K must be a positive multiple of 128"):
            quantize_rows_call(x, FP8["e4m3"])


@pytest.mark.parametrize("shape", [(), (256,)])
def test_rank_below_two_is_refused(shape):
    with pytest.raises(ValueError, match=r"x must have rank >= 2 \(\.\.\., M, K\)"):
        ops.quantize_rows(jnp.zeros(shape, jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float64, jnp.float8_e4m3fn])
def test_input_dtype_is_refused(dtype):
    with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32"):
        ops.quantize_rows(np.zeros((4, 128), dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8, jnp.float8_e4m3fnuz, "not a dtype"])
def test_output_dtype_is_refused(dtype):
    with pytest.raises(TypeError, match="dtype must be float8_e4m3fn or float8_e5m2"):
        ops.quantize_rows(jnp.zeros((4, 128), jnp.float32), dtype)


def test_a_list_is_refused():
    with pytest.raises(TypeError, match="x must be a jax.Array or numpy.ndarray"):
        ops.quantize_rows([[0.0] * 128])
