"""swiglu_quantize (the FP8 expert block's SwiGLU written in FP8 per 1x128 tile) on the CPU, for every input dtype
and both FP8 formats:
- bit for bit `quantize_rows` of the library's own act (grouped_gemm_swiglu's: the same formula and exp);
- against the jnp SwiGLU (float32, rounded to h's dtype) then the jnp quantiser: bit for bit but where XLA's exp and
  the C++ std::exp round an ulp apart so that an act value differs (a tiny fraction; each code one FP8 step and each
  scale a few ulps of h's dtype at most);
- dequantised against a float64 SwiGLU within FP8's rounding;
- M = 0 and M not a multiple of 8, valid_rows (the rows before it right, the rest NaN as documented), leading dims and
  vmap, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe import ops
from turbo_moe.ops.fp8_scaling import dequantize_rows
from turbo_moe.ops.fp8_scaling import quantize_rows as quantize_rows_xla
from turbo_moe.ops.swiglu_quantize import swiglu_quantize_call

FP8 = {"e4m3": jnp.dtype(jnp.float8_e4m3fn), "e5m2": jnp.dtype(jnp.float8_e5m2)}
INPUTS = [jnp.bfloat16, jnp.float16, jnp.float32]


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint32)


def gate_up(shape, dtype, seed):
    """h (..., M, 2F): gates out to +-9 (sigmoid's tails), up scaled per 128-wide tile over 2^-10..2^10 (2^-4..2^4 for
    float16, inside its range) so that tiles get scales far apart, and every 7th row's first up tile zero (act +-0:
    an all-zero tile, signed zeros)."""
    rng = np.random.default_rng(seed)
    *lead, m, two_f = shape
    f = two_f // 2
    spread = 4 if dtype == jnp.float16 else 10
    gate = rng.standard_normal((*lead, m, f)) * 3
    tile_exponents = rng.integers(-spread, spread + 1, (*lead, m, f // 128))
    up = rng.standard_normal((*lead, m, f)) * np.repeat(np.exp2(tile_exponents), 128, axis=-1)
    up[..., ::7, :128] = 0.0
    return jnp.asarray(np.concatenate([gate, up], axis=-1), dtype)


@jax.jit
def act_reference(h):
    """The jnp SwiGLU: gate / (1 + exp(-gate)) * up in float32 (the kernels' formula), rounded to h's dtype."""
    f = h.shape[-1] // 2
    gate, up = h[..., :f].astype(jnp.float32), h[..., f:].astype(jnp.float32)
    return (gate / (1 + jnp.exp(-gate)) * up).astype(h.dtype)


def library_act(h):
    """act as the library's grouped_gemm_swiglu computes it (std::exp on the CPU, expf on CUDA): h @ I, one group, is
    h exactly."""
    flat = h.reshape(-1, h.shape[-1])
    eye = jnp.eye(h.shape[-1], dtype=h.dtype)[None]
    _, act = ops.grouped_gemm_swiglu(flat, eye, jnp.array([flat.shape[0]], jnp.int32))
    return act.reshape(h.shape[:-1] + (h.shape[-1] // 2,))


def quantize_reference(act, fp8):
    """The jnp quantiser on (rows, F), reshaped back to act's leading dims."""
    q, scale = jax.jit(quantize_rows_xla, static_argnums=1)(act.reshape(-1, act.shape[-1]), fp8)
    return q.reshape(act.shape), scale.reshape(act.shape[:-1] + (-1,))


def signed_steps(q):
    """FP8 codes as signed steps from zero (+0 and -0 both 0): neighbouring values differ by 1."""
    b = bits(q).astype(np.int32)
    return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)


def assert_within_one_exp_ulp(q, scale, q_ref, scale_ref, h_dtype, *, ulps=4, scale_fraction=5e-3):
    """Equal but where the two exps made an act value differ: at most 1e-3 of the codes and `scale_fraction` of the
    scales (plus one, for small arrays), each code one FP8 step and each scale `ulps` ulps of h's dtype (relative: an
    ulp of exp can become three of a float32 act through 1 + e, the division and the product) from the reference's."""
    code_off = int(np.sum(bits(q) != bits(q_ref)))
    scale_off = int(np.sum(bits(scale) != bits(scale_ref)))
    assert code_off <= 1e-3 * q.size + 1 and scale_off <= scale_fraction * scale.size + 1, (code_off, scale_off)
    assert np.abs(signed_steps(q) - signed_steps(q_ref)).max(initial=0) <= 1
    np.testing.assert_allclose(np.asarray(scale), np.asarray(scale_ref), rtol=ulps * float(jnp.finfo(h_dtype).eps),
                               atol=0)


