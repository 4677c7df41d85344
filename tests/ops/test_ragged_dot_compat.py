"""grouped_gemm / ragged_dot_general as drop-ins for jax.lax.ragged_dot(_general): cases adapted from JAX's RaggedTest
(tests/lax_test.py) and megablox's gmm tests (tests/pallas/tpu_gmm_test.py), against float64 numpy references and
jax.lax.ragged_dot itself: dtype rules, precision, group_offset (sharded groups), forward-mode and higher-order
autodiff, vmap, and the dimension numbers MoE code uses. Fresh random inputs on every run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from turbo_moe import ops

RDN = jax.lax.RaggedDotDimensionNumbers
RAGGED_M = RDN((([1], [1]), ([], [])), [0], [0])  # (M, K) x (G, K, N) -> (M, N)
RAGGED_K = RDN((([0], [0]), ([], [])), [0], [])  # (M, K) x (M, N) -> (G, K, N)
FP8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
FLOATS = [jnp.bfloat16, jnp.float16, jnp.float32, *FP8]
# relative error bound (‖out − ref‖ / ‖ref‖) by output dtype: one rounding of float32-accumulated sums
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-2, jnp.dtype(jnp.float16): 2e-3,
       jnp.dtype(jnp.float8_e4m3fn): 7e-2, jnp.dtype(jnp.float8_e5m2): 0.15}


def rng():
    return np.random.default_rng()  # fresh inputs every run (the seed is printed by a failing assert's arrays)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(out)), "non-finite values in the output"
    return np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)


def bounds(sizes, m):
    """The clamped cumulative layout (G+1,): negative sizes count as 0, nothing past m."""
    return np.concatenate([[0], np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), m)])


def ref_rows(lhs, rhs, sizes, offset=0, transpose_rhs=False):
    """float64 grouped GEMM; rhs holds the groups offset .. offset + rhs.shape[0] - 1 of sizes."""
    a, w = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    w = w.transpose(0, 2, 1) if transpose_rhs else w
    b = bounds(sizes, a.shape[0])
    out = np.zeros((a.shape[0], w.shape[2]))
    for g in range(w.shape[0]):
        out[b[offset + g]:b[offset + g + 1]] = a[b[offset + g]:b[offset + g + 1]] @ w[g]
    return out


def ref_contracting(lhs, rhs, sizes):
    a, d = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    b = bounds(sizes, a.shape[0])
    return np.stack([a[b[g]:b[g + 1]].T @ d[b[g]:b[g + 1]] for g in range(len(sizes))])


def jax_group_sizes(r, m, g):
    """RaggedTest's sizes: sorted random ends (repeats allowed: empty groups), the last group ends at m."""
    ends = np.sort(np.concatenate([r.choice(m + 1, size=g - 1), [m]]))
    return np.diff(np.concatenate([[0], ends])).astype(np.int32)


def skewed_sizes(r, m, g):
    """Very skewed routing: one hot group takes all rows but a few, most groups empty."""
    sizes = np.zeros(g, np.int32)
    few = r.choice(g, size=min(3, g), replace=False)
    sizes[few] = 1
    sizes[r.integers(g)] += m - sizes.sum()
    return sizes


def operands(r, m, k, n, g, dtype, rhs_dtype=None, transpose_rhs=False, scale=1.0):
    lhs = jnp.asarray(r.standard_normal((m, k)) * scale, dtype)
    shape = (g, n, k) if transpose_rhs else (g, k, n)
    rhs = jnp.asarray(r.standard_normal(shape) * scale / np.sqrt(k), rhs_dtype or dtype)
    return lhs, rhs


