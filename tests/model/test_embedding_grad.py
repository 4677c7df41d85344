"""ModelConfig.embedding_grad: the token embedding's backward as a chunked one-hot matmul ("matmul") or a sorted segment
sum ("segment", turbo_moe.ops.segment_sum) instead of XLA's scatter-add ("scatter"): the same gradient (to float32
rounding; closer to float64 than the scatter's bf16 accumulation), the same model loss and gradients, and a clear
error for a bad value."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from turbo_moe.model import DeepSeekModel, get_config, lm_loss
from turbo_moe.model import embedding


def _grad(table, ids, g, method):
    return jax.jit(jax.grad(lambda t: jnp.sum(embedding.lookup(t, ids, method).astype(jnp.float32) * g)))(table)


@pytest.mark.parametrize("shape", [(7,), (3, 50), (2, 4100)])  # one chunk, batch dims, a padded second chunk
@pytest.mark.parametrize("method", ["matmul", "segment"])
def test_backward_equals_the_scatter_in_float32(shape, method):
    rng = np.random.default_rng(sum(shape))
    vocab, d = 97, 16
    ids = jnp.asarray(np.minimum(rng.zipf(1.3, shape) - 1, vocab - 1), jnp.int32)  # many repeats
    table = jnp.asarray(rng.standard_normal((vocab, d)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((*shape, d)), jnp.float32)
    np.testing.assert_allclose(embedding.lookup(table, ids, method), table[ids])
    np.testing.assert_allclose(_grad(table, ids, g, method), _grad(table, ids, g, "scatter"), rtol=1e-4, atol=1e-4)


def test_matmul_and_segment_backwards_accumulate_bfloat16_rows_in_float32():
    rng = np.random.default_rng(0)
    ids = jnp.zeros((3000,), jnp.int32).at[::7].set(3)  # one row receives 2571 updates
    table = jnp.zeros((8, 4), jnp.bfloat16)
    g = rng.uniform(0.5, 1.5, (3000, 4))
    expect = np.zeros((8, 4))
    np.add.at(expect, np.asarray(ids), np.asarray(jnp.asarray(g, jnp.bfloat16), np.float64))
    err = {m: np.abs(np.asarray(_grad(table, ids, jnp.asarray(g, jnp.bfloat16).astype(jnp.float32), m), np.float64)
                     - expect).max() / np.abs(expect).max() for m in embedding.EMBEDDING_GRADS}
    for method in ("matmul", "segment"):
        assert err[method] <= 4e-3, err  # one bf16 rounding of the float32 sum
        assert err[method] <= err["scatter"], err


def test_the_model_gives_the_same_loss_and_gradients():
    out = {}
    for method in embedding.EMBEDDING_GRADS:
        cfg = get_config("tiny", embedding_grad=method, dtype="float32")
        graphdef, state = nnx.split(DeepSeekModel(cfg, rngs=nnx.Rngs(0)))
        tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, cfg.vocab_size)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        out[method] = jax.jit(jax.value_and_grad(lambda s: lm_loss(nnx.merge(graphdef, s), batch)[0]))(state)
    for method in ("matmul", "segment"):
        np.testing.assert_allclose(out[method][0], out["scatter"][0], rtol=1e-6)
        for a, b in zip(jax.tree.leaves(out[method][1]), jax.tree.leaves(out["scatter"][1])):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_bad_value_names_the_field():
    with pytest.raises(ValueError, match=r"ModelConfig\.embedding_grad.*'scatter', 'matmul'"):
        get_config("tiny", embedding_grad="dense")
    with pytest.raises(ValueError, match="embedding grad"):
        embedding.lookup(jnp.zeros((4, 2)), jnp.zeros((3,), jnp.int32), "dense")


def test_presets_take_the_segment_sum():
    # tokens x D whatever V and the ids: fastest at every width measured (NOTES, issue 14, calls 61-63)
    assert {get_config(name).embedding_grad for name in ("tiny", "small", "reduced", "deepseek_v3_671b")} == {"segment"}
