"""MaxText's own MoE layer (maxtext.layers.moe.RoutedMoE, sparse_matmul) gives the same outputs and gradients with its
expert GEMMs on turbo_moe (turbo_moe.integrations.maxtext) as with MaxText's jax.lax.ragged_dot.

Needs `maxtext` (Python >= 3.12, not in the [dev] extra: it pulls aqtp, qwix, tokamax, grain, transformers, ...);
those tests are skipped where it does not import."""
from __future__ import annotations

import os
import sys
import tempfile

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from turbo_moe.integrations import maxtext as turbo_maxtext

try:
    import maxtext
    import maxtext.layers.moe as moe
    from flax import nnx
    from flax.linen import partitioning as nn_partitioning
    from maxtext.configs import pyconfig
    from maxtext.layers.initializers import nd_dense_init
    from maxtext.utils import maxtext_utils
except ImportError:
    maxtext = None
needs_maxtext = pytest.mark.skipif(maxtext is None, reason="maxtext is not installed (pip install maxtext==0.2.5 "
                                   "--no-deps, plus aqtp qwix tokamax grain transformers pathwaysutils drjax jinja2 "
                                   "pillow, on Python >= 3.12)")


def test_enable_without_maxtext_says_what_to_install(monkeypatch):
    """Where MaxText does not import, enable() raises one ImportError naming the package to install."""
    turbo_maxtext.disable()
    for name in ("maxtext", "maxtext.layers", "maxtext.layers.moe"):
        monkeypatch.setitem(sys.modules, name, None)  # what a missing package looks like to import
    with pytest.raises(ImportError, match=r"needs MaxText, which is not installed .*pip install maxtext==0\.2\.5"):
        turbo_maxtext.enable()
    assert not turbo_maxtext.is_enabled()


BASE_YML = maxtext and os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
TINY = dict(num_experts=8, num_experts_per_tok=2, base_emb_dim=32, base_moe_mlp_dim=24, base_mlp_dim=24,
            per_device_batch_size=2, max_target_length=16, dtype="float32", weight_dtype="float32",
            matmul_precision="highest", capacity_factor=-1.0, sparse_matmul=True)


def make_config(n_devices: int, **overrides):
    return pyconfig.initialize([None, BASE_YML], run_name="turbo_test", enable_checkpointing=False,
                               skip_jax_distributed_system=True, base_output_directory=tempfile.gettempdir(),
                               **(TINY | overrides))


