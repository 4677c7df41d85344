"""The MoE paths of the table: same outputs and gradients when nothing drops; MaxText dropping for dense_cf."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.model.path_cases import fake_pallas, needs  # noqa: F401  (fake_pallas: a fixture)
from turbo_moe.model import ExpertWeights, get_config, moe_path_fn
from turbo_moe.model.config import MOE_PATHS
from turbo_moe.model.paths import ONE_DEVICE, PATHS, expert_capacity
from turbo_moe.model.router import Routing, route


# Every one-device row of the table; `pallas` runs through CPU fakes of the Mosaic-GPU kernels here. The FP8 GEMMs
# need 128-wide dims and match to FP8's error, not float32's: test_turbo_fp8_matches_the_reference_to_fp8_error.
ONE_DEVICE_PATHS = [pytest.param(p, marks=needs(PATHS[(p, ONE_DEVICE)])) for p in MOE_PATHS
                    if PATHS[(p, ONE_DEVICE)].gemm != "fp8"]

TOLERANCE = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=5e-2, atol=3e-2)}


@jax.jit
def reference_experts(x, routing, weights):
    """y[t] = sum_j w[t, j] * SwiGLU_{e[t, j]}(x[t]), gathering each copy's expert weights (float32)."""
    b, s, d = x.shape
    f = weights.w_down.shape[1]
    xt = x.reshape(b * s, d).astype(jnp.float32)
    ids = routing.expert_ids.reshape(b * s, -1)
    w_gu = weights.w_gate_up.astype(jnp.float32)[ids]  # (T, k, D, 2F)
    w_down = weights.w_down.astype(jnp.float32)[ids]  # (T, k, F, D)
    h = jnp.einsum("td,tkdf->tkf", xt, w_gu)
    act = jax.nn.silu(h[..., :f]) * h[..., f:]
    out = jnp.einsum("tkf,tkfd->tkd", act, w_down)
    y = jnp.einsum("tkd,tk->td", out, routing.weights.reshape(b * s, -1))
    return y.reshape(b, s, d)


def make_case(seed=0, b=2, s=16, d=32, f=16, e=8, k=2):
    cfg = get_config("tiny", n_experts=e, top_k=k, n_groups=4, topk_groups=2, routed_scaling_factor=1.5)
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (b, s, d))
    routing = route(jax.nn.sigmoid(jax.random.normal(keys[1], (b, s, e))), jnp.zeros(e), cfg)
    weights = ExpertWeights(jax.random.normal(keys[2], (e, d, 2 * f)) * 0.2,
                            jax.random.normal(keys[3], (e, f, d)) * 0.2)
    cotangent = jax.random.normal(keys[4], (b, s, d))
    return x, routing, weights, cotangent


def path_loss_and_grads(fn, x, routing, weights, cotangent, dtype):
    """Scalar <fn(x), cotangent> and its gradients wrt x, routing weights and both expert weights."""

    def loss(x, route_weights, weights):
        y, _ = fn(x.astype(dtype), routing._replace(weights=route_weights), weights)
        return jnp.sum(y.astype(jnp.float32) * cotangent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, routing.weights, weights)


