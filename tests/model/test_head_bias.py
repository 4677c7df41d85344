"""ModelConfig.head_bias (issue 13): a float32 (V,) bias on the main and MTP logits, its gradient (plain and
chunked cross-entropy), the data's log unigram prior and how training sets it at init."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from turbo_moe.data import PackedSequences, SyntheticSequences, unigram_log_prior
from turbo_moe.model import DeepSeekModel, get_config, lm_loss
from turbo_moe.model.chunked_loss import chunked_cross_entropy
from turbo_moe.model.model import cross_entropy
from turbo_moe.train import TrainConfig, init_state, make_mesh, make_optimizer, with_head_bias


def _model(**overrides):
    cfg = get_config("tiny", n_layers=2, max_seq_len=16, moe_path="ragged", dtype="float32", **overrides)
    return DeepSeekModel(cfg, rngs=nnx.Rngs(0))


def _batch(vocab, b=2, s=16):
    tokens = jax.random.randint(jax.random.key(1), (b, s + 1), 0, vocab)
    mask = (jax.random.uniform(jax.random.key(2), (b, s)) > 0.2).astype(jnp.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _random_bias(vocab):
    return jax.random.normal(jax.random.key(3), (vocab,), jnp.float32) * 2.0


def test_config_choices():
    assert all(get_config(name).head_bias == "none" for name in ("tiny", "small", "deepseek_v3_671b"))
    assert get_config("reduced").head_bias == "unigram"  # the issue-13 routing recipe
    with pytest.raises(ValueError, match=r"ModelConfig.head_bias: got 'yes'; expected one of \('none', 'zero', 'unigram'\)"):
        get_config("tiny", head_bias="yes")


def test_bias_adds_to_main_and_mtp_logits_and_changes_nothing_else():
    plain, biased = _model(), _model(head_bias="zero")
    assert plain.head_bias is None and "head_bias" not in nnx.state(plain, nnx.Param)
    # the bias draws no random numbers: every other parameter is the plain model's
    flat = dict(nnx.to_flat_state(nnx.state(biased, nnx.Param)))
    for name, leaf in nnx.to_flat_state(nnx.state(plain, nnx.Param)):
        np.testing.assert_array_equal(flat[name][...], leaf[...], err_msg=str(name))
    bias = _random_bias(plain.cfg.vocab_size)
    biased.head_bias[...] = bias
    inputs = _batch(plain.cfg.vocab_size)["inputs"]
    out, out_b = plain(inputs), biased(inputs)
    np.testing.assert_allclose(out_b.logits, out.logits + bias, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out_b.mtp_logits[0], out.mtp_logits[0] + bias, rtol=1e-6, atol=1e-6)


def test_bias_gradient_is_the_mean_softmax_minus_onehot():
    model = _model(head_bias="zero", mtp_depth=0, balance_loss_weight=0.0)
    model.head_bias[...] = _random_bias(model.cfg.vocab_size)
    batch = _batch(model.cfg.vocab_size)
    grads = nnx.grad(lambda m: lm_loss(m, batch)[0])(model)
    probs = jax.nn.softmax(model(batch["inputs"]).logits, axis=-1)
    onehot = jax.nn.one_hot(batch["targets"], model.cfg.vocab_size)
    mask = batch["mask"][..., None]
    expected = jnp.sum((probs - onehot) * mask, axis=(0, 1)) / jnp.sum(mask)
    np.testing.assert_allclose(grads.head_bias[...], expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("vocab_major", [False, True])
@pytest.mark.parametrize("chunk", [1, 6, 1000])
def test_chunked_loss_with_bias_matches_unchunked(vocab_major, chunk):
    keys = jax.random.split(jax.random.key(0), 4)
    b, s, d, v = 2, 7, 16, 50
    hidden = jax.random.normal(keys[0], (b, s, d))
    weight = jax.random.normal(keys[1], (v, d) if vocab_major else (d, v)) * 0.3
    targets = jax.random.randint(keys[2], (b, s), 0, v)
    mask = (jax.random.uniform(keys[3], (b, s)) > 0.25).astype(jnp.float32)
    bias = _random_bias(v)
    eq = "bsd,vd->bsv" if vocab_major else "bsd,dv->bsv"
    reference = lambda h, w, c: cross_entropy(jnp.einsum(eq, h, w) + c, targets, mask)
    chunked = lambda h, w, c: 0.7 * chunked_cross_entropy(h, w, targets, mask, chunk, vocab_major, bias=c)
    ref, ref_grads = jax.value_and_grad(reference, argnums=(0, 1, 2))(hidden, weight, bias)
    loss, grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1, 2)))(hidden, weight, bias)
    np.testing.assert_allclose(loss, 0.7 * ref, rtol=1e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, 0.7 * r, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"bias must be float32 \(50,\)"):
        chunked_cross_entropy(hidden, weight, targets, mask, chunk, vocab_major, bias=bias[:-1])
    with pytest.raises(ValueError, match=r"bias must be float32 \(50,\)"):
        chunked_cross_entropy(hidden, weight, targets, mask, chunk, vocab_major, bias=bias.astype(jnp.bfloat16))


@pytest.mark.parametrize("tie", [False, True])
def test_model_chunked_loss_with_bias_matches_unchunked(tie):
    model = _model(head_bias="zero", tie_embeddings=tie)
    model.head_bias[...] = _random_bias(model.cfg.vocab_size)
    batch = _batch(model.cfg.vocab_size)
    graphdef, params, extra = nnx.split(model, nnx.Param, ...)
    chunked_def = nnx.split(_model(head_bias="zero", tie_embeddings=tie, loss_chunk_tokens=10), nnx.Param, ...)[0]

    def loss_and_grads(gdef):
        fn = lambda p: lm_loss(nnx.merge(gdef, p, extra), batch)[0]
        return jax.jit(jax.value_and_grad(fn))(params)

    loss, grads = loss_and_grads(graphdef)
    c_loss, c_grads = loss_and_grads(chunked_def)
    np.testing.assert_allclose(c_loss, loss, rtol=1e-6)
    for (name, g), (_, c) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(c_grads)):
        scale = float(jnp.max(jnp.abs(g[...])))
        np.testing.assert_allclose(c[...], g[...], rtol=2e-5, atol=2e-5 * scale, err_msg=str(name))
    assert float(jnp.max(jnp.abs(c_grads["head_bias"][...]))) > 0


def test_unigram_log_prior():
    windows = np.array([[0, 1, 1, 3], [2, 1, 3, 3]], np.uint16)  # targets: 1 1 3 / 1 3 3 (the first is an input)
    prior = unigram_log_prior(PackedSequences(windows, seq_len=3), vocab_size=5)
    counts = np.array([0, 3, 0, 3, 0]) + 1.0
    np.testing.assert_allclose(prior, np.log(counts / counts.sum()), rtol=1e-6)
    assert prior.dtype == np.float32
    np.testing.assert_array_equal(unigram_log_prior(SyntheticSequences(5, 3), 5), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="vocab_size=3 but the data holds token id 3"):
        unigram_log_prior(PackedSequences(windows, seq_len=3), vocab_size=3)
    with pytest.raises(TypeError, match="source must be PackedSequences"):
        unigram_log_prior(windows, vocab_size=5)


@pytest.mark.parametrize("n_devices", [1, 4])
def test_with_head_bias_sets_values_in_any_layout(n_devices):
    if jax.device_count() < n_devices:
        pytest.skip(f"needs {n_devices} devices")
    cfg = get_config("tiny", head_bias="unigram")
    tx = make_optimizer(TrainConfig(model="tiny", steps=2, warmup_steps=1))
    mesh = make_mesh(jax.devices()[:n_devices])
    _, state = init_state(cfg, tx, 0, mesh)
    values = np.linspace(-9.0, -1.0, cfg.vocab_size, dtype=np.float32)
    new = with_head_bias(state, values)
    np.testing.assert_array_equal(np.asarray(new.params["head_bias"][...]), values)
    assert new.params["head_bias"][...].sharding == state.params["head_bias"][...].sharding
    np.testing.assert_array_equal(np.asarray(state.params["head_bias"][...]), 0.0)  # the old state is unchanged
    np.testing.assert_array_equal(new.params["head"]["kernel"][...], state.params["head"]["kernel"][...])
    with pytest.raises(ValueError, match=r"shape \(3,\) != the head's vocabulary \(256,\)"):
        with_head_bias(state, values[:3])
    _, plain = init_state(cfg.replace(head_bias="none"), tx, 0, mesh)
    with pytest.raises(ValueError, match="head_bias is 'none'"):
        with_head_bias(plain, values)