# (m, k, n, groups): RaggedTest's test_ragged_dot and test_ragged_dot_small_m shapes, then odd sizes (not multiples
# of 8) and more groups than rows
SHAPES = [(64, 4, 3, 1), (64, 9, 8, 2), (5, 4, 3, 1), (5, 4, 3, 2), (9, 4, 3, 1), (10, 9, 8, 2), (203, 37, 19, 7),
          (6, 5, 3, 9)]


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_float64_reference(shape, dtype):
    m, k, n, g = shape
    r = rng()
    lhs, rhs = operands(r, m, k, n, g, dtype)
    sizes = jax_group_sizes(r, m, g)
    out = jax.jit(ops.grouped_gemm)(lhs, rhs, jnp.asarray(sizes))
    assert out.shape == (m, n) and out.dtype == jnp.dtype(dtype)
    ref = ref_rows(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    assert rel_err(out, ref) < TOL[jnp.dtype(dtype)]


@pytest.mark.parametrize("kind", ["empty_ends", "skewed", "sum_below_m", "negative_and_oversum"])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_edge_routings_forward_and_gradients(kind, transpose_rhs):
    """megablox's partial tiles and empty groups, plus routing skewed onto one expert, and the runtime semantics."""
    m, k, n, g = 131, 24, 13, 8
    r = rng()
    lhs, rhs = operands(r, m, k, n, g, jnp.float32, transpose_rhs=transpose_rhs)
    sizes = {"empty_ends": np.array([0, 30, 0, 41, 7, 0, 53, 0]), "skewed": skewed_sizes(r, m, g),
             "sum_below_m": jax_group_sizes(r, m - 50, g),
             "negative_and_oversum": np.array([20, -7, 50, 0, 100, 3, 9, 1])}[kind].astype(np.int32)
    gs = jnp.asarray(sizes)
    cot = r.standard_normal((m, n))
    out, vjp = jax.vjp(lambda a, b: ops.grouped_gemm(a, b, gs, transpose_rhs=transpose_rhs), lhs, rhs)
    assert rel_err(out, ref_rows(lhs, rhs, sizes, transpose_rhs=transpose_rhs)) < 1e-5
    d_lhs, d_rhs = vjp(jnp.asarray(cot, jnp.float32))
    w = np.asarray(rhs, np.float64)
    w = w.transpose(0, 2, 1) if transpose_rhs else w
    b = bounds(sizes, m)
    want_lhs = np.zeros((m, k))
    for i in range(g):
        want_lhs[b[i]:b[i + 1]] = cot[b[i]:b[i + 1]] @ w[i].T
    want_w = ref_contracting(lhs, cot, sizes)
    assert rel_err(d_lhs, want_lhs) < 1e-5
    assert rel_err(d_rhs, want_w.transpose(0, 2, 1) if transpose_rhs else want_w) < 1e-5
    assert not np.any(np.asarray(out)[b[-1]:]) and not np.any(np.asarray(d_lhs)[b[-1]:])


DTYPE_PAIRS = [(jnp.bfloat16, jnp.float16), (jnp.float16, jnp.bfloat16), (jnp.bfloat16, jnp.float32),
               (jnp.float16, jnp.float32), (jnp.float8_e4m3fn, jnp.float8_e5m2), (jnp.float8_e4m3fn, jnp.bfloat16),
               (jnp.int8, jnp.bfloat16), (jnp.int8, jnp.int8), (jnp.int8, jnp.int32), (jnp.int32, jnp.float32)]
PREFERRED = [None, jnp.float32, jnp.bfloat16]


@pytest.mark.parametrize("preferred", PREFERRED, ids=lambda d: "none" if d is None else jnp.dtype(d).name)
@pytest.mark.parametrize("pair", DTYPE_PAIRS, ids=lambda p: f"{jnp.dtype(p[0]).name}x{jnp.dtype(p[1]).name}")
def test_dtype_rules_are_ragged_dots(pair, preferred):
    """The output dtype is the one jax.lax.ragged_dot gives (XLA's rule: bf16 x f16 -> bf16, not NumPy's f32), and
    the values are the exact products' sums, rounded once."""
    a_dtype, b_dtype = pair
    m, k, n, g = 40, 16, 8, 3
    r = rng()
    lhs = jnp.asarray(r.integers(-8, 8, (m, k)), a_dtype)  # small integers: exact in every dtype here
    rhs = jnp.asarray(r.integers(-8, 8, (g, k, n)), b_dtype)
    sizes = jnp.asarray(jax_group_sizes(r, m, g))
    try:
        want = jax.eval_shape(lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=preferred),
                              lhs, rhs, sizes).dtype
    except TypeError as e:  # e.g. an integer result with a narrower preferred_element_type
        with pytest.raises(TypeError, match=str(e)[:30]):
            ops.grouped_gemm(lhs, rhs, sizes, None, preferred)
        return
    out = ops.grouped_gemm(lhs, rhs, sizes, None, preferred)
    assert out.dtype == want
    ref = ref_rows(lhs.astype(jnp.float32), rhs.astype(jnp.float32), np.asarray(sizes))
    if jnp.issubdtype(want, jnp.integer):  # integer products wrap, as XLA's do
        exact = np.rint(ref).astype(np.int64).astype(want).astype(np.float64)
    else:
        exact = np.asarray(jnp.asarray(ref, jnp.float32).astype(want).astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32), np.float64), exact)


