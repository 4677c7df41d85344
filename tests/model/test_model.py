"""DeepSeekModel end to end on micro configs: shapes, causality, path equivalence, remat, training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import ALL_PATHS, micro_config
from turbo_moe.model import DeepSeekModel, RouterBias, lm_loss, update_router_bias


def make_batch(cfg, batch=2, seq=16, seed=0):
    tokens = jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, cfg.vocab_size)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def loss_and_grads(model, batch):
    return nnx.jit(nnx.value_and_grad(lm_loss, has_aux=True))(model, batch)


def test_forward_shapes_load_and_causality():
    cfg = micro_config(dtype="float32")
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    inputs = make_batch(cfg)["inputs"]
    forward = nnx.jit(lambda m, x: m(x))
    out = forward(model, inputs)
    assert out.logits.shape == (2, 16, cfg.vocab_size) and out.logits.dtype == jnp.float32
    assert len(out.mtp_logits) == cfg.mtp_depth and out.mtp_logits[0].shape == out.logits.shape
    assert out.moe.expert_load.shape == (cfg.n_router_layers, cfg.n_experts) == (2, cfg.n_experts)
    np.testing.assert_array_equal(out.moe.expert_load.sum(-1), 2 * 16 * cfg.top_k)
    assert np.isfinite(np.asarray(out.logits)).all()

    changed = inputs.at[:, 10].set((inputs[:, 10] + 1) % cfg.vocab_size)
    a, b = out.logits, forward(model, changed).logits
    np.testing.assert_allclose(a[:, :10], b[:, :10], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 10:], b[:, 10:])


def path_results(path):
    cfg = micro_config(dtype="float32", moe_path=path, capacity_factor=8.0)  # cf = E: nothing drops
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))  # same seed and structure: same parameters for every path
    return loss_and_grads(model, make_batch(cfg))


@pytest.fixture(scope="module")
def ragged_results():
    return path_results("ragged")


@pytest.mark.parametrize("path", [p for p in ALL_PATHS if p != "ragged"])
def test_paths_give_same_loss_and_grads_for_same_params(path, ragged_results):
    (loss, metrics), grads = path_results(path)
    (ref_loss, ref_metrics), ref_grads = ragged_results
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert float(metrics["dropped_fraction"]) == 0.0
    np.testing.assert_array_equal(metrics["expert_load"], ref_metrics["expert_load"])
    flat, ref_flat = nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)
    for (name, g), (_, r) in zip(flat, ref_flat):
        np.testing.assert_allclose(g[...], r[...], rtol=2e-4, atol=1e-6, err_msg=f"{path}: {name}")


def test_remat_does_not_change_loss_or_grads(ragged_results):
    cfg = micro_config(dtype="float32", moe_path="ragged", capacity_factor=8.0, remat_policy="dots_no_batch")
    (loss, _), grads = loss_and_grads(DeepSeekModel(cfg, rngs=nnx.Rngs(0)), make_batch(cfg))
    (ref_loss, _), ref_grads = ragged_results
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def test_training_steps_reduce_loss_and_update_router_bias():
    cfg = micro_config(moe_path="dense_cf", capacity_factor=1.0)  # bfloat16 compute, float32 params
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
    # The router bias is not a parameter: the optimizer never sees it.
    assert not any(isinstance(v, RouterBias) for v in jax.tree.leaves(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    batch = make_batch(cfg)

    @nnx.jit
    def train_step(model, optimizer, batch):
        (loss, metrics), grads = nnx.value_and_grad(lm_loss, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return loss, metrics

    losses = []
    for _ in range(8):
        loss, metrics = train_step(model, optimizer, batch)
        update_router_bias(model, metrics["expert_load"])
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses
    assert 0.0 <= float(metrics["dropped_fraction"]) < 1.0
    biases = np.asarray(model.router_bias_table())
    assert biases.shape == (2, cfg.n_experts) and np.abs(biases).max() > 0


def test_bad_inputs_raise_clear_errors():
    cfg = micro_config()
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match="inputs"):
        model(jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(ValueError, match="expert_load"):
        update_router_bias(model, jnp.zeros((3, cfg.n_experts)))
    with pytest.raises(ValueError, match="targets"):
        lm_loss(model, {"inputs": jnp.zeros((1, 4), jnp.int32)})
