"""grouped_gemm_fp8 on the CPU (the emulated path): quantisers bit for bit against ml_dtypes, the product against
float64 on the dequantised operands (the emulation is exact up to float32 summation), and against float64 on the
unquantised inputs within the bound FP8 quantisation allows; gradients the same way; bad input.

Error bounds (relative Frobenius error against float64 on the unquantised inputs, standard-normal data): every operand
element is rounded once to FP8, a relative error of at most 2^-4 (E4M3, 3 mantissa bits) or 2^-3 (E5M2), roughly
uniform, so about 2^-4/sqrt(3) ~ 3.6% per E4M3 operand; two independent roundings per product term combine to ~5% and
the sums of K terms average that down to ~3.6% at these sizes (measured 3.5-3.8%). The tests allow 6% for E4M3 and
12% for gradients quantised in E5M2.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests import reference
from turbo_moe.ops import grouped_gemm_fp8, grouped_gemm_fp8_quantized
from turbo_moe.ops.grouped_gemm_fp8 import (
    dequantize_blocks,
    dequantize_rows,
    quantize_blocks,
    quantize_group_columns,
    quantize_rows,
)

FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
E4M3_BOUND, E5M2_BOUND = 0.06, 0.12

CASES = [  # (M, K, N, G, sizes-kind)
    (301, 256, 256, 5, "random"),      # M not a multiple of 8 (nor of 128)
    (200, 128, 384, 4, "one_group"),   # every row in one group (skewed routing)
    (260, 256, 128, 6, "with_empty"),  # empty first and last groups
    (300, 128, 256, 3, "short"),       # sum(group_sizes) < M: tail rows zero
]


def make_sizes(kind, m, g, rng):
    if kind == "one_group":
        s = np.zeros(g, np.int32)
        s[g // 2] = m
        return s
    total = m - 77 if kind == "short" else m
    s = np.bincount(rng.integers(0, g, total), minlength=g).astype(np.int32)
    if kind == "with_empty":
        s[1] += s[0] + s[-1]
        s[0] = s[-1] = 0
    return s


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


# ---- numpy (ml_dtypes) quantisers: the independent reference of the jnp ones -----------------------------------

def np_quantize(t, axis, fmt):
    """float32 tiles along `axis` -> (q as ml_dtypes fp8, float32 scale), in float32 arithmetic like the op."""
    dtype = FP8[fmt]
    fmax = np.float32(ml_dtypes.finfo(dtype).max)
    amax = np.abs(t).max(axis=axis, keepdims=True)
    scale = np.where(amax > 0, amax * np.float32(1 / fmax), np.float32(1)).astype(np.float32)
    return np.clip(t * (np.float32(1) / scale), -fmax, fmax).astype(dtype), scale


def np_quantize_rows(x, fmt="e4m3"):
    m, k = x.shape
    q, s = np_quantize(np.asarray(x, np.float32).reshape(m, k // 128, 128), 2, fmt)
    return q.reshape(m, k), s[..., 0]


def np_dequant_rows(q, s):
    m, k = q.shape
    return (q.astype(np.float64).reshape(m, k // 128, 128) * s[..., None]).reshape(m, k)


def np_quantize_blocks(w):
    g, k, n = w.shape
    t = np.asarray(w, np.float32).reshape(g, k // 128, 128, n // 128, 128)
    q, s = np_quantize(t.transpose(0, 1, 3, 2, 4).reshape(g, k // 128, n // 128, 128 * 128), 3, "e4m3")
    deq = (q.astype(np.float64) * s).reshape(g, k // 128, n // 128, 128, 128).transpose(0, 1, 3, 2, 4)
    q = q.reshape(g, k // 128, n // 128, 128, 128).transpose(0, 1, 3, 2, 4).reshape(g, k, n)
    return q, s[..., 0], deq.reshape(g, k, n)


def np_dequant_group_columns(x, sizes, fmt="e4m3"):
    """x (M, C) quantised per 128 rows within each group (tiles start at the group's first row) -> float64."""
    x = np.asarray(x, np.float32)
    out = np.zeros(x.shape)
    b = reference.group_bounds(sizes, x.shape[0])
    for g in range(len(sizes)):
        for r in range(b[g], b[g + 1], 128):
            stop = min(r + 128, b[g + 1])
            q, s = np_quantize(x[r:stop], 0, fmt)
            out[r:stop] = q.astype(np.float64) * s
    return out


def inputs(case, dtype=jnp.float32):
    m, k, n, g, kind = case
    rng = np.random.default_rng()
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((g, k, n)) / np.sqrt(k)).astype(np.float32)
    w[0, :128, :128] *= 100  # one block of another magnitude: scales are per block
    x[3, :128] *= 1e-3       # and one tile of another magnitude in the activations
    sizes = make_sizes(kind, m, g, rng)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), sizes