def test_int8_with_int32_accumulation_is_exact_past_float32():
    """int8 x int8 -> int32 sums past 2**24 (where float32 would round) exactly, as ragged_dot does."""
    m, k, n = 24, 2048, 8
    r = rng()
    lhs = jnp.asarray(r.integers(100, 128, (m, k)), jnp.int8)  # sums ~2.6e7 > 2**24
    rhs = jnp.asarray(r.integers(100, 128, (2, k, n)), jnp.int8)
    sizes = jnp.array([10, 14], jnp.int32)
    out = ops.grouped_gemm(lhs, rhs, sizes, preferred_element_type=jnp.int32)
    a, w = np.asarray(lhs, np.int64), np.asarray(rhs, np.int64)
    want = np.concatenate([a[:10] @ w[0], a[10:] @ w[1]])
    assert out.dtype == jnp.int32 and np.abs(want).min() > 2 ** 24
    assert np.any(want.astype(np.float32).astype(np.int64) != want), "float32 could not hold these sums"
    np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(out, jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.int32))


@pytest.mark.parametrize("precision", [None, jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGH,
                                       jax.lax.Precision.HIGHEST, "highest", "bfloat16", ("highest", "default"),
                                       jax.lax.DotAlgorithmPreset.BF16_BF16_F32, jax.lax.DotAlgorithmPreset.DEFAULT])
def test_precision_is_positional_and_float32_is_full_precision(precision):
    """Every precision gives float32-exact products with float32 accumulation (XLA's CPU dot does the same)."""
    m, k, n, g = 50, 64, 16, 3
    r = rng()
    lhs, rhs = operands(r, m, k, n, g, jnp.float32)
    sizes = jax_group_sizes(r, m, g)
    out = ops.grouped_gemm(lhs, rhs, jnp.asarray(sizes), precision)
    assert rel_err(out, ref_rows(lhs, rhs, sizes)) < 1e-6


@pytest.mark.parametrize("call, err, match", [
    (lambda a, b, s: ops.grouped_gemm(a, b, [3, 3]), TypeError, "group_sizes must be a jax.Array"),
    (lambda a, b, s: ops.grouped_gemm(a.tolist(), b, s), TypeError, "lhs must be a jax.Array"),
    (lambda a, b, s: ops.grouped_gemm(a, b, s, "bad"), ValueError, "Precision argument"),
    (lambda a, b, s: ops.grouped_gemm(a, b, s, None, "not-a-dtype"), TypeError, "preferred_element_type"),
    (lambda a, b, s: ops.grouped_gemm(a, b, s, group_offset=jnp.zeros((2,), jnp.int32)), ValueError,
     r"group_offset must have shape \(\) or \(1,\)"),
    (lambda a, b, s: ops.grouped_gemm(a, b, s, group_offset=jnp.zeros(())), TypeError, "group_offset must be an int"),
    (lambda a, b, s: ops.grouped_gemm(a, b[:1], s), ValueError, r"group_sizes must have shape \(G,\) = \(1,\)"),
    (lambda a, b, s: ops.grouped_gemm(a, jnp.concatenate([b, b]), s, group_offset=0), ValueError,
     "G_local <= G"),
    (lambda a, b, s: ops.grouped_gemm(a, b, s, out_sharding=jax.sharding.PartitionSpec()), NotImplementedError,
     "out_sharding"),
    (lambda a, b, s: ops.grouped_gemm(a, b, s, transpose_rhs=1), TypeError, "transpose_rhs must be a Python bool"),
])
def test_bad_input_is_named(call, err, match):
    lhs, rhs = operands(rng(), 6, 4, 5, 2, jnp.float32)
    with pytest.raises(err, match=match):
        call(lhs, rhs, jnp.array([3, 3], jnp.int32))


