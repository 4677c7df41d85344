"""grouped_gemm / grouped_gemm_weight_grad against float64 numpy and jax.lax.ragged_dot."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests import reference
from turbo_moe.ops import grouped_gemm, grouped_gemm_weight_grad

# Relative error bounds (‖out − ref‖ / ‖ref‖) by input dtype: f32 accumulation in all cases.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "non-finite values in the output"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def random_sizes(rng, G, total):
    """Random non-negative sizes summing to `total`, with some groups empty."""
    cuts = np.sort(rng.integers(0, total + 1, G - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [total]]))
    sizes[rng.random(G) < 0.25] = 0  # empty groups; the sum may drop below total
    return sizes.astype(np.int32)


def inputs(seed, M, K, N, G, dtype, transpose_rhs=False):
    k1, k2 = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(k1, (M, K), jnp.float32).astype(dtype)
    shape = (G, N, K) if transpose_rhs else (G, K, N)
    rhs = (jax.random.normal(k2, shape, jnp.float32) / np.sqrt(K)).astype(dtype)
    return lhs, rhs


CASES = [  # (M, K, N, G, sizes-kind)
    (1000, 200, 72, 7, "random"),     # not multiples of 8
    (257, 33, 19, 4, "one_group"),    # every row in one group
    (300, 64, 48, 5, "short"),        # sum(group_sizes) < M: trailing rows must be zero
    (128, 16, 40, 6, "with_empty"),   # empty first/last groups
]


def make_sizes(kind, M, G, rng):
    if kind == "random":
        return random_sizes(rng, G, M)
    if kind == "one_group":
        s = np.zeros(G, np.int32); s[G // 2] = M; return s
    if kind == "short":
        return random_sizes(rng, G, M - 77)
    s = random_sizes(rng, G, M); s[0] = 0; s[-1] = 0; return s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_float64(case, transpose_rhs, dtype):
    M, K, N, G, kind = case
    rng = np.random.default_rng(hash((case, transpose_rhs)) % 2**32)
    lhs, rhs = inputs(int(rng.integers(1 << 30)), M, K, N, G, dtype, transpose_rhs)
    sizes = make_sizes(kind, M, G, rng)
    out = grouped_gemm(lhs, rhs, jnp.asarray(sizes), transpose_rhs=transpose_rhs)
    assert out.shape == (M, N) and out.dtype == dtype
    ref = reference.grouped_gemm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes, transpose_rhs)
    assert rel_err(out, ref) < TOL[dtype]
    tail = int(sizes.sum())
    assert np.all(np.asarray(out[tail:]) == 0), "rows past sum(group_sizes) must be exactly zero"


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_ragged_dot_and_preferred_type(dtype):
    rng = np.random.default_rng(0)
    lhs, rhs = inputs(1, 500, 96, 64, 8, dtype)
    sizes = jnp.asarray(random_sizes(rng, 8, 500))
    out = grouped_gemm(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    ref = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gradients_match_float64(dtype, transpose_rhs):
    """jax.grad of a random projection of the output: d(lhs) and d(rhs) against float64."""
    M, K, N, G = 333, 40, 24, 5
    rng = np.random.default_rng(7)
    lhs, rhs = inputs(3, M, K, N, G, dtype, transpose_rhs)
    sizes = random_sizes(rng, G, M - 10)
    sizes[1] = 0
    proj = jax.random.normal(jax.random.key(9), (M, N), jnp.float32)

    def loss(a, b):
        return jnp.sum(grouped_gemm(a, b, jnp.asarray(sizes), transpose_rhs=transpose_rhs).astype(jnp.float32) * proj)

    d_lhs, d_rhs = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
    assert d_lhs.dtype == dtype and d_rhs.dtype == dtype
    a, b, p = (np.asarray(v, np.float64) for v in (lhs.astype(jnp.float32), rhs.astype(jnp.float32), proj))
    w = b.transpose(0, 2, 1) if transpose_rhs else b  # (G, K, N)
    bounds = reference.group_bounds(sizes, M)
    ref_lhs = np.zeros_like(a)
    ref_w = np.zeros_like(w)
    for g in range(G):
        rows = slice(bounds[g], bounds[g + 1])
        ref_lhs[rows] = p[rows] @ w[g].T
        ref_w[g] = a[rows].T @ p[rows]
    ref_rhs = ref_w.transpose(0, 2, 1) if transpose_rhs else ref_w
    assert rel_err(d_lhs, ref_lhs) < TOL[dtype]
    assert rel_err(d_rhs, ref_rhs) < TOL[dtype]
    assert np.all(np.asarray(d_rhs[1]) == 0), "empty group must get an exactly zero weight gradient"


def test_weight_grad_public_and_deterministic():
    rng = np.random.default_rng(3)
    lhs, _ = inputs(4, 700, 130, 10, 6, jnp.float32)
    d_out = jax.random.normal(jax.random.key(5), (700, 90))
    sizes = random_sizes(rng, 6, 700)
    f = jax.jit(grouped_gemm_weight_grad)
    out = f(lhs, d_out, jnp.asarray(sizes))
    assert out.shape == (6, 130, 90)
    assert rel_err(out, reference.weight_grad(lhs, d_out, sizes)) < 1e-5
    assert np.array_equal(np.asarray(out), np.asarray(f(lhs, d_out, jnp.asarray(sizes)))), "must be bitwise reproducible"


def test_bad_runtime_group_sizes_are_clamped():
    """Negative sizes count as 0 and a sum larger than M is clamped: no out-of-bounds write."""
    lhs, rhs = inputs(6, 100, 32, 16, 4, jnp.float32)
    sizes = np.array([30, -5, 60, 500], np.int32)
    out = grouped_gemm(lhs, rhs, jnp.asarray(sizes))
    assert rel_err(out, reference.grouped_gemm(lhs, rhs, sizes)) < 1e-5
    dw = grouped_gemm_weight_grad(lhs, jnp.ones((100, 16)), jnp.asarray(sizes))
    assert rel_err(dw, reference.weight_grad(lhs, np.ones((100, 16)), sizes)) < 1e-5


def test_vmap_batches_in_one_call():
    B, M, K, N, G = 3, 90, 24, 20, 4
    rng = np.random.default_rng(11)
    lhs = jax.random.normal(jax.random.key(1), (B, M, K))
    rhs = jax.random.normal(jax.random.key(2), (G, K, N))  # shared weights: broadcast
    sizes = np.stack([random_sizes(rng, G, M - b * 7) for b in range(B)])
    out = jax.vmap(grouped_gemm, in_axes=(0, None, 0))(lhs, rhs, jnp.asarray(sizes))
    for b in range(B):
        assert rel_err(out[b], reference.grouped_gemm(lhs[b], rhs, sizes[b])) < 1e-5
    hlo = jax.jit(jax.vmap(grouped_gemm, in_axes=(0, None, 0))).lower(lhs, rhs, jnp.asarray(sizes)).as_text()
    assert hlo.count("turbo_moe_grouped_gemm") == 1, "vmap must lower to one batched FFI call, not a loop"
    grads = jax.grad(lambda a: jax.vmap(grouped_gemm, in_axes=(0, None, 0))(a, rhs, jnp.asarray(sizes)).sum())(lhs)
    assert grads.shape == lhs.shape


def test_remat_and_jit():
    lhs, rhs = inputs(8, 64, 16, 8, 2, jnp.float32)
    sizes = jnp.array([40, 24], jnp.int32)
    f = jax.checkpoint(lambda a, b: jnp.sum(jnp.tanh(grouped_gemm(a, b, sizes))))
    g1 = jax.jit(jax.grad(f, argnums=(0, 1)))(lhs, rhs)
    g2 = jax.grad(lambda a, b: jnp.sum(jnp.tanh(jax.lax.ragged_dot(a, b, sizes))), argnums=(0, 1))(lhs, rhs)
    for x, y in zip(g1, g2):
        assert rel_err(x, y) < 1e-5


@pytest.mark.parametrize("bad, err, match", [
    (dict(lhs=jnp.ones((4, 3, 2))), ValueError, "lhs must have rank 2"),
    (dict(rhs=jnp.ones((2, 5, 6))), ValueError, "contraction size 5"),
    (dict(group_sizes=jnp.ones((3,), jnp.int32)), ValueError, r"group_sizes must have shape \(G,\) = \(2,\)"),
    (dict(group_sizes=jnp.ones((2,), jnp.float32)), TypeError, "group_sizes must be an integer"),
    (dict(group_sizes=[2, 2]), TypeError, "group_sizes must be a jax.Array"),
    (dict(preferred_element_type="not-a-dtype"), TypeError, "preferred_element_type"),
])
def test_bad_input_is_named(bad, err, match):
    """(Other dtypes than the kernels' are ragged_dot's: tests/ops/test_ragged_dot_compat.py.)"""
    args = dict(lhs=jnp.ones((4, 3)), rhs=jnp.ones((2, 3, 6)), group_sizes=jnp.array([2, 2], jnp.int32))
    args.update(bad)
    kw = {"preferred_element_type": args.pop("preferred_element_type")} if "preferred_element_type" in args else {}
    with pytest.raises(err, match=match):
        grouped_gemm(args["lhs"], args["rhs"], args["group_sizes"], **kw)


@settings(max_examples=15, deadline=None)
@given(M=st.integers(1, 150), K=st.integers(1, 70), N=st.integers(1, 70), G=st.integers(1, 9),
       seed=st.integers(0, 2**31 - 1))
def test_property_random_shapes(M, K, N, G, seed):
    rng = np.random.default_rng(seed)
    lhs, rhs = inputs(seed, M, K, N, G, jnp.float32)
    sizes = rng.integers(-3, max(2, 2 * M // G), G).astype(np.int32)  # may be negative or oversum
    out = grouped_gemm(lhs, rhs, jnp.asarray(sizes))
    assert rel_err(out, reference.grouped_gemm(lhs, rhs, sizes)) < 1e-5


def test_zero_tail_false_leaves_group_rows_equal_and_the_tail_unspecified():
    """zero_tail=False: group rows (and both gradients) as with zeros; the rows past the groups are the caller's
    promise not to read (the CPU handler fills them with NaN so that a reader shows)."""
    rng = np.random.default_rng(7)
    M, K, N, sizes = 40, 24, 16, np.array([5, 0, 9, 3], np.int32)  # 17 group rows, 23 tail rows
    lhs = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(4, K, N)), jnp.float32)
    gs = jnp.asarray(sizes)
    zero = grouped_gemm(lhs, rhs, gs)
    free = grouped_gemm(lhs, rhs, gs, zero_tail=False)
    rows = int(sizes.sum())
    np.testing.assert_array_equal(free[:rows], zero[:rows])
    np.testing.assert_array_equal(zero[rows:], 0.0)
    if jax.default_backend() == "cpu":
        assert np.isnan(np.asarray(free[rows:])).all(), "the CPU handler poisons the tail with NaN"

    def loss(lhs, rhs, zero_tail):  # reads group rows only, as the promise says
        return jnp.sum(jnp.sin(grouped_gemm(lhs, rhs, gs, zero_tail=zero_tail)[:rows]))
    d_zero = jax.grad(loss, argnums=(0, 1))(lhs, rhs, True)
    d_free = jax.grad(loss, argnums=(0, 1))(lhs, rhs, False)
    np.testing.assert_array_equal(d_free[1], d_zero[1])
    np.testing.assert_array_equal(d_free[0][:rows], d_zero[0][:rows])
    with pytest.raises(TypeError, match="zero_tail must be a Python bool"):
        grouped_gemm(lhs, rhs, gs, zero_tail=0)


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_widths_padded_to_the_kernel_tiles_change_no_bit(monkeypatch, transpose_rhs):
    """On GPUs half-precision K and N that are not multiples of 8 are zero-padded for the Hopper kernels (the path is
    forced here on the CPU): the value, both gradients and the public weight gradient equal the unpadded call's bit
    for bit, and the padding is in the program."""
    gg = importlib.import_module("turbo_moe.ops.grouped_gemm")  # the module: the package exports a function of its name

    M, K, N, G = 301, 37, 21, 5
    lhs, rhs = inputs(11, M, K, N, G, jnp.bfloat16, transpose_rhs)
    sizes = jnp.asarray(random_sizes(np.random.default_rng(2), G, M - 9))
    proj = jax.random.normal(jax.random.key(4), (M, N), jnp.float32)

    def value_and_grads(a, b):
        def loss(a, b):
            out = grouped_gemm(a, b, sizes, transpose_rhs=transpose_rhs)
            return jnp.sum(out.astype(jnp.float32) * proj), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(a, b)
        return out, grads, grouped_gemm_weight_grad(a, proj.astype(jnp.bfloat16), sizes)

    unpadded = jax.jit(value_and_grads)(lhs, rhs)
    monkeypatch.setattr(gg, "pads_to_tiles", lambda compute, kernel_out: True)
    padded_program = lambda a, b: value_and_grads(a, b)  # a new function: JAX caches traces by function
    assert " pad[" in str(jax.make_jaxpr(padded_program)(lhs, rhs))
    padded = jax.jit(padded_program)(lhs, rhs)
    for got, want in zip(jax.tree.leaves(padded), jax.tree.leaves(unpadded)):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
