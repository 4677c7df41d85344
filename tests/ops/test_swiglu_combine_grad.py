"""swiglu_combine_grad: d_h, the combine weights' gradient and act * w against float64 and against the XLA
expressions the expert block used before it (the same roundings); act * w bit for bit the forward kernel's act
times w; edge rows, leading dims, bad input. swiglu_combine_grad_fp8: those three outputs bit for bit, and d_h's
FP8 copy bit for bit the jnp quantiser's of it (a tile across [d_gate | d_up] included), both formats, valid rows,
leading dims and vmap, bad input and the C++ contract's messages."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.ops import grouped_gemm_swiglu, swiglu_combine_grad, swiglu_combine_grad_fp8
from turbo_moe.ops.fp8_scaling import quantize_rows as quantize_rows_xla
from turbo_moe.ops.grouped_gemm_swiglu import swiglu_grad


def _inputs(seed, rows, F, dtype, lead=()):
    k = jax.random.split(jax.random.key(seed), 3)
    h = (jax.random.normal(k[0], lead + (rows, 2 * F)) * 3).astype(dtype)  # gates out to +-9: sigmoid's tails
    g = jax.random.normal(k[1], lead + (rows, F)).astype(dtype)
    w = jax.random.uniform(k[2], lead + (rows,))
    return h, g, w


def _float64(h, g, w):
    h, g, w = (np.asarray(a, np.float64) for a in (h, g, w))
    F = g.shape[-1]
    gate, up = h[..., :F], h[..., F:]
    sig = 1 / (1 + np.exp(-gate))
    d_w = np.sum(gate * sig * up * g, axis=-1)
    d_act = w[..., None] * g
    d_h = np.concatenate([d_act * up * sig * (1 + gate * (1 - sig)), d_act * gate * sig], axis=-1)
    return d_h, d_w, gate * sig * up * w[..., None]


def forward_act(h):
    """act as `grouped_gemm_swiglu` returns it for gate/up output h: h @ I, one group, is h exactly."""
    eye = jnp.eye(h.shape[-1], dtype=h.dtype)[None]
    _, act = grouped_gemm_swiglu(h, eye, jnp.array([h.shape[0]], jnp.int32))
    return act


def act_times_w(act, w):
    """The contract of act_w: the forward's (rounded) act times w in float32, rounded to act's dtype."""
    return (act.astype(jnp.float32) * w[:, None]).astype(act.dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows,F", [(97, 36), (64, 512), (5, 1), (1, 8)])
def test_matches_float64_and_the_xla_expressions(rows, F, dtype):
    h, g, w = _inputs(rows + F, rows, F, dtype)
    w = w.at[::7].set(0.0)  # rows no copy fills have weight 0: d_h = 0, d_w still <act, g>
    d_h, d_w, act_w = jax.jit(swiglu_combine_grad)(h, g, w)
    assert d_h.shape == h.shape and d_h.dtype == h.dtype and d_w.shape == (rows,) and d_w.dtype == jnp.float32
    assert act_w.shape == g.shape and act_w.dtype == h.dtype
    want_h, want_w, want_aw = _float64(h, g, w)
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}[dtype]
    np.testing.assert_allclose(np.asarray(d_w, np.float64), want_w, rtol=1e-5, atol=1e-5 * np.abs(want_w).max())
    np.testing.assert_allclose(np.asarray(d_h, np.float64), want_h, rtol=tol, atol=tol * np.abs(want_h).max())
    np.testing.assert_allclose(np.asarray(act_w, np.float64), want_aw, rtol=2 * tol, atol=tol * np.abs(want_aw).max())
    np.testing.assert_array_equal(np.asarray(act_w, np.float32), np.asarray(act_times_w(forward_act(h), w), np.float32))
    assert not np.any(np.asarray(d_h, np.float32)[::7]) and not np.any(np.asarray(act_w, np.float32)[::7])
    # the block's XLA path: d_act rounded to the dtype, then SwiGLU's written-out backward
    d_act = (g.astype(jnp.float32) * w[:, None]).astype(dtype)
    xla = swiglu_grad(h, d_act).astype(dtype)
    np.testing.assert_allclose(np.asarray(d_h, np.float32), np.asarray(xla, np.float32), rtol=tol, atol=tol)


def test_leading_dims_are_rows_too():
    h, g, w = _inputs(3, 10, 16, jnp.float32, lead=(2, 3))
    d_h, d_w, act_w = swiglu_combine_grad(h, g, w)
    flat_h, flat_w, flat_aw = swiglu_combine_grad(h.reshape(60, 32), g.reshape(60, 16), w.reshape(60))
    np.testing.assert_array_equal(np.asarray(d_h).reshape(60, 32), np.asarray(flat_h))
    np.testing.assert_array_equal(np.asarray(d_w).reshape(60), np.asarray(flat_w))
    np.testing.assert_array_equal(np.asarray(act_w).reshape(60, 16), np.asarray(flat_aw))


def test_bad_input_names_the_argument():
    h, g, w = _inputs(0, 8, 4, jnp.float32)
    with pytest.raises(ValueError, match="h must be"):
        swiglu_combine_grad(h[:, :7], g, w)
    with pytest.raises(ValueError, match="g must be"):
        swiglu_combine_grad(h, g[:, :3], w)
    with pytest.raises(ValueError, match="w must be"):
        swiglu_combine_grad(h, g, w[:7])
    with pytest.raises(TypeError, match="g must have h's dtype"):
        swiglu_combine_grad(h, g.astype(jnp.bfloat16), w)
    with pytest.raises((TypeError, ValueError), match="h"):
        swiglu_combine_grad(h.astype(jnp.int32), g.astype(jnp.int32), w)


def test_valid_rows_computes_the_leading_rows_of_each_problem():
    """valid_rows (the expert block under EP): rows below the count equal the full call's; rows from it on are left
    to the caller (NaN on the CPU, so that a reader shows); one count a problem of the leading dims."""
    h, g, w = _inputs(5, 30, 16, jnp.float32, lead=(2,))  # two problems of 30 rows
    full = swiglu_combine_grad(h, g, w)
    part = swiglu_combine_grad(h, g, w, jnp.asarray([30, 7], jnp.int32))
    for a, b in zip(part, full):
        np.testing.assert_array_equal(np.asarray(a)[0], np.asarray(b)[0])
        np.testing.assert_array_equal(np.asarray(a)[1, :7], np.asarray(b)[1, :7])
        if jax.default_backend() == "cpu":
            assert np.isnan(np.asarray(a)[1, 7:]).all()
    with pytest.raises(ValueError, match="valid_rows must be"):
        swiglu_combine_grad(h, g, w, jnp.int32(3))
    with pytest.raises(TypeError, match="valid_rows"):
        swiglu_combine_grad(h, g, w, jnp.asarray([3.0, 1.0]))


# ---- swiglu_combine_grad_fp8: d_h also quantised per 1x128 tile in the same pass ----------------------------------
FP8 = {"e4m3": jnp.dtype(jnp.float8_e4m3fn), "e5m2": jnp.dtype(jnp.float8_e5m2)}


def bits(a):
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def skewed_inputs(seed, rows, F, dtype, lead=()):
    """`_inputs` with g scaled per 64 columns over 2^-spread..2^spread (tiles of d_h with unequal scales, the two
    halves of a tile across [d_gate | d_up] unequal too), zero-weight rows (zero rows of d_h: scale 1, codes +-0) and
    a block of 64 zeros in g."""
    h, g, w = _inputs(seed, rows, F, dtype, lead)
    spread = 4 if dtype == jnp.float16 else 12
    exps = np.random.default_rng(seed).integers(-spread, spread + 1, lead + (rows, F // 64))
    g = (g.astype(jnp.float32) * jnp.repeat(jnp.exp2(jnp.asarray(exps, jnp.float32)), 64, axis=-1)).astype(dtype)
    g = g.at[..., 1, :64].set(0.0)
    return h, g, w.at[..., ::5].set(0.0)


def quantized_reference(d_h, fp8):
    """The jnp quantiser on d_h's rows: (..., M, 2F) -> q, scale of d_h's leading dims."""
    q, scale = jax.jit(quantize_rows_xla, static_argnums=1)(d_h.reshape(-1, d_h.shape[-1]), fp8)
    return q.reshape(d_h.shape), scale.reshape(d_h.shape[:-1] + (-1,))


def assert_fp8_call_matches(h, g, w, fp8=FP8["e4m3"], valid_rows=None):
    """The five outputs: the three shared ones bit for bit swiglu_combine_grad's, the quantised pair bit for bit the
    jnp quantiser's of that d_h, on the valid rows of each problem."""
    d_h, d_h_q, d_h_scale, d_w, act_w = jax.jit(swiglu_combine_grad_fp8, static_argnums=4)(h, g, w, valid_rows, fp8)
    assert d_h_q.shape == h.shape and d_h_q.dtype == fp8
    assert d_h_scale.shape == h.shape[:-1] + (h.shape[-1] // 128,) and d_h_scale.dtype == jnp.float32
    want = jax.jit(swiglu_combine_grad)(h, g, w, valid_rows)
    q_ref, scale_ref = quantized_reference(want[0], fp8)
    lead, M = h.shape[:-2], h.shape[-2]
    valid = np.broadcast_to(M if valid_rows is None else np.asarray(valid_rows), lead)
    for idx in np.ndindex(*lead):
        n = int(valid[idx])
        for got, ref in zip((d_h, d_w, act_w, d_h_q, d_h_scale), (*want, q_ref, scale_ref)):
            np.testing.assert_array_equal(bits(got[idx][:n]), bits(ref[idx][:n]))
    return d_h, d_h_q, d_h_scale, d_w, act_w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows,F", [(97, 512), (45, 192), (13, 2048), (3, 64)])  # 192, 64: a tile across gate|up
def test_fp8_is_swiglu_combine_grad_and_quantize_rows_of_its_d_h(rows, F, dtype):
    h, g, w = skewed_inputs(rows + F, rows, F, dtype)
    d_h, d_h_q, d_h_scale, _, _ = assert_fp8_call_matches(h, g, w)
    assert not np.asarray(d_h_q[0], np.float32).any() and np.all(np.asarray(d_h_scale[0]) == 1.0)  # w = 0: zeros
    # dequantised: within e4m3's rounding of d_h (half its 2^-3 spacing, or of its subnormal step 2^-9 x scale)
    scale = np.repeat(np.asarray(d_h_scale, np.float64), 128, axis=-1)
    err = np.abs(np.asarray(d_h_q, np.float64) * scale - np.asarray(d_h, np.float64))
    assert np.all(err <= 2**-4 * np.abs(np.asarray(d_h, np.float64)) + 2**-10 * scale)


def test_fp8_tile_across_the_gate_up_boundary():
    """F = 64 * 3: tile 1 holds d_gate[128:192] and d_up[0:64]; its scale is the larger half's amax / 448."""
    rows, F = 11, 192
    h, g, w = _inputs(7, rows, F, jnp.float32)
    g = g.at[:, :64].multiply(2.0**10)  # d_up[0:64] (and d_gate[0:64]) ~1000x the rest
    d_h, _, d_h_scale, _, _ = assert_fp8_call_matches(h, g, w)
    d_h = np.asarray(d_h)
    np.testing.assert_array_equal(np.asarray(d_h_scale[:, 1]), np.abs(d_h[:, 128:256]).max(-1) * np.float32(1 / 448))
    assert np.all(np.abs(d_h[:, 192:256]).max(-1) > np.abs(d_h[:, 128:192]).max(-1))  # the up half sets it


@pytest.mark.parametrize("fp8", ["e4m3", "e5m2"])
def test_fp8_formats_and_a_single_row(fp8):
    h, g, w = skewed_inputs(3, 29, 320, jnp.bfloat16)  # F = 64 * 5: tile 2 across the boundary
    assert_fp8_call_matches(h, g, w, FP8[fp8])
    one = swiglu_combine_grad_fp8(h[4], g[4], w[4], dtype=FP8[fp8])
    full = swiglu_combine_grad_fp8(h, g, w, dtype=FP8[fp8])
    for a, b in zip(one, full):
        np.testing.assert_array_equal(bits(a), bits(b[4]))


def test_fp8_valid_rows_and_leading_dims():
    """(2, 3) problems of 21 rows with counts 0, < M and M: valid rows bit for bit; the rest NaN on the CPU."""
    h, g, w = skewed_inputs(11, 21, 192, jnp.bfloat16, lead=(2, 3))
    valid = jnp.asarray([[21, 0, 5], [13, 21, 1]], jnp.int32)
    out = assert_fp8_call_matches(h, g, w, valid_rows=valid)
    if jax.default_backend() == "cpu":
        for a in (np.asarray(a, np.float32) for a in out):  # FP8 codes 0xFF are NaN in both formats
            assert np.isnan(a[0, 1]).all() and np.isnan(a[1, 0, 13:]).all() and np.isnan(a[0, 2, 5:]).all()
    vmapped = jax.vmap(swiglu_combine_grad_fp8)(h, g, w, valid)
    for a, b in zip(vmapped, out):
        for idx in np.ndindex(2, 3):
            n = int(valid[idx])
            np.testing.assert_array_equal(bits(a[idx][:n]), bits(b[idx][:n]))
    none = swiglu_combine_grad_fp8(h, g, w, jnp.zeros((2, 3), jnp.int32))  # zero valid rows anywhere: runs
    assert all(a.shape == b.shape for a, b in zip(none, out))


def test_fp8_bad_input_names_the_argument():
    h, g, w = _inputs(0, 8, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"h \(\.\.\., 2F\) must have 2F a positive multiple of 128"):
        swiglu_combine_grad_fp8(h[:, :64], g[:, :32], w)  # F = 32
    with pytest.raises(ValueError, match="2F a positive multiple"):
        swiglu_combine_grad_fp8(h[:, :0], g[:, :0], w)
    with pytest.raises(TypeError, match="dtype must be float8_e4m3fn or float8_e5m2"):
        swiglu_combine_grad_fp8(h, g, w, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="g must be"):
        swiglu_combine_grad_fp8(h, g[:, :32], w)
    with pytest.raises(ValueError, match="w must be"):
        swiglu_combine_grad_fp8(h, g, w[:7])
    with pytest.raises(TypeError, match="g must have h's dtype"):
        swiglu_combine_grad_fp8(h, g.astype(jnp.bfloat16), w)
    with pytest.raises(TypeError, match="h must be bfloat16, float16 or float32"):
        swiglu_combine_grad_fp8(h.astype(jnp.int32), g.astype(jnp.int32), w)
    with pytest.raises(ValueError, match="valid_rows must be"):
        swiglu_combine_grad_fp8(h, g, w, jnp.int32(3)[None])
    with pytest.raises(TypeError, match="valid_rows"):
        swiglu_combine_grad_fp8(h, g, w, jnp.float32(3.0))


@pytest.mark.parametrize("results,message", [
    (dict(q=(8, 128, jnp.bfloat16)), "swiglu_combine_grad_fp8: d_h_q must be float8_e4m3fn or float8_e5m2"),
    (dict(scale=(8, 2, jnp.float32)), "swiglu_combine_grad_fp8: expected results d_h_q [..., M, 2F] and d_h_scale"),
    (dict(scale=(8, 2, jnp.float16)), "swiglu_combine_grad_fp8: d_h_scale must be float32"),
    (dict(F=32), "swiglu_combine_grad_fp8: h's 2F must be a positive multiple of 128 (the FP8 scale tiles), got 2F=64"),
    (dict(d_w=(7,)), "swiglu_combine_grad: d_h must be shaped like h and d_w like w"),
])
def test_fp8_handler_refuses_with_the_contract_message(results, message):
    """The C++ contract (kernels/contracts/swiglu_combine_grad.h) behind the Python checks, called directly."""
    from turbo_moe.ops._ffi import ffi_call
    F = results.get("F", 64)
    h, g, w = _inputs(0, 8, F, jnp.float32)
    spec = jax.ShapeDtypeStruct
    q = results.get("q", (8, 2 * F, jnp.float8_e4m3fn))
    scale = results.get("scale", (8, max(2 * F // 128, 1), jnp.float32))
    outs = (spec(h.shape, h.dtype), spec(results.get("d_w", (8,)), jnp.float32), spec(g.shape, g.dtype),
            spec(q[:2], q[2]), spec(scale[:2], scale[2]))
    with pytest.raises(Exception, match=re.escape(message)):
        jax.block_until_ready(ffi_call("turbo_moe_swiglu_combine_grad_fp8", outs, h, g, w, jnp.int32(8)))