def test_numpy_group_sizes_are_accepted_like_ragged_dot():
    lhs, rhs = operands(rng(), 6, 4, 5, 2, jnp.float32)
    sizes = np.array([2, 4], np.int64)
    np.testing.assert_allclose(ops.grouped_gemm(lhs, rhs, sizes), jax.lax.ragged_dot(lhs, rhs, sizes), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize("stride", [1, 2, 3])
def test_group_offset_shards_add_up_to_the_whole(stride, dtype):
    """megablox's test_gmm_sharded_groups: each shard computes its G/stride local groups of the global group_sizes
    (zeros elsewhere); the shards' outputs and lhs gradients add up to the whole product's, their rhs gradients
    concatenate to the whole one."""
    m, k, n, g = 97, 16, 12, 6
    r = rng()
    if dtype == jnp.int8:
        lhs = jnp.asarray(r.integers(-5, 5, (m, k)), dtype)
        rhs = jnp.asarray(r.integers(-5, 5, (g, k, n)), dtype)
    else:
        lhs, rhs = operands(r, m, k, n, g, dtype)
    sizes = jnp.asarray(jax_group_sizes(r, m - 9, g))
    pet = jnp.int32 if dtype == jnp.int8 else jnp.float32
    offsets = range(0, g, stride)
    shards = [jax.jit(ops.grouped_gemm, static_argnums=(3, 4))(lhs, rhs[o:o + stride], sizes, None, pet,
                                                         jnp.array([o], jnp.int32)) for o in offsets]
    whole = ref_rows(lhs.astype(jnp.float32), rhs.astype(jnp.float32), np.asarray(sizes))
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-6
    for o, shard in zip(offsets, shards):
        assert rel_err(shard, ref_rows(lhs.astype(jnp.float32), rhs[o:o + stride].astype(jnp.float32),
                                       np.asarray(sizes), offset=o)) < tol
    assert rel_err(sum(s.astype(jnp.float32) for s in shards), whole) < tol
    if dtype == jnp.int8:
        return
    cot = jnp.asarray(r.standard_normal((m, n)), jnp.float32)
    d_lhs = 0
    d_rhs = []
    for o in offsets:
        _, vjp = jax.vjp(lambda a, b: ops.grouped_gemm(a, b, sizes, None, pet, jnp.array(o)), lhs, rhs[o:o + stride])
        da, db = vjp(cot)
        d_lhs = d_lhs + da.astype(jnp.float32)
        d_rhs.append(db)
    want_lhs, want_rhs = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=pet),
                                 lhs.astype(jnp.float32), rhs.astype(jnp.float32))[1](cot)
    assert rel_err(d_lhs, want_lhs) < tol
    assert rel_err(jnp.concatenate(d_rhs).astype(jnp.float32), want_rhs) < tol


def test_group_offset_traced_and_vmapped():
    """The offset may be traced (one compile for every shard) and batched with the group sizes."""
    m, k, n, g, local = 40, 8, 6, 4, 2
    r = rng()
    lhs, rhs = operands(r, m, k, n, local, jnp.float32)
    sizes = np.stack([jax_group_sizes(r, m, g) for _ in range(3)])
    offsets = np.array([0, 1, 2], np.int32)
    f = jax.jit(jax.vmap(lambda s, o: ops.grouped_gemm(lhs, rhs, s, group_offset=o)))
    out = f(jnp.asarray(sizes), jnp.asarray(offsets))
    for i in range(3):
        assert rel_err(out[i], ref_rows(lhs, rhs, sizes[i], offset=int(offsets[i]))) < 1e-6


def small_case(transpose_rhs=False):
    m, k, n, g = 23, 6, 5, 4
    r = rng()
    lhs, rhs = operands(r, m, k, n, g, jnp.float32, transpose_rhs=transpose_rhs)
    sizes = jnp.asarray(np.array([7, 0, 11, 3], np.int32))  # an empty group, 2 rows past the groups
    return lhs, rhs, sizes


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_check_grads_second_order_forward_and_reverse(transpose_rhs):
    """jax.test_util.check_grads, modes fwd and rev, order 2, of a function nonlinear in the product."""
    lhs, rhs, sizes = small_case(transpose_rhs)

    def f(a, b):
        return jnp.sin(ops.grouped_gemm(a, b, sizes, transpose_rhs=transpose_rhs))
    check_grads(f, (lhs, rhs), order=2, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2, eps=3e-3)