@functools.lru_cache(maxsize=None)
def reference_loss_and_grads(dtype):
    """Reference value and gradients for make_case(), computed once per dtype."""
    reference = lambda *args: (reference_experts(*args), None)
    return path_loss_and_grads(reference, *make_case(), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("path", ONE_DEVICE_PATHS)
def test_paths_match_reference_outputs_and_grads(path, dtype, request):
    if PATHS[(path, ONE_DEVICE)].gemm == "pallas":
        if dtype == jnp.float32:
            pytest.skip("the Pallas Mosaic-GPU GEMM computes in bfloat16/float16")
        request.getfixturevalue("fake_pallas")
    x, routing, weights, cotangent = make_case()
    capacity_factor = float(weights.n_experts)  # capacity >= seq_len: nothing can drop
    fn = moe_path_fn(path, capacity_factor)
    y, stats = jax.jit(fn)(x.astype(dtype), routing, weights)
    assert y.dtype == dtype and y.shape == x.shape
    np.testing.assert_allclose(np.asarray(y, np.float32), reference_experts(x.astype(dtype), routing, weights),
                               **TOLERANCE[dtype])
    np.testing.assert_array_equal(stats.expert_load, np.bincount(np.asarray(routing.expert_ids).ravel(), minlength=8))
    assert float(stats.dropped_fraction) == 0.0

    got = path_loss_and_grads(fn, x, routing, weights, cotangent, dtype)
    want = reference_loss_and_grads(dtype)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = float(jnp.max(jnp.abs(w))) or 1.0
        np.testing.assert_allclose(np.asarray(g) / scale, np.asarray(w) / scale, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_turbo_fp8_matches_the_reference_to_fp8_error(dtype):
    """The turbo exchange with the FP8 GEMM set: outputs and gradients within FP8's error of the float32 reference
    (relative Frobenius error ~4% forward, ~6-10% in the gradients); the same loads, nothing dropped."""
    x, routing, weights, cotangent = make_case(d=128, f=128)
    fn = moe_path_fn("turbo_fp8", float(weights.n_experts))
    y, stats = jax.jit(fn)(x.astype(dtype), routing, weights)
    assert y.dtype == dtype and y.shape == x.shape
    want = reference_experts(x.astype(dtype), routing, weights)
    error = float(jnp.linalg.norm(y.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    assert 1e-4 < error < 0.08, error  # FP8 rounding shows, and stays within its bound
    np.testing.assert_array_equal(stats.expert_load, np.bincount(np.asarray(routing.expert_ids).ravel(), minlength=8))
    assert float(stats.dropped_fraction) == 0.0
    got = path_loss_and_grads(fn, x, routing, weights, cotangent, dtype)
    want = path_loss_and_grads(lambda *a: (reference_experts(*a), None), x, routing, weights, cotangent, jnp.float32)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        error = float(jnp.linalg.norm(g.astype(jnp.float32) - w) / jnp.linalg.norm(w))
        assert error < 0.15, error


def test_turbo_fp8_needs_128_wide_expert_gemms():
    with pytest.raises(ValueError, match=r"ModelConfig.moe_ffn_dim: moe_path='turbo_fp8'.*multiple of 128, got 32"):
        get_config("tiny", moe_path="turbo_fp8", d_model=128)
    with pytest.raises(ValueError, match=r"ModelConfig.d_model: .*got 64"):
        get_config("tiny", moe_path="turbo_fp8", moe_ffn_dim=128)
    assert get_config("tiny", moe_path="turbo_fp8", d_model=128, moe_ffn_dim=128).moe_path == "turbo_fp8"


def test_dense_cf_without_capacity_computes_every_expert():
    x, routing, weights, _ = make_case(seed=1)
    y, stats = jax.jit(moe_path_fn("dense_cf", 0.0))(x, routing, weights)
    np.testing.assert_allclose(y, reference_experts(x, routing, weights), rtol=1e-5, atol=1e-5)
    assert float(stats.dropped_fraction) == 0.0


@pytest.mark.parametrize("seq_len, k, n_experts, cf, expected", [
    (4, 2, 4, 0.5, 1), (4, 2, 4, 1.0, 2), (128, 2, 16, 1.25, 20), (10, 3, 8, 1.0, 4), (2, 1, 8, 1.5, 1),
    (2048, 8, 256, 1.0, 64)])
def test_expert_capacity_follows_maxtext(seq_len, k, n_experts, cf, expected):
    assert expert_capacity(seq_len, k, n_experts, cf) == expected


# Hand-made routing for one sequence of 4 tokens, k=2, E=4. Copies claim slots in (token, choice) order:
#   t0 -> e0, e1 | t1 -> e1, e2 | t2 -> e1, e0 | t3 -> e3, e2
HAND_IDS = [[0, 1], [1, 2], [1, 0], [3, 2]]
# capacity 1: e0 keeps t0; e1 keeps t0 (drops t1, t2); e2 keeps t1 (drops t3); e3 keeps t3; t2's e0 copy drops.
KEPT_CAPACITY_1 = [[1, 1], [0, 1], [0, 0], [1, 0]]
# capacity 2: only e1's third claimant (t2, choice 0) drops.
KEPT_CAPACITY_2 = [[1, 1], [1, 1], [0, 1], [1, 1]]


@pytest.mark.parametrize("cf, kept", [(0.5, KEPT_CAPACITY_1), (1.0, KEPT_CAPACITY_2)])
def test_dense_cf_drops_exactly_the_maxtext_overflow(cf, kept):
    d, f, e = 8, 4, 4
    keys = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(keys[0], (1, 4, d))
    ids = jnp.array([HAND_IDS], jnp.int32)  # (1, 4, 2)
    route_weights = jax.random.uniform(keys[1], (1, 4, 2), minval=0.2, maxval=1.0)
    routing = Routing(ids, route_weights, jnp.zeros((1, 4, e)))
    weights = ExpertWeights(jax.random.normal(keys[2], (e, d, 2 * f)), jax.random.normal(keys[3], (e, f, d)))

    fn = moe_path_fn("dense_cf", cf)
    y, stats = jax.jit(fn)(x, routing, weights)
    kept = jnp.array([kept], jnp.float32)
    want = reference_experts(x, routing._replace(weights=route_weights * kept), weights)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats.dropped_fraction, 1.0 - kept.mean(), rtol=1e-6)
    np.testing.assert_array_equal(stats.expert_load, [2, 3, 2, 1])  # load counts routed copies, dropped or not

    # A token whose copies all dropped gets no gradient through the routed experts.
    grad_x = jax.jit(jax.grad(lambda x: jnp.sum(fn(x, routing, weights)[0])))(x)
    fully_dropped = np.asarray(kept[0].sum(-1) == 0)
    assert np.all(np.asarray(grad_x[0])[fully_dropped] == 0.0)
    assert np.all(np.abs(np.asarray(grad_x[0])[~fully_dropped]).sum(-1) > 0.0)


def test_table_has_one_row_per_path_and_exchange():
    from turbo_moe.model.config import EP_EXCHANGES
    from turbo_moe.model.exchanges import capacity_exchange, permute_exchange, sort_exchange  # noqa: F401
    from turbo_moe.ops.gemm_sets import GEMM_SETS
    from turbo_moe.model.paths import EP_WRAPPERS, LOCAL_EXCHANGES

    assert set(PATHS) == {(p, e) for p in MOE_PATHS for e in (ONE_DEVICE,) + EP_EXCHANGES}
    for (path, exchange), row in PATHS.items():
        assert row.exchange in LOCAL_EXCHANGES and row.gemm in GEMM_SETS, (path, exchange)
        assert (row.ep_wrapper is None) == (exchange == ONE_DEVICE), (path, exchange)
        assert row.ep_wrapper is None or row.ep_wrapper in EP_WRAPPERS


def test_pallas_path_needs_a_hopper_gpu():
    """On the CPU (or any non-Hopper device) the pallas path says what it needs, at trace time."""
    x, routing, weights, _ = make_case()
    with pytest.raises(ValueError, match="moe_path='pallas'.*Hopper GPU"):
        jax.jit(moe_path_fn("pallas", 1.0))(x.astype(jnp.bfloat16), routing, weights)
    with pytest.raises(ValueError, match="dtype"):
        get_config("tiny", moe_path="pallas", dtype="float32")


def test_pallas_path_rejects_float32(fake_pallas):
    x, routing, weights, _ = make_case()
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        jax.jit(moe_path_fn("pallas", 1.0))(x, routing, weights)
