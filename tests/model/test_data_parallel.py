"""On a mesh without an expert axis the MoE layers run per device (shard_map): each device's FFI
kernels see only its own tokens, and the results equal the one-device run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.model.conftest import micro_config, router_recipe_with
from turbo_moe.model import DeepSeekModel, lm_loss
from turbo_moe.train.step import batch_sharding, make_mesh, state_shardings


def _one_device_and_sharded(cfg, seed):
    """(reference (loss, metrics), grads on one device; the step compiled for a 4-device data mesh; its arguments)."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    mesh = make_mesh(jax.devices()[:4], expert_parallel=1)
    graphdef, params, extra = nnx.split(DeepSeekModel(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    rng = np.random.default_rng(seed)
    batch = {name: jnp.asarray(rng.integers(0, cfg.vocab_size, (8, cfg.max_seq_len)), jnp.int32)
             for name in ("inputs", "targets")}

    def loss_and_grads(params, extra, batch):
        return jax.value_and_grad(lambda p: lm_loss(nnx.merge(graphdef, p, extra), batch), has_aux=True)(params)

    reference = jax.jit(loss_and_grads)(params, extra, batch)
    args = (*jax.device_put((params, extra), state_shardings((params, extra), mesh)),
            jax.device_put(batch, batch_sharding(mesh)))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jax.jit(loss_and_grads).lower(*args).compile()
    return reference, compiled, args


def _assert_every_call_is_local(compiled, target: str, local_shape: str):
    """Each `target` FFI call in the compiled step takes one device's share (`local_shape`), not the global batch."""
    calls = [ln for ln in compiled.as_text().splitlines() if f'custom_call_target="{target}"' in ln]
    assert calls and all(local_shape in ln for ln in calls), calls[:1]


def _assert_grads_match(grads, ref_grads):
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("path", ["turbo", "dense_cf"])
def test_data_parallel_moe_runs_per_device_and_matches_one_device(path):
    cfg = micro_config(moe_path=path, dtype="float32", capacity_factor=1.0)
    ((ref_loss, ref_metrics), ref_grads), compiled, args = _one_device_and_sharded(cfg, seed=0)
    if path == "turbo":
        _assert_every_call_is_local(compiled, "turbo_moe_permute", f"[{8 // 4 * cfg.max_seq_len},{cfg.d_model}]")
    (loss, metrics), grads = compiled(*args)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    np.testing.assert_allclose(metrics["expert_load"], ref_metrics["expert_load"])
    np.testing.assert_allclose(metrics["dropped_fraction"], ref_metrics["dropped_fraction"], rtol=1e-6)
    _assert_grads_match(grads, ref_grads)


def test_the_router_kernel_runs_per_device_and_matches_one_device(monkeypatch):
    """The router_topk kernel (what GPUs run: `router.topk_kernel_here`; with the sequence load penalty): each device
    picks for its own sequences, not the whole global batch that XLA's partitioner would give a replicated FFI call,
    and the picks are the one-device ones."""
    from turbo_moe.model import router

    monkeypatch.setattr(router, "topk_kernel_here", lambda: True)
    recipe = router_recipe_with(monkeypatch, seq_load_penalty=0.1, seq_load_chunk=4, center_causal=True)
    cfg = micro_config(moe_path="turbo", dtype="float32", capacity_factor=1.0, router_recipe=recipe)
    ((ref_loss, ref_metrics), _), compiled, args = _one_device_and_sharded(cfg, seed=1)
    _assert_every_call_is_local(compiled, "turbo_moe_router_topk", f"f32[{8 // 4},{cfg.max_seq_len},{cfg.n_experts}]")
    (loss, metrics), _ = compiled(*args)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    np.testing.assert_allclose(metrics["expert_load"], ref_metrics["expert_load"])


def test_the_segment_embedding_backward_sums_per_device_and_matches_one_device():
    """The embedding's segment-sum backward: each device sums its own tokens' rows (then one psum), instead of the FFI
    call that XLA's partitioner would run on the gathered global batch; the gradients are the one-device ones."""
    cfg = micro_config(moe_path="turbo", dtype="float32", capacity_factor=1.0)
    ((ref_loss, _), ref_grads), compiled, args = _one_device_and_sharded(cfg, seed=2)
    _assert_every_call_is_local(compiled, "turbo_moe_segment_sum", f"f32[{8 // 4 * cfg.max_seq_len},{cfg.d_model}]")
    (loss, _), grads = compiled(*args)
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    _assert_grads_match(grads, ref_grads)