def test_check_grads_weight_grad_and_ragged_contracting():
    lhs, _, sizes = small_case()
    d_out = jnp.asarray(rng().standard_normal((lhs.shape[0], 5)), jnp.float32)
    check_grads(lambda a, d: jnp.sin(ops.grouped_gemm_weight_grad(a, d, sizes)), (lhs, d_out), order=2,
                modes=("fwd", "rev"), atol=2e-2, rtol=2e-2, eps=3e-3)
    check_grads(lambda a, d: jnp.sin(ops.ragged_dot_general(a, d, sizes, RAGGED_K)), (lhs, d_out), order=2,
                modes=("fwd", "rev"), atol=2e-2, rtol=2e-2, eps=3e-3)


def dense_equivalent(sizes, m):
    """ragged_dot as a masked dense einsum: every JAX transformation of it works (ragged_dot's own hessian does not:
    its batching rule takes only dim 0)."""
    b = bounds(np.asarray(sizes), m)
    rows = np.arange(m)[:, None]
    mask = jnp.asarray((rows >= b[None, :-1]) & (rows < b[None, 1:]), jnp.float32)  # (M, G)
    return lambda a, w: jnp.einsum("mk,gkn,mg->mn", a, w, mask, precision="highest")


def test_jvp_linearize_hessian_and_grad_of_grad_match_ragged_dot():
    """The calls from the issue, against jax.lax.ragged_dot (jvp) and its dense equivalent (the rest)."""
    lhs, rhs, sizes = small_case()
    t_lhs, t_rhs = (jnp.asarray(rng().standard_normal(x.shape), jnp.float32) for x in (lhs, rhs))
    ours = lambda a, b: ops.grouped_gemm(a, b, sizes)  # noqa: E731
    theirs = dense_equivalent(sizes, lhs.shape[0])

    def close(x, y):
        for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
            assert u.shape == v.shape and rel_err(u, v) < 1e-5

    ragged = lambda a, b: jax.lax.ragged_dot(a, b, sizes)  # noqa: E731
    close(jax.jvp(ours, (lhs, rhs), (t_lhs, t_rhs)), jax.jvp(ragged, (lhs, rhs), (t_lhs, t_rhs)))
    y, lin = jax.linearize(ours, lhs, rhs)
    close((y, lin(t_lhs, t_rhs)), jax.jvp(theirs, (lhs, rhs), (t_lhs, t_rhs)))

    def loss(f):
        return lambda a, b: jnp.sum(jnp.tanh(f(a, b)) ** 2)
    close(jax.hessian(loss(ours), argnums=(0, 1))(lhs, rhs), jax.hessian(loss(theirs), argnums=(0, 1))(lhs, rhs))

    def grad_of_grad(f):
        return jax.grad(lambda a: jnp.sum(jax.grad(lambda b: jnp.sum(f(b, rhs) ** 2))(a) ** 2))
    close(grad_of_grad(ours)(lhs), grad_of_grad(theirs)(lhs))
    close(jax.jacfwd(ours, argnums=1)(lhs, rhs), jax.jacrev(ours, argnums=1)(lhs, rhs))


def test_reverse_mode_calls_the_data_and_weight_gradient_kernels():
    """The gradient of the primitive is the two kernels, the transposed-rhs grouped GEMM and the variable-K one (not
    ragged_dot, not a dense expansion); forward mode is grouped GEMMs."""
    lhs, rhs, sizes = small_case()
    grad = jax.jit(jax.grad(lambda a, b: jnp.sum(ops.grouped_gemm(a, b, sizes) ** 2), argnums=(0, 1)))
    hlo = grad.lower(lhs, rhs).as_text()
    assert hlo.count("@turbo_moe_grouped_gemm(") == 2 and hlo.count("@turbo_moe_grouped_gemm_weight_grad(") == 1
    assert "dot_general" not in hlo
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(ops.grouped_gemm(a, b, sizes) ** 2)))(lhs, rhs))
    assert "transpose_rhs=True" in jaxpr
    jvp_hlo = jax.jit(lambda a, b, t: jax.jvp(lambda x: ops.grouped_gemm(x, b, sizes), (a,), (t,))).lower(
        lhs, rhs, lhs).as_text()
    assert jvp_hlo.count("@turbo_moe_grouped_gemm(") == 2 and "@turbo_moe_grouped_gemm_weight_grad(" not in jvp_hlo


