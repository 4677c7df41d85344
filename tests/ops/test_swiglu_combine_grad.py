"""swiglu_combine_grad: d_h, the combine weights' gradient and act * w against float64 and against the XLA
expressions the expert block used before it (the same roundings); act * w bit for bit the forward kernel's act
times w; edge rows, leading dims, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.ops import grouped_gemm_swiglu, swiglu_combine_grad
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
