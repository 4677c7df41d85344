"""The token embedding's backward (`turbo_moe.model.embedding.lookup`): a sorted segment sum
(turbo_moe.ops.segment_sum) instead of XLA's scatter-add (`jnp.take`'s own VJP, the reference here): the same gradient
(to float32 rounding; closer to float64 than the scatter's bf16 accumulation), and the same model loss and
gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.model.conftest import requires_turbo
from turbo_moe.model import DeepSeekModel, get_config, lm_loss
from turbo_moe.model import embedding
from turbo_moe.model import model as model_module

pytestmark = requires_turbo


def _scatter_lookup(table, ids):
    return jnp.take(table, ids, axis=0)


def _grad(table, ids, g, lookup=embedding.lookup):
    return jax.jit(jax.grad(lambda t: jnp.sum(lookup(t, ids).astype(jnp.float32) * g)))(table)


@pytest.mark.parametrize("shape", [(7,), (3, 50), (2, 4100)])  # a few ids, batch dims, many
def test_backward_equals_the_scatter_in_float32(shape):
    rng = np.random.default_rng(sum(shape))
    vocab, d = 97, 16
    ids = jnp.asarray(np.minimum(rng.zipf(1.3, shape) - 1, vocab - 1), jnp.int32)  # many repeats
    table = jnp.asarray(rng.standard_normal((vocab, d)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((*shape, d)), jnp.float32)
    np.testing.assert_allclose(embedding.lookup(table, ids), table[ids])
    np.testing.assert_allclose(_grad(table, ids, g), _grad(table, ids, g, _scatter_lookup), rtol=1e-4, atol=1e-4)


def test_backward_accumulates_bfloat16_rows_in_float32():
    rng = np.random.default_rng(0)
    ids = jnp.zeros((3000,), jnp.int32).at[::7].set(3)  # one row receives 2571 updates
    table = jnp.zeros((8, 4), jnp.bfloat16)
    g = rng.uniform(0.5, 1.5, (3000, 4))
    expect = np.zeros((8, 4))
    np.add.at(expect, np.asarray(ids), np.asarray(jnp.asarray(g, jnp.bfloat16), np.float64))
    g32 = jnp.asarray(g, jnp.bfloat16).astype(jnp.float32)
    err = {name: np.abs(np.asarray(_grad(table, ids, g32, lookup), np.float64) - expect).max() / np.abs(expect).max()
           for name, lookup in (("segment", embedding.lookup), ("scatter", _scatter_lookup))}
    assert err["segment"] <= 4e-3, err  # one bf16 rounding of the float32 sum
    assert err["segment"] <= err["scatter"], err


def test_the_model_gives_the_scatter_loss_and_gradients(monkeypatch):
    def loss_and_grads():
        cfg = get_config("tiny", dtype="float32", moe_path="ragged")
        graphdef, state = nnx.split(DeepSeekModel(cfg, rngs=nnx.Rngs(0)))
        tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.vocab_size)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        step = jax.jit(jax.value_and_grad(lambda s: lm_loss(nnx.merge(graphdef, s), batch)[0]))
        return step(state), step.lower(state).as_text()

    (loss, grads), text = loss_and_grads()
    assert "turbo_moe_segment_sum" in text  # the model's embedding (and the MTP block's lookup) take it
    monkeypatch.setattr(model_module, "lookup", _scatter_lookup)
    (ref_loss, ref_grads), ref_text = loss_and_grads()
    assert "turbo_moe_segment_sum" not in ref_text
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