def test_vmap_of_jvp_and_of_batched_operands():
    r = rng()
    b_, m, k, n, g = 3, 30, 8, 7, 4
    lhs = jnp.asarray(r.standard_normal((b_, m, k)), jnp.float32)
    rhs = jnp.asarray(r.standard_normal((b_, g, k, n)), jnp.float32)
    sizes = np.stack([jax_group_sizes(r, m, g) for _ in range(b_)])
    out = jax.vmap(ops.grouped_gemm)(lhs, rhs, jnp.asarray(sizes))
    for i in range(b_):
        assert rel_err(out[i], ref_rows(lhs[i], rhs[i], sizes[i])) < 1e-6
    tangents = jax.vmap(lambda a, b, s: jax.jvp(lambda x: ops.grouped_gemm(x, b, s), (a,), (a,))[1])(
        lhs, rhs, jnp.asarray(sizes))
    np.testing.assert_allclose(tangents, out, rtol=1e-6, atol=1e-6)  # linear in lhs: the tangent along lhs is out
    hlo = jax.jit(jax.vmap(ops.grouped_gemm)).lower(lhs, rhs, jnp.asarray(sizes)).as_text()
    assert hlo.count("@turbo_moe_grouped_gemm(") == 1, "vmap must lower to one batched FFI call"