def float64_swiglu(h):
    h = np.asarray(h, np.float64)
    f = h.shape[-1] // 2
    gate, up = h[..., :f], h[..., f:]
    return gate / (1 + np.exp(-gate)) * up


def assert_dequantises_to_float64(q, scale, h, fp8):
    """|q * scale - act64| within half an FP8 step (the scaled value's rounding, or the subnormal step for small ones)
    plus act's rounding to h's dtype (relative, or its subnormal step: float16's below 6e-5)."""
    want = float64_swiglu(h)
    got = np.asarray(dequantize_rows(q, scale), np.float64)
    info = jnp.finfo(fp8)
    step = np.repeat(np.asarray(scale, np.float64), 128, axis=-1) * float(info.smallest_subnormal)
    rounding = jnp.finfo(h.dtype)
    tol = (2.0 ** -(info.nmant + 1) + float(rounding.eps)) * np.abs(want) + step + float(rounding.smallest_subnormal)
    assert np.all(np.abs(got - want) <= tol), np.max(np.abs(got - want) / tol)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", INPUTS)
@pytest.mark.parametrize("m,f", [(301, 512), (9, 128), (1, 640)])
def test_matches_quantize_rows_of_act(m, f, dtype, fp8):
    h = gate_up((m, 2 * f), dtype, seed=[m, f, INPUTS.index(dtype)])
    q, scale = jax.jit(ops.swiglu_quantize, static_argnums=2)(h, None, FP8[fp8])
    assert q.dtype == FP8[fp8] and q.shape == (m, f) and scale.dtype == jnp.float32 and scale.shape == (m, f // 128)
    q_lib, scale_lib = ops.quantize_rows(library_act(h), FP8[fp8])  # the same exp: bit for bit
    np.testing.assert_array_equal(bits(q), bits(q_lib))
    np.testing.assert_array_equal(bits(scale), bits(scale_lib))
    q_ref, scale_ref = quantize_reference(act_reference(h), FP8[fp8])  # XLA's exp
    assert_within_one_exp_ulp(q, scale, q_ref, scale_ref, dtype)
    assert_dequantises_to_float64(q, scale, h, FP8[fp8])
    zero_tile = np.s_[::7, 0]  # up zero: act +-0, scale 1, codes of signed zeros
    assert np.all(np.asarray(scale)[zero_tile] == 1.0) and not np.any(bits(q)[::7, :128] & 0x7F)


def test_the_lowered_program_calls_the_kernel():
    h = jnp.zeros((8, 256), jnp.bfloat16)
    assert "turbo_moe_swiglu_quantize" in jax.jit(ops.swiglu_quantize).lower(h).as_text()


@pytest.mark.parametrize("fp8", FP8)
def test_no_rows(fp8):
    q, scale = ops.swiglu_quantize(jnp.zeros((0, 512), jnp.bfloat16), dtype=FP8[fp8])
    assert q.shape == (0, 256) and q.dtype == FP8[fp8] and scale.shape == (0, 2) and scale.dtype == jnp.float32
    q, scale = ops.swiglu_quantize(jnp.zeros((3, 0, 256), jnp.float32), jnp.zeros(3, jnp.int32))
    assert q.shape == (3, 0, 128) and scale.shape == (3, 0, 1)


@pytest.mark.parametrize("fp8", FP8)
def test_valid_rows(fp8):
    """Rows before valid_rows[b] are the full call's bit for bit; the rest are NaN (every byte 0xFF) on the CPU; a
    count past M (or a wide integer) means every row, a negative one none."""
    h = gate_up((4, 37, 512), jnp.bfloat16, seed=3)
    valid = np.array([0, 13, 37, 50])
    q, scale = jax.jit(ops.swiglu_quantize, static_argnums=2)(h, jnp.asarray(valid, jnp.int32), FP8[fp8])
    q_all, scale_all = ops.swiglu_quantize(h, dtype=FP8[fp8])
    for b, n in enumerate(valid):
        n = min(n, 37)
        np.testing.assert_array_equal(bits(q[b, :n]), bits(q_all[b, :n]))
        np.testing.assert_array_equal(bits(scale[b, :n]), bits(scale_all[b, :n]))
        assert np.all(bits(q[b, n:]) == 0xFF) and np.all(bits(scale[b, n:]) == 0xFFFFFFFF)
    q, _ = ops.swiglu_quantize(h, np.array([-1, 0, 2**40, 37], np.int64), FP8[fp8])
    assert np.all(bits(q[:2]) == 0xFF)
    np.testing.assert_array_equal(bits(q[2:]), bits(q_all[2:]))


@pytest.mark.parametrize("fp8", FP8)
def test_leading_dims_and_vmap_are_independent_problems(fp8):
    h = gate_up((2, 3, 13, 256), jnp.float32, seed=4)
    valid = jnp.array([[13, 5, 0], [1, 13, 12]], jnp.int32)
    q, scale = ops.swiglu_quantize(h, valid, FP8[fp8])
    q_v, scale_v = jax.vmap(jax.vmap(lambda a, v: ops.swiglu_quantize(a, v, FP8[fp8])))(h, valid)
    np.testing.assert_array_equal(bits(q_v), bits(q))
    np.testing.assert_array_equal(bits(scale_v), bits(scale))
    for i in range(2):
        for j in range(3):
            n = int(valid[i, j])
            q1, scale1 = ops.swiglu_quantize(h[i, j], dtype=FP8[fp8])
            np.testing.assert_array_equal(bits(q[i, j, :n]), bits(q1[:n]))
            np.testing.assert_array_equal(bits(scale[i, j, :n]), bits(scale1[:n]))


# ---- bad input ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("width", [0, 255, 128, 384, 640])
def test_width_not_two_multiples_of_128_is_refused(width):
    h = jnp.zeros((4, width), jnp.bfloat16)
    with pytest.raises(ValueError, match=rf"h \(\.\.\., M, 2F\) = \[gate \| up\] must have F a positive multiple of "
                                         rf"128.*got a last dim of {width}"):
        ops.swiglu_quantize(h)
    if width:  # the kernels' contract refuses it too (a direct FFI call)
        with pytest.raises(Exception, match="swiglu_quantize: h must be \\[..., M, 2F\\] with F a positive multiple"):
            swiglu_quantize_call(h, jnp.zeros((), jnp.int32), FP8["e4m3"])


@pytest.mark.parametrize("shape", [(), (256,)])
def test_rank_below_two_is_refused(shape):
    with pytest.raises(ValueError, match=r"h must have rank >= 2 \(\.\.\., M, 2F\)"):
        ops.swiglu_quantize(jnp.zeros(shape, jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float64, jnp.float8_e4m3fn])
def test_input_dtype_is_refused(dtype):
    with pytest.raises(TypeError, match="h must be bfloat16, float16 or float32"):
        ops.swiglu_quantize(np.zeros((4, 256), dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8, jnp.float8_e4m3fnuz, "not a dtype"])
def test_output_dtype_is_refused(dtype):
    with pytest.raises(TypeError, match="dtype must be float8_e4m3fn or float8_e5m2"):
        ops.swiglu_quantize(jnp.zeros((4, 256), jnp.float32), dtype=dtype)


def test_valid_rows_of_the_wrong_shape_or_dtype_is_refused():
    h = jnp.zeros((2, 4, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"valid_rows must be \(2,\) \(one count a \(M, 2F\) problem of h"):
        ops.swiglu_quantize(h, jnp.zeros((), jnp.int32))
    with pytest.raises(ValueError, match=r"valid_rows must be \(2,\)"):
        ops.swiglu_quantize(h, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(TypeError, match="valid_rows must be an integer array"):
        ops.swiglu_quantize(h, jnp.zeros((2,), jnp.float32))
    with pytest.raises(Exception, match=r"swiglu_quantize: expected valid \[\.\.\.\]"):  # the contract, directly
        swiglu_quantize_call(h, jnp.zeros((3,), jnp.int32), FP8["e4m3"])


def test_a_list_is_refused():
    with pytest.raises(TypeError, match="h must be a jax.Array or numpy.ndarray"):
        ops.swiglu_quantize([[0.0] * 256])