# ---- quantisers --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_rows_bit_exact_and_bounded(fmt):
    rng = np.random.default_rng()
    x = rng.standard_normal((37, 384)).astype(np.float32) * rng.lognormal(0, 3, (37, 1)).astype(np.float32)
    x[5] = 0  # an all-zero tile: scale 1, q 0
    q, s = jax.jit(quantize_rows, static_argnums=1)(jnp.asarray(x), jnp.dtype(FP8[fmt]))
    q_ref, s_ref = np_quantize_rows(x, fmt)
    assert q.dtype == FP8[fmt] and q.shape == x.shape and s.shape == (37, 3) and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))
    # each element within half an FP8 ulp of itself (relative 2^-(nmant+1)) above the subnormal range
    finfo = ml_dtypes.finfo(FP8[fmt])
    deq = np.asarray(dequantize_rows(q, s), np.float64)
    bound = 2.0 ** -(finfo.nmant + 1) * np.abs(x) + np.repeat(s_ref, 128, 1) * float(finfo.smallest_subnormal)
    assert np.all(np.abs(deq - x) <= bound)


def test_quantize_blocks_bit_exact_and_both_layouts():
    rng = np.random.default_rng()
    w = (rng.standard_normal((3, 256, 384)) * rng.lognormal(0, 2, (3, 1, 1))).astype(np.float32)
    q, s = quantize_blocks(jnp.asarray(w))
    q_t, s_t = quantize_blocks(jnp.asarray(w), transpose=True)
    q_ref, s_ref, deq_ref = np_quantize_blocks(w)
    assert q.shape == (3, 256, 384) and q_t.shape == (3, 384, 256) and s.shape == (3, 2, 3)
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(np.asarray(s_t), s_ref)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_ref.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(q_t).view(np.uint8), q_ref.transpose(0, 2, 1).view(np.uint8))
    np.testing.assert_allclose(np.asarray(dequantize_blocks(q, s), np.float64), deq_ref, rtol=1e-7)