# ragged_dot_general: (lhs shape, rhs shape, group_sizes shape, dimension numbers)
GENERAL_CASES = {
    "ragged_m": ((11, 5), (3, 5, 7), (3,), RAGGED_M),
    "ragged_m_rhs_gnk": ((11, 5), (3, 7, 5), (3,), RDN((([1], [2]), ([], [])), [0], [0])),
    "ragged_m_lhs_km": ((5, 11), (3, 5, 7), (3,), RDN((([0], [1]), ([], [])), [1], [0])),
    "ragged_m_batch": ((2, 11, 5), (3, 2, 5, 7), (2, 3), RDN((([2], [2]), ([0], [1])), [1], [0])),
    "ragged_m_batch_shared_sizes": ((2, 11, 5), (2, 3, 7, 5), (3,), RDN((([2], [3]), ([0], [0])), [1], [1])),
    "ragged_contracting_wgrad": ((11, 5), (11, 7), (3,), RAGGED_K),
    "ragged_contracting_jax": ((11, 5), (5, 7), (3,), RDN((([1], [0]), ([], [])), [1], [])),
    "ragged_contracting_batch": ((2, 11, 5), (2, 5, 7), (2, 3), RDN((([2], [1]), ([0], [0])), [2], [])),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
@pytest.mark.parametrize("case", list(GENERAL_CASES))
def test_ragged_dot_general_matches_jax(case, dtype):
    lhs_shape, rhs_shape, gs_shape, dims = GENERAL_CASES[case]
    r = rng()
    lhs = jnp.asarray(r.integers(-4, 4, lhs_shape) if dtype == jnp.int8 else r.standard_normal(lhs_shape), dtype)
    rhs = jnp.asarray(r.integers(-4, 4, rhs_shape) if dtype == jnp.int8 else r.standard_normal(rhs_shape), dtype)
    ragged = lhs_shape[dims.lhs_ragged_dimensions[0]]
    sizes = jnp.asarray(np.stack([jax_group_sizes(r, ragged, gs_shape[-1])
                                  for _ in range(int(np.prod(gs_shape[:-1])))]).reshape(gs_shape))
    pet = jnp.int32 if dtype == jnp.int8 else jnp.float32
    out = jax.jit(ops.ragged_dot_general, static_argnums=(3, 5))(lhs, rhs, sizes, dims, None, pet)
    want = jax.lax.ragged_dot_general(lhs.astype(pet), rhs.astype(pet), sizes, dims, preferred_element_type=pet)
    assert out.shape == want.shape and out.dtype == want.dtype
    assert rel_err(out, want) < (1e-2 if dtype == jnp.bfloat16 else 1e-6)
    if dtype == jnp.float32:  # gradients of both operands, through our transposes and JAX's
        cot = jnp.asarray(r.standard_normal(want.shape), jnp.float32)
        ours = jax.vjp(lambda a, b: ops.ragged_dot_general(a, b, sizes, dims), lhs, rhs)[1](cot)
        theirs = jax.vjp(lambda a, b: jax.lax.ragged_dot_general(a, b, sizes, dims), lhs, rhs)[1](cot) \
            if dims.rhs_group_dimensions else None  # JAX cannot differentiate the ragged contracting mode
        for i, x in enumerate(ours):
            assert x.shape == (lhs, rhs)[i].shape
            if theirs is not None:
                assert rel_err(x, theirs[i]) < 1e-5


def test_ragged_dot_general_group_offset():
    m, k, n, g = 30, 6, 5, 4
    r = rng()
    lhs = jnp.asarray(r.standard_normal((k, m)), jnp.float32)  # (K, M): ragged in dim 1
    rhs = jnp.asarray(r.standard_normal((n, 2, k)), jnp.float32)  # (N, G_local, K)
    sizes = jax_group_sizes(r, m, g)
    dims = RDN((([0], [2]), ([], [])), [1], [1])
    out = ops.ragged_dot_general(lhs, rhs, jnp.asarray(sizes), dims, group_offset=jnp.array([2]))
    assert rel_err(out, ref_rows(lhs.T, rhs.transpose(1, 2, 0), sizes, offset=2)) < 1e-6


@pytest.mark.parametrize("lhs_shape, rhs_shape, gs_shape, dims, match", [
    ((2, 11, 5), (2, 5, 7), (3,), RDN((([2], [1]), ([0], [0])), [0], []), "ragged batch dimension"),
    ((11, 4, 5), (3, 4, 5, 7), (3,), RDN((([1, 2], [1, 2]), ([], [])), [0], [0]), "one contracting dimension"),
    ((11, 2, 5), (3, 5, 7), (3,), RDN((([2], [1]), ([], [])), [0], [0]), "one free dimension of lhs"),
])
def test_ragged_dot_general_unsupported_dimension_numbers_are_named(lhs_shape, rhs_shape, gs_shape, dims, match):
    lhs, rhs = jnp.ones(lhs_shape), jnp.ones(rhs_shape)
    with pytest.raises(NotImplementedError, match=match) as info:
        ops.ragged_dot_general(lhs, rhs, jnp.ones(gs_shape, jnp.int32), dims)
    assert "RaggedDotDimensionNumbers" in str(info.value)
    with pytest.raises(NotImplementedError, match="group_offset"):
        ops.ragged_dot_general(jnp.ones((11, 5)), jnp.ones((11, 7)), jnp.ones((3,), jnp.int32), RAGGED_K,
                               group_offset=jnp.array(0))


@pytest.mark.parametrize("lhs_shape, rhs_shape, gs_shape, dims, err, match", [
    ((11, 5), (3, 5, 7), (3,), RDN((([1], [1]), ([], [])), [0, 1], [0]), ValueError, "exactly one lhs ragged"),
    ((11, 5), (3, 5, 7), (3,), RDN((([1], [1]), ([], [])), [2], [0]), ValueError, "out of range"),
    ((11, 5), (3, 5, 7), (2,), RAGGED_M, ValueError, r"group_sizes must have shape \(G,\) = \(3,\)"),
    ((11, 5), (3, 6, 7), (3,), RAGGED_M, ValueError, "sizes must match"),
    ((11, 5), (5, 7), (3,), RDN((([1], [0]), ([], [])), [0], []), ValueError, "exactly one rhs group dimension"),
    ((2, 11, 5), (3, 2, 5, 7), (3, 3), RDN((([2], [2]), ([0], [1])), [1], [0]), ValueError, "batch shape"),
])
def test_ragged_dot_general_bad_dimension_numbers(lhs_shape, rhs_shape, gs_shape, dims, err, match):
    with pytest.raises(err, match=match):
        ops.ragged_dot_general(jnp.ones(lhs_shape), jnp.ones(rhs_shape), jnp.ones(gs_shape, jnp.int32), dims)
