"""grouped_gemm_swiglu: h like grouped_gemm's, act = silu(gate) * up against float64, gradients, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import reference
from tests.ops.test_grouped_gemm import DTYPES, TOL, inputs, make_sizes, rel_err
from turbo_moe.ops import grouped_gemm, grouped_gemm_swiglu

CASES = [  # (M, K, 2F, G, sizes-kind)
    (1000, 200, 72, 7, "random"),     # F = 36: not a multiple of 8
    (257, 33, 38, 4, "one_group"),    # every row in one group (very skewed routing)
    (300, 64, 48, 5, "short"),        # sum(group_sizes) < M: trailing rows zero in h and act
    (128, 16, 32, 6, "with_empty"),   # empty first/last groups
]


def act_reference(h):
    """silu(gate) * up in float64 from h as the op returned it (rounded), i.e. the op's own input to SwiGLU."""
    h = np.asarray(h, np.float64)
    f = h.shape[-1] // 2
    gate, up = h[..., :f], h[..., f:]
    return gate / (1.0 + np.exp(-gate)) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_float64(case, transpose_rhs, dtype):
    M, K, N, G, kind = case
    rng = np.random.default_rng(M + N)
    lhs, rhs = inputs(M, M, K, N, G, dtype, transpose_rhs)
    sizes = make_sizes(kind, M, G, rng)
    h, act = grouped_gemm_swiglu(lhs, rhs, jnp.asarray(sizes), transpose_rhs=transpose_rhs)
    assert h.shape == (M, N) and act.shape == (M, N // 2) and h.dtype == act.dtype == jnp.dtype(dtype)
    # h is the grouped GEMM's output bit for bit (the same kernels), and matches float64
    same = grouped_gemm(lhs, rhs, jnp.asarray(sizes), transpose_rhs=transpose_rhs)
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(same, np.float32))
    assert rel_err(h, reference.grouped_gemm(lhs, rhs, sizes, transpose_rhs)) < TOL[dtype]
    # act: one rounding of the float32 value (half an ulp of the dtype, plus float32's exp)
    ulp = {jnp.float32: 2e-7, jnp.bfloat16: 8e-3, jnp.float16: 1e-3}[dtype]
    ref = act_reference(h)
    np.testing.assert_allclose(np.asarray(act, np.float64), ref, rtol=ulp, atol=ulp * np.abs(ref).max() * 1e-2)
    tail = int(sizes.sum())
    assert not np.any(np.asarray(h, np.float32)[tail:]) and not np.any(np.asarray(act, np.float32)[tail:])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_match_autodiff_of_the_pieces(dtype):
    M, K, N, G = 96, 24, 20, 5
    lhs, rhs = inputs(7, M, K, N, G, dtype)
    sizes = jnp.asarray([30, 0, 41, 1, 9], jnp.int32)  # 81 of 96 rows: a zero tail, an empty group
    k1, k2 = jax.random.split(jax.random.key(3))
    c_h = jax.random.normal(k1, (M, N), jnp.float32)
    c_act = jax.random.normal(k2, (M, N // 2), jnp.float32)

    def loss_fused(x, w):
        h, act = grouped_gemm_swiglu(x, w, sizes)
        return jnp.sum(h.astype(jnp.float32) * c_h) + jnp.sum(act.astype(jnp.float32) * c_act)

    def loss_pieces(x, w):
        h = grouped_gemm(x, w, sizes).astype(jnp.float32)
        act = jax.nn.silu(h[:, :N // 2]) * h[:, N // 2:]
        return jnp.sum(h * c_h) + jnp.sum(act * c_act)

    got = jax.grad(loss_fused, (0, 1))(lhs, rhs)
    want = jax.grad(loss_pieces, (0, 1))(lhs, rhs)
    for name, g, w in zip(("d_lhs", "d_rhs"), got, want):
        assert g.dtype == jnp.dtype(dtype), name
        assert rel_err(g, w) < TOL[dtype], name
    # rows past the groups get no gradient into lhs
    assert not np.any(np.asarray(got[0], np.float32)[81:])


def test_vmap_over_a_leading_batch():
    M, K, N, G = 40, 16, 24, 3
    lhs = jnp.stack([inputs(s, M, K, N, G, jnp.float32)[0] for s in (1, 2)])
    rhs = jnp.stack([inputs(s, M, K, N, G, jnp.float32)[1] for s in (1, 2)])
    sizes = jnp.asarray([[10, 20, 10], [0, 40, 0]], jnp.int32)
    h, act = jax.vmap(grouped_gemm_swiglu)(lhs, rhs, sizes)
    for b in range(2):
        hb, ab = grouped_gemm_swiglu(lhs[b], rhs[b], sizes[b])
        np.testing.assert_array_equal(np.asarray(h[b]), np.asarray(hb))
        np.testing.assert_array_equal(np.asarray(act[b]), np.asarray(ab))


def test_bad_input_names_the_argument():
    lhs, rhs = inputs(0, 16, 8, 12, 2, jnp.float32)
    sizes = jnp.asarray([8, 8], jnp.int32)
    with pytest.raises(ValueError, match="even output width 2F"):
        grouped_gemm_swiglu(lhs, rhs[:, :, :11], sizes)
    with pytest.raises(ValueError, match="contraction size"):
        grouped_gemm_swiglu(lhs[:, :7], rhs, sizes)
    with pytest.raises(ValueError, match="group_sizes must have shape"):
        grouped_gemm_swiglu(lhs, rhs, jnp.asarray([16], jnp.int32))
    with pytest.raises((TypeError, ValueError), match="group_sizes"):
        grouped_gemm_swiglu(lhs, rhs, sizes.astype(jnp.float32))
    with pytest.raises((TypeError, ValueError), match="lhs"):
        grouped_gemm_swiglu(lhs.astype(jnp.int32), rhs, sizes)
    with pytest.raises(ValueError, match="rhs"):
        grouped_gemm_swiglu(lhs, rhs[0], sizes)


def test_zero_tail_false_keeps_group_rows():
    rng = np.random.default_rng(11)
    sizes = jnp.asarray([3, 0, 6], jnp.int32)
    lhs = jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(3, 8, 12)), jnp.float32)
    h, act = grouped_gemm_swiglu(lhs, rhs, sizes)
    h_f, act_f = grouped_gemm_swiglu(lhs, rhs, sizes, zero_tail=False)
    np.testing.assert_array_equal(h_f[:9], h[:9])
    np.testing.assert_array_equal(act_f[:9], act[:9])
    np.testing.assert_array_equal(act[9:], 0.0)
    if jax.default_backend() == "cpu":
        assert np.isnan(np.asarray(h_f[9:])).all() and np.isnan(np.asarray(act_f[9:])).all()
