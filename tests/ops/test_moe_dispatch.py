"""moe_dispatch / moe_combine inside shard_map on forced host devices: exactness, skew, overflow, grads."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P
from jax.test_util import check_grads

from turbo_moe.ops import grouped_gemm, moe_combine, moe_dispatch, permute, unpermute

H, F = 6, 5


def mesh_of(ranks):
    if jax.device_count() < ranks:
        pytest.skip(f"needs {ranks} devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    return Mesh(np.array(jax.devices()[:ranks]), ("expert",))


def ep_layer(ranks, num_experts, capacity=None):
    """Token-sharded MoE layer with experts sharded over `expert`: returns (out, overflow, counts)."""
    def layer(x, ids, w, W):
        rx, rids, rw, handle = moe_dispatch(x, ids, w, num_experts=num_experts, axis_name="expert",
                                            capacity=capacity)
        xs, sizes, ph = permute(rx, rids, num_experts // ranks)
        y = unpermute(grouped_gemm(xs, W, sizes), ph, rw)
        return moe_combine(y, handle, axis_name="expert"), handle.overflow, handle.counts

    spec = P("expert")
    return jax.jit(jax.shard_map(layer, mesh=mesh_of(ranks), in_specs=(spec,) * 4, out_specs=(spec,) * 3))


def dense_reference(x, ids, w, W, keep=None):
    per_copy = jnp.einsum("th,tkhf->tkf", x, W[jnp.clip(ids, 0, W.shape[0] - 1)])
    valid = (ids >= 0) & (ids < W.shape[0]) if keep is None else keep
    return jnp.einsum("tk,tkf->tf", jnp.where(valid, w, 0.0), per_copy)


def problem(seed, ranks, T, k, E, skew=False):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(ranks * T, H)), jnp.float32)
    if skew:  # every token picks experts of rank 0 only
        ids = np.stack([rng.choice(E // ranks, k, replace=False) for _ in range(ranks * T)])
    else:
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(ranks * T)])
    w = jnp.asarray(rng.random((ranks * T, k)), jnp.float32)
    W = jnp.asarray(rng.normal(size=(E, H, F)) / np.sqrt(H), jnp.float32)
    return x, jnp.asarray(ids, jnp.int32), w, W


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("skew", [False, True])
def test_matches_single_device(ranks, skew):
    E, T, k = 24, 12, 3
    x, ids, w, W = problem(ranks, ranks, T, k, E, skew)
    out, overflow, counts = ep_layer(ranks, E)(x, ids, w, W)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense_reference(x, ids, w, W)), rtol=1e-5, atol=1e-5)
    assert int(overflow.sum()) == 0, "worst-case buffers never overflow"
    if skew:  # each token sent once to rank 0, none elsewhere: nothing lost or duplicated
        np.testing.assert_array_equal(np.asarray(counts).reshape(ranks, ranks)[:, 0], T)
        assert int(counts.sum()) == ranks * T


@pytest.mark.parametrize("ranks", [2, 4])
def test_gradients_match_single_device(ranks):
    E, T, k = 8, 10, 2
    x, ids, w, W = problem(7, ranks, T, k, E)
    f = ep_layer(ranks, E)
    grads = jax.grad(lambda x, w, W: jnp.sum(f(x, ids, w, W)[0] ** 2), argnums=(0, 1, 2))(x, w, W)
    ref = jax.grad(lambda x, w, W: jnp.sum(dense_reference(x, ids, w, W) ** 2), argnums=(0, 1, 2))(x, w, W)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_capacity_overflow_is_counted_not_silent():
    ranks, E, T, k, cap = 2, 4, 8, 2, 3
    x, ids, w, W = problem(3, ranks, T, k, E, skew=True)  # all 8 tokens of each rank -> rank 0
    out, overflow, counts = ep_layer(ranks, E, capacity=cap)(x, ids, w, W)
    ovf = np.asarray(overflow).reshape(ranks, ranks)
    np.testing.assert_array_equal(ovf[:, 0], T - cap)  # each source: T tokens, cap fit
    np.testing.assert_array_equal(np.asarray(counts).reshape(ranks, ranks)[:, 0], cap)
    # Only the first `cap` tokens of each source rank (token order) got their experts.
    keep = np.zeros((ranks * T, k), bool)
    for r in range(ranks):
        keep[r * T: r * T + cap] = True
    ref = dense_reference(x, ids, w, W, keep=jnp.asarray(keep))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_dispatch_combine_round_trip_and_check_grads():
    ranks, E, T, k = 4, 8, 6, 2
    x, ids, w, _ = problem(5, ranks, T, k, E)

    def round_trip(x, ids, w):
        rx, _, rw, handle = moe_dispatch(x, ids, w, num_experts=E, axis_name="expert")
        # every received row is scaled by the sum of its local weights, then sent back
        return moe_combine(rx * rw.sum(-1, keepdims=True).astype(rx.dtype), handle, axis_name="expert")

    f = jax.jit(jax.shard_map(round_trip, mesh=mesh_of(ranks), in_specs=(P("expert"),) * 3, out_specs=P("expert")))
    np.testing.assert_allclose(np.asarray(f(x, ids, w)), np.asarray(x * w.sum(-1, keepdims=True)), rtol=1e-5)
    check_grads(lambda x, w: f(x, ids, w), (x, w), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def test_bad_arguments_are_named():
    mesh = mesh_of(2)
    x, ids, w, _ = problem(1, 2, 4, 2, 6)

    def bad_experts(x, ids, w):
        return moe_dispatch(x, ids, w, num_experts=5, axis_name="expert")[0]

    with pytest.raises(ValueError, match="num_experts=5 must be divisible"):
        jax.shard_map(bad_experts, mesh=mesh, in_specs=(P("expert"),) * 3, out_specs=P("expert"))(x, ids, w)

    def bad_capacity(x, ids, w):
        return moe_dispatch(x, ids, w, num_experts=6, axis_name="expert", capacity=0)[0]

    with pytest.raises(ValueError, match="capacity must be in"):
        jax.shard_map(bad_capacity, mesh=mesh, in_specs=(P("expert"),) * 3, out_specs=P("expert"))(x, ids, w)


def test_replicated_weights_get_summed_gradients_in_shard_map():
    """Weights replicated over a mesh axis, tokens sharded: the op's weight gradient is the sum over
    shards (the custom_vjp types its cotangent like the primal), as with jnp ops."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
    x, _, _, W = problem(9, 2, 16, 2, 4)
    sizes = jnp.array([5, 0, 7, 4, 5, 0, 7, 4], jnp.int32)  # per shard: (4,) each

    def sharded(x, W, sizes):
        return jnp.sum(grouped_gemm(x, W, sizes) ** 2)[None]

    f = jax.shard_map(sharded, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P("data"))
    grads = jax.grad(lambda x, W: f(x, W, sizes).sum(), argnums=(0, 1))(x, W)
    ref = jax.grad(lambda x, W: sum(jnp.sum(jax.lax.ragged_dot(x[i * 16:(i + 1) * 16], W, sizes[i * 4:(i + 1) * 4]) ** 2)
                                    for i in range(2)), argnums=(0, 1))(x, W)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