def test_quantize_group_columns_tiles_stay_inside_groups():
    rng = np.random.default_rng()
    m, c, sizes = 300, 32, np.array([130, 0, 5, 100], np.int32)  # 65 rows past the groups
    x = rng.standard_normal((m, c)).astype(np.float32)
    q_t, s = jax.jit(quantize_group_columns)(jnp.asarray(x), jnp.asarray(sizes))
    p = q_t.shape[1]
    assert q_t.shape == (c, p) and p % 128 == 0 and p >= m + 127 * len(sizes) and s.shape == (p // 128, c)
    deq = (np.asarray(q_t).astype(np.float64).T.reshape(p // 128, 128, c) * np.asarray(s)[:, None]).reshape(p, c)
    want = np_dequant_group_columns(x, sizes)
    starts = np.concatenate([[0], np.cumsum(-(-sizes // 128) * 128)])  # padded group starts
    bounds = reference.group_bounds(sizes, m)
    for g in range(len(sizes)):
        rows = bounds[g + 1] - bounds[g]
        np.testing.assert_array_equal(deq[starts[g]:starts[g] + rows], want[bounds[g]:bounds[g + 1]])
        assert not np.any(deq[starts[g] + rows:starts[g + 1]]), "padding rows are zero"
    assert not np.any(deq[starts[-1]:])


# ---- the product and its gradients -------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_forward_exact_emulation_and_error_bound(case):
    x, w, sizes = inputs(case)
    out = jax.jit(lambda a, b, s: grouped_gemm_fp8(a, b, s, impl="emulated"))(x, w, jnp.asarray(sizes))
    assert out.shape == (x.shape[0], w.shape[2]) and out.dtype == jnp.float32
    # exact emulation: float64 on the independently quantised operands
    _, _, w_deq = np_quantize_blocks(np.asarray(w))
    exact = reference.grouped_gemm(np_dequant_rows(*np_quantize_rows(np.asarray(x))), w_deq, sizes)
    assert rel_err(out, exact) < 1e-5
    assert rel_err(out, reference.grouped_gemm(x, w, sizes)) < E4M3_BOUND
    tail = int(reference.group_bounds(sizes, x.shape[0])[-1])
    assert not np.any(np.asarray(out)[tail:]), "rows past sum(group_sizes) must be zero"
    if jax.default_backend() == "cpu":  # on the CPU "auto" is the emulated path (a GPU runs the kernel: tests/gpu)
        np.testing.assert_array_equal(np.asarray(jax.jit(grouped_gemm_fp8)(x, w, jnp.asarray(sizes))), np.asarray(out))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("case", CASES[:3])
def test_gradients_exact_emulation_and_error_bound(case, fmt):
    x, w, sizes = inputs(case)
    d_out = np.random.default_rng().standard_normal((x.shape[0], w.shape[2])).astype(np.float32)

    def loss(a, b):
        out = grouped_gemm_fp8(a, b, jnp.asarray(sizes), grad_dtype=jnp.dtype(FP8[fmt]), weight_grad="fp8")
        return jnp.sum(out * d_out)

    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(x, w)
    assert dx.shape == x.shape and dw.shape == w.shape and dx.dtype == dw.dtype == jnp.float32
    # exact emulation: data gradient = deq(d_out per 1x128) @ deq(w)^T; weight gradient from 128x1 group tiles
    _, _, w_deq = np_quantize_blocks(np.asarray(w))
    dy_deq = np_dequant_rows(*np_quantize_rows(d_out, fmt))
    want_dx = reference.grouped_gemm(dy_deq, w_deq, sizes, transpose_rhs=True)
    want_dw = reference.weight_grad(np_dequant_group_columns(np.asarray(x), sizes),
                                    np_dequant_group_columns(d_out, sizes, fmt), sizes)
    assert rel_err(dx, want_dx) < 1e-5 and rel_err(dw, want_dw) < 1e-5
    bound = E4M3_BOUND if fmt == "e4m3" else E5M2_BOUND
    assert rel_err(dx, reference.grouped_gemm(d_out, w, sizes, transpose_rhs=True)) < bound
    assert rel_err(dw, reference.weight_grad(x, d_out, sizes)) < bound
    empty = reference.group_bounds(sizes, x.shape[0])
    for g in np.nonzero(np.diff(empty) == 0)[0]:
        assert not np.any(np.asarray(dw)[g]), "an empty group's weight gradient is zero"


def test_bfloat16_in_and_out_dtypes():
    x, w, sizes = inputs(CASES[0], jnp.bfloat16)
    gs = jnp.asarray(sizes)
    out = jax.jit(grouped_gemm_fp8)(x, w, gs)
    assert out.dtype == jnp.bfloat16
    as_f32 = jax.eval_shape(lambda a, b: grouped_gemm_fp8(a, b, gs, preferred_element_type=jnp.float32), x, w)
    assert as_f32.dtype == jnp.float32
    dx, dw = jax.jit(jax.grad(lambda a, b: grouped_gemm_fp8(a, b, gs).astype(jnp.float32).sum(), (0, 1)))(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    assert rel_err(out, reference.grouped_gemm(x.astype(jnp.float32), w.astype(jnp.float32), sizes)) < E4M3_BOUND


# ---- rows quantised beforehand (permute_fp8's output) -------------------------------------------------------------

@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[3]])
def test_quantized_rows_forward_bit_identical_and_weight_gradient(case):
    x, w, sizes = inputs(case, jnp.bfloat16)
    gs = jnp.asarray(sizes)
    q, s = quantize_rows(x)
    out = jax.jit(grouped_gemm_fp8_quantized)(q, s, w, gs)
    assert out.dtype == jnp.bfloat16  # rhs's dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(jax.jit(grouped_gemm_fp8)(x, w, gs),
                                                                          np.float32))
    d_out = np.random.default_rng().standard_normal(out.shape).astype(np.float32)
    dw = jax.jit(jax.grad(lambda b: jnp.sum(grouped_gemm_fp8_quantized(q, s, b, gs, weight_grad="fp8").astype(
        jnp.float32) * d_out)))(w)
    assert dw.dtype == jnp.bfloat16 and dw.shape == w.shape
    # exact emulation: the dequantised FP8 rows quantised again per 128x1 group tile (the cached-FP8 recipe)
    x_deq = np_dequant_rows(np.asarray(q).astype(np.float32), np.asarray(s))
    d_bf16 = np.asarray(jnp.asarray(d_out, jnp.bfloat16), np.float32)  # the cotangent arrives in bfloat16
    want = reference.weight_grad(np_dequant_group_columns(x_deq, sizes), np_dequant_group_columns(d_bf16, sizes),
                                 sizes)
    assert rel_err(dw, want) < 1e-2  # bfloat16 result
    assert rel_err(dw, reference.weight_grad(np.asarray(x, np.float32), d_out, sizes)) < E4M3_BOUND * 1.5


def test_quantized_rows_bad_input():
    x, w, gs = jnp.ones((8, 128)), jnp.ones((2, 128, 128)), jnp.array([4, 4], jnp.int32)
    q, s = quantize_rows(x)
    with pytest.raises(TypeError, match="lhs_q must be float8_e4m3fn"):
        grouped_gemm_fp8_quantized(x, s, w, gs)
    with pytest.raises(ValueError, match=r"lhs_scale must be float32 \(M, K/128\) = \(8, 1\)"):
        grouped_gemm_fp8_quantized(q, s[:4], w, gs)
    with pytest.raises(ValueError, match=r"rhs \(G, K, N\) has K=256 but lhs_q"):
        grouped_gemm_fp8_quantized(q, s, jnp.ones((2, 256, 128)), gs)


# ---- bad input ----------------------------------------------------------------------------------------------------

def test_bad_input_names_the_argument():
    x, w, gs = jnp.ones((8, 128)), jnp.ones((2, 128, 128)), jnp.array([4, 4], jnp.int32)
    with pytest.raises(ValueError, match=r"lhs \(M, K\) must have K a positive multiple of 128.*K=96"):
        grouped_gemm_fp8(jnp.ones((8, 96)), jnp.ones((2, 96, 128)), gs)
    with pytest.raises(ValueError, match=r"rhs \(G, K, N\) must have N a multiple of 128.*N=100"):
        grouped_gemm_fp8(x, jnp.ones((2, 128, 100)), gs)
    with pytest.raises(ValueError, match=r"rhs \(G, K, N\) has K=256 but lhs"):
        grouped_gemm_fp8(x, jnp.ones((2, 256, 128)), gs)
    with pytest.raises(TypeError, match="lhs must be bfloat16, float16 or float32"):
        grouped_gemm_fp8(x.astype(jnp.int32), w, gs)
    with pytest.raises(TypeError, match="rhs must be bfloat16, float16 or float32"):
        grouped_gemm_fp8(x, w.astype(jnp.float8_e4m3fn), gs)
    with pytest.raises(TypeError, match="group_sizes must be an integer array"):
        grouped_gemm_fp8(x, w, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"group_sizes must have shape \(G,\) = \(2,\)"):
        grouped_gemm_fp8(x, w, jnp.array([8], jnp.int32))
    with pytest.raises(TypeError, match="group_sizes must be a jax.Array"):
        grouped_gemm_fp8(x, w, [4, 4])
    with pytest.raises(ValueError, match="lhs must have rank 2"):
        grouped_gemm_fp8(jnp.ones((2, 8, 128)), w, gs)
    with pytest.raises(TypeError, match="grad_dtype must be float8_e4m3fn or float8_e5m2"):
        grouped_gemm_fp8(x, w, gs, grad_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="impl must be one of"):
        grouped_gemm_fp8(x, w, gs, impl="cuda")
    with pytest.raises(TypeError, match="preferred_element_type must be bfloat16, float16 or float32"):
        grouped_gemm_fp8(x, w, gs, preferred_element_type=jnp.int8)