def run_layer(cfg, n_devices: int, objective):
    """value_and_grad of `objective(layer outputs, probe) -> (loss, aux)` for RoutedMoE on `n_devices`, jitted inside
    the mesh and MaxText's logical axis rules: (aux, d_inputs, d_params)."""
    devices = np.asarray(jax.devices()[:n_devices])
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(cfg, devices=devices), cfg.mesh_axes)
    # MaxText calls jax.lax.ragged_dot without a precision: XLA:GPU multiplies float32 in TF32 there, turbo
    # exactly. "highest" makes the reference float32 too (no-op on the CPU).
    with jax.set_mesh(mesh), nn_partitioning.axis_rules(cfg.logical_axis_rules), \
            jax.default_matmul_precision("highest"):
        layer = moe.RoutedMoE(config=cfg, num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                              mesh=mesh, kernel_init=nd_dense_init(1.0, "fan_in", "truncated_normal"),
                              kernel_axes=("embed", None), rngs=nnx.Rngs(0), intermediate_dim=cfg.moe_mlp_dim,
                              dtype=cfg.dtype, weight_dtype=cfg.weight_dtype)
        graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
        batch = cfg.per_device_batch_size * n_devices
        x = jax.random.normal(jax.random.PRNGKey(1), (batch, cfg.max_target_length, cfg.emb_dim), jnp.float32)
        probe = jax.random.normal(jax.random.PRNGKey(2), x.shape, jnp.float32)

        def loss(params, x):
            return objective(nnx.merge(graphdef, params, rest)(x), probe)

        (_, aux), (d_params, d_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return aux, d_x, d_params


def layer_and_grads(cfg, n_devices: int):
    """(output, d_inputs, d_params) of sum(RoutedMoE(x) * probe)."""
    return run_layer(cfg, n_devices, lambda outputs, probe: (jnp.sum(outputs[0] * probe), outputs[0]))


def assert_same(a, b, what):
    a_leaves, b_leaves = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(a_leaves) == len(b_leaves), what
    for i, (u, v) in enumerate(zip(a_leaves, b_leaves)):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        assert u.shape == v.shape, f"{what}[{i}]: shapes {u.shape} vs {v.shape}"
        scale = max(1.0, float(np.abs(v).max()))
        np.testing.assert_allclose(u, v, rtol=0, atol=2e-5 * scale, err_msg=f"{what}[{i}]")


@pytest.fixture(scope="module")
def reference():
    """MaxText's GPU choice (megablox=False: jax.lax.ragged_dot), turbo off."""
    turbo_maxtext.disable()
    cfg = make_config(1, megablox=False, use_tokamax_gmm=False)
    return layer_and_grads(cfg, 1)


@needs_maxtext
@pytest.mark.parametrize("kernel", ["ragged_dot", "megablox", "tokamax"])
def test_same_outputs_and_gradients_on_turbo(reference, kernel):
    keys = dict(ragged_dot=dict(megablox=False, use_tokamax_gmm=False),
                megablox=dict(megablox=True, use_tokamax_gmm=False),
                tokamax=dict(megablox=False, use_tokamax_gmm=True))[kernel]
    cfg = make_config(1, **keys)
    turbo_maxtext.reset_stats()
    with turbo_maxtext.grouped_gemm():
        out, d_x, d_params = layer_and_grads(cfg, 1)
    entry = dict(ragged_dot="ragged_dot", megablox="megablox_gmm", tokamax="tokamax_ragged_dot")[kernel]
    stats = turbo_maxtext.stats()
    assert stats.get(f"turbo:{entry}", 0) >= 3, stats  # wi_0, wi_1 and wo ran on turbo
    assert not any(k.startswith("fallback") for k in stats), stats
    ref_out, ref_d_x, ref_d_params = reference
    assert float(jnp.abs(ref_out).max()) > 0  # the layer computed something
    assert_same(out, ref_out, "output")
    assert_same(d_x, ref_d_x, "d_inputs")
    assert_same(d_params, ref_d_params, "d_params")


@needs_maxtext
@pytest.mark.parametrize("exchange", ["ring_of_experts", "ragged_all_to_all"])
def test_expert_parallel_gemms_on_turbo(exchange):
    """EP=2 over two devices: the GEMMs inside MaxText's shard_map run on turbo and give MaxText's own results.
    ring_of_experts gathers the tokens (all_gather / psum_scatter) and calls megablox's gmm with a group offset
    (jax.lax.ragged_dot ignores group_offset there); ragged_all_to_all needs a GPU (XLA:CPU has no ragged-all-to-all)."""
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    if exchange == "ragged_all_to_all" and jax.devices()[0].platform == "cpu":
        pytest.skip("XLA:CPU does not implement ragged-all-to-all (MaxText's default EP exchange); runs on GPUs")
    ring = exchange == "ring_of_experts"
    cfg = make_config(2, megablox=ring, use_tokamax_gmm=False, ici_expert_parallelism=2, use_ring_of_experts=ring)
    turbo_maxtext.disable()
    ref = layer_and_grads(cfg, 2)
    turbo_maxtext.reset_stats()
    with turbo_maxtext.grouped_gemm():
        got = layer_and_grads(cfg, 2)
    # ring-of-experts: MaxText's own EP body, its GEMMs on turbo; ragged_all_to_all: turbo's EP body (test_maxtext_ep)
    key, calls = ("turbo:megablox_gmm", 3) if ring else ("turbo_ep:sparse_matmul", 1)
    assert turbo_maxtext.stats().get(key, 0) >= calls, turbo_maxtext.stats()
    for name, a, b in zip(("output", "d_inputs", "d_params"), got, ref):
        assert_same(a, b, name)


@needs_maxtext
def test_disable_restores_maxtexts_modules():
    before = {n: getattr(moe, n) for n in ("jax", "mblx", "tokamax")}
    with turbo_maxtext.grouped_gemm():
        assert turbo_maxtext.is_enabled()
        assert moe.jax.lax.ragged_dot is not jax.lax.ragged_dot
        assert moe.jax.numpy is jnp  # everything else is MaxText's own
        assert jax.lax.ragged_dot is before["jax"].lax.ragged_dot  # nothing outside maxtext.layers.moe changes
    assert not turbo_maxtext.is_enabled()
    assert {n: getattr(moe, n) for n in before} == before


@needs_maxtext
def test_quantized_or_unknown_calls_fall_back():
    """A call turbo cannot take as asked (here integer operands) runs MaxText's own kernel and is counted."""
    with turbo_maxtext.grouped_gemm():
        turbo_maxtext.reset_stats()
        lhs = jnp.arange(12, dtype=jnp.int8).reshape(4, 3)
        rhs = jnp.ones((2, 3, 5), jnp.int8)
        sizes = jnp.array([1, 3], jnp.int32)
        got = moe.jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.int32)
        want = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.int32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert turbo_maxtext.stats() == {"fallback:ragged_dot": 1}
