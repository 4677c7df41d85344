"""permute / unpermute against float64 numpy: sort order, round trip, weighted combine, gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from tests import reference
from turbo_moe.ops import PermuteHandle, grouped_gemm, permute, permute_rows, unpermute

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def routing(seed, T, k, E, kind="random"):
    rng = np.random.default_rng(seed)
    if kind == "skewed":  # most copies to expert 0: very skewed routing
        ids = np.where(rng.random((T, k)) < 0.9, 0, rng.integers(0, E, (T, k)))
    elif kind == "dropped":  # some ids out of range: those copies are dropped
        ids = rng.integers(-2, E + 2, (T, k))
    else:
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    return ids.astype(np.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "skewed", "dropped"])
def test_permute_matches_reference(dtype, kind):
    T, k, E, H = 203, 3, 7, 37
    x = jax.random.normal(jax.random.key(0), (T, H)).astype(dtype)
    ids = routing(1, T, k, E, kind)
    x_sorted, sizes, handle = permute(x, jnp.asarray(ids), E)
    ref_sorted, ref_sizes, ref_rows = reference.permute(np.asarray(x.astype(jnp.float32)), ids, E)
    np.testing.assert_array_equal(np.asarray(sizes), ref_sizes)
    np.testing.assert_array_equal(np.asarray(handle.row_index), ref_rows)
    np.testing.assert_array_equal(np.asarray(x_sorted.astype(jnp.float32)), ref_sorted)  # copies are exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "skewed", "dropped"])
def test_permute_rows_repeats_the_copy_step_for_new_rows(dtype, kind):
    T, k, E, H = 203, 3, 7, 37
    keys = jax.random.split(jax.random.key(4))
    x, other = (jax.random.normal(key, (T, H)).astype(dtype) for key in keys)
    ids = jnp.asarray(routing(2, T, k, E, kind))
    _, sizes, handle = permute(x, ids, E)
    want, _, _ = permute(other, ids, E)
    got = jax.jit(permute_rows)(other, handle, sizes)
    assert got.dtype == dtype and got.shape == (T * k, H)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    if kind == "dropped":  # rows past the group sizes' total are zero, not left over
        assert int(sizes.sum()) < T * k and not np.asarray(got[int(sizes.sum()):].astype(jnp.float32)).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "skewed", "dropped"])
def test_unpermute_weighted_combine(dtype, kind):
    T, k, E, H = 150, 4, 9, 24
    ids = routing(2, T, k, E, kind)
    x = jax.random.normal(jax.random.key(3), (T, H)).astype(dtype)
    w = jax.random.uniform(jax.random.key(4), (T, k))
    x_sorted, _, handle = permute(x, jnp.asarray(ids), E)
    y = x_sorted * 2 + 1  # any per-row function of the sorted copies
    out = unpermute(y, handle, w)
    ref = reference.unpermute(np.asarray(y.astype(jnp.float32)), np.asarray(handle.row_index), w)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, rtol=tol, atol=tol * 4)


def test_round_trip_recovers_tokens():
    T, k, E, H = 64, 2, 5, 16
    x = jax.random.normal(jax.random.key(5), (T, H))
    ids = jnp.asarray(routing(6, T, k, E))
    x_sorted, sizes, handle = permute(x, ids, E)
    back = unpermute(x_sorted, handle, jnp.full((T, k), 1.0 / k))
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), rtol=1e-6)
    assert int(sizes.sum()) == T * k


def test_all_tokens_to_one_expert_and_empty_experts():
    T, k, E, H = 33, 2, 6, 8
    ids = np.zeros((T, k), np.int32); ids[:, 1] = 5  # experts 1..4 empty
    x = jax.random.normal(jax.random.key(7), (T, H))
    x_sorted, sizes, handle = permute(x, jnp.asarray(ids), E)
    np.testing.assert_array_equal(np.asarray(sizes), [T, 0, 0, 0, 0, T])
    np.testing.assert_array_equal(np.asarray(x_sorted[:T]), np.asarray(x))


@pytest.mark.parametrize("kind", ["random", "dropped"])
def test_check_grads_unpermute(kind):
    T, k, E, H = 12, 3, 4, 5
    ids = jnp.asarray(routing(8, T, k, E, kind))
    x = jax.random.normal(jax.random.key(9), (T, H), jnp.float32)
    _, _, handle = permute(x, ids, E)
    y = jax.random.normal(jax.random.key(10), (T * k, H))
    w = jax.random.uniform(jax.random.key(11), (T, k))
    check_grads(lambda y, w: unpermute(y, handle, w), (y, w), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("kind", ["random", "dropped"])
def test_check_grads_permute(kind):
    T, k, E, H = 12, 3, 4, 5
    ids = jnp.asarray(routing(12, T, k, E, kind))
    x = jax.random.normal(jax.random.key(13), (T, H), jnp.float32)
    check_grads(lambda x: permute(x, ids, E)[0], (x,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def test_permute_and_unpermute_are_transposes():
    """<permute(x), y> == <x, permute^T(y)>: the VJP of permute is unpermute with unit weights."""
    T, k, E, H = 40, 2, 6, 7
    ids = jnp.asarray(routing(14, T, k, E, "dropped"))
    x = jax.random.normal(jax.random.key(15), (T, H))
    y = jax.random.normal(jax.random.key(16), (T * k, H))
    x_sorted, _, handle = permute(x, ids, E)
    _, vjp = jax.vjp(lambda x: permute(x, ids, E)[0], x)
    lhs = float(jnp.vdot(x_sorted, y))
    rhs = float(jnp.vdot(x, vjp(y)[0]))
    assert abs(lhs - rhs) < 1e-4 * max(1.0, abs(lhs))
    np.testing.assert_allclose(np.asarray(vjp(y)[0]), np.asarray(unpermute(y, handle, jnp.ones((T, k)))), rtol=1e-6)


def test_moe_layer_gradient_through_all_ops():
    """permute -> grouped_gemm -> unpermute, differentiated end to end against a dense reference."""
    T, k, E, H, F = 48, 2, 4, 8, 12
    ids = jnp.asarray(routing(17, T, k, E))
    x = jax.random.normal(jax.random.key(18), (T, H))
    wts = jax.random.normal(jax.random.key(19), (E, H, F))
    gate = jax.random.uniform(jax.random.key(20), (T, k))

    def turbo(x, wts, gate):
        xs, sizes, handle = permute(x, ids, E)
        return jnp.sum(unpermute(grouped_gemm(xs, wts, sizes), handle, gate) ** 2)

    def dense(x, wts, gate):
        per_expert = jnp.einsum("th,ehf->tef", x, wts)  # (T, E, F)
        picked = jnp.take_along_axis(per_expert, ids[:, :, None], axis=1)  # (T, k, F)
        return jnp.sum(jnp.einsum("tk,tkf->tf", gate, picked) ** 2)

    g1 = jax.jit(jax.grad(turbo, argnums=(0, 1, 2)))(x, wts, gate)
    g2 = jax.grad(dense, argnums=(0, 1, 2))(x, wts, gate)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4)


def test_vmap_permute_unpermute():
    B, T, k, E, H = 3, 20, 2, 5, 6
    x = jax.random.normal(jax.random.key(21), (B, T, H))
    ids = jnp.asarray(np.stack([routing(30 + b, T, k, E, "dropped") for b in range(B)]))
    xs, sizes, handle = jax.vmap(permute, in_axes=(0, 0, None))(x, ids, E)
    for b in range(B):
        ref_sorted, ref_sizes, ref_rows = reference.permute(np.asarray(x[b]), np.asarray(ids[b]), E)
        np.testing.assert_array_equal(np.asarray(sizes[b]), ref_sizes)
        np.testing.assert_array_equal(np.asarray(xs[b]), ref_sorted)
    w = jnp.ones((B, T, k))
    out = jax.vmap(unpermute)(xs, handle, w)
    assert out.shape == (B, T, H)


@pytest.mark.parametrize("call, err, match", [
    (lambda: permute(jnp.ones((4, 3, 1)), jnp.zeros((4, 2), jnp.int32), 3), ValueError, "x must have rank 2"),
    (lambda: permute(jnp.ones((4, 3)), jnp.zeros((5, 2), jnp.int32), 3), ValueError, "T=4 rows"),
    (lambda: permute(jnp.ones((4, 3)), jnp.zeros((4, 2)), 3), TypeError, "expert_ids must be an integer"),
    (lambda: permute(jnp.ones((4, 3)), jnp.zeros((4, 2), jnp.int32), 0), ValueError, "num_experts"),
    (lambda: unpermute(jnp.ones((8, 3)), jnp.zeros((4, 2), jnp.int32), jnp.ones((4, 2))), TypeError, "PermuteHandle"),
    (lambda: unpermute(jnp.ones((8, 3)), PermuteHandle(jnp.zeros((4, 2), jnp.int32)), jnp.ones((4, 3))),
     ValueError, r"weights must have shape \(T, k\)"),
    (lambda: unpermute(jnp.ones((7,)), PermuteHandle(jnp.zeros((4, 2), jnp.int32)), jnp.ones((4, 2))),
     ValueError, "y_sorted must have rank 2"),
    (lambda: permute_rows(jnp.ones((4, 3)), jnp.zeros((4, 2), jnp.int32), jnp.ones(3, jnp.int32)), TypeError,
     "PermuteHandle"),
    (lambda: permute_rows(jnp.ones((5, 3)), PermuteHandle(jnp.zeros((4, 2), jnp.int32)), jnp.ones(3, jnp.int32)),
     ValueError, "T=5 rows"),
    (lambda: permute_rows(jnp.ones((4, 3)), PermuteHandle(jnp.zeros((4, 2), jnp.int32)), jnp.ones(3)), TypeError,
     "group_sizes must be an integer"),
    (lambda: permute_rows(jnp.ones((4, 3), jnp.int32), PermuteHandle(jnp.zeros((4, 2), jnp.int32)),
                          jnp.ones(3, jnp.int32)), TypeError, "x"),
])
def test_bad_input_is_named(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_permute_and_permute_rows_zero_tail_false():
    """The expert block's calls (zero_tail=False): the rows of the copies as with zeros, the dropped copies' rows
    past sum(group_sizes) left to the caller (NaN on the CPU: the handler poisons them)."""
    from turbo_moe.ops.permute import _permute_call, permute_rows_call

    rng = np.random.default_rng(3)
    T, H, k, E = 12, 8, 3, 4
    x = jnp.asarray(rng.normal(size=(T, H)), jnp.float32)
    ids = jnp.asarray(rng.integers(-2, E, size=(T, k)), jnp.int32)  # negative ids: dropped copies -> a tail
    rows_z, gs, ri = _permute_call(x, ids, E)
    rows_f, gs_f, ri_f = _permute_call(x, ids, E, False)
    n = int(gs.sum())
    assert n < T * k
    np.testing.assert_array_equal(gs_f, gs)
    np.testing.assert_array_equal(ri_f, ri)
    np.testing.assert_array_equal(rows_f[:n], rows_z[:n])
    again = permute_rows_call(x, ri, gs, False)
    np.testing.assert_array_equal(again[:n], rows_z[:n])
    if jax.default_backend() == "cpu":
        assert np.isnan(np.asarray(rows_f[n:])).all() and np.isnan(np.asarray(again[n:])).all()
