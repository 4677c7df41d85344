"""ModelConfig.loss_chunk_tokens: the main and MTP cross-entropies through the head over chunks
of positions (`turbo_moe.model.chunked_loss`) equal the unchunked loss and gradients within float32
rounding (float32 compute), and within bf16 rounding with bf16 compute, where the head's backward matmuls
take dL/dlogits in bf16 (the unchunked path multiplies float32 dL/dlogits by upcast operands)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from turbo_moe.model import DeepSeekModel, get_config, lm_loss
from turbo_moe.model.chunked_loss import chunk_positions, chunked_cross_entropy
from turbo_moe.model.model import cross_entropy


def _head_problem(vocab_major, dtype=jnp.float32, b=2, s=7, d=16, v=50):
    keys = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(keys[0], (b, s, d), dtype)
    weight = jax.random.normal(keys[1], (v, d) if vocab_major else (d, v), jnp.float32) * 0.3
    targets = jax.random.randint(keys[2], (b, s), 0, v)
    mask = (jax.random.uniform(keys[3], (b, s)) > 0.25).astype(jnp.float32)
    return hidden, weight, targets, mask


def _unchunked(hidden, weight, targets, mask, vocab_major):
    eq = "bsd,vd->bsv" if vocab_major else "bsd,dv->bsv"
    logits = jnp.einsum(eq, hidden, weight.astype(hidden.dtype), preferred_element_type=jnp.float32)
    return cross_entropy(logits, targets, mask)


@pytest.mark.parametrize("vocab_major", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 6, 14, 1000])  # 1 position; 2 (pad 1); 3 (pad 2); all; more than all
def test_head_loss_and_grads_equal_the_unchunked_ones(vocab_major, chunk):
    hidden, weight, targets, mask = _head_problem(vocab_major)
    ref, (ref_dh, ref_dw) = jax.value_and_grad(_unchunked, argnums=(0, 1))(hidden, weight, targets, mask, vocab_major)
    chunked = lambda h, w: 0.7 * chunked_cross_entropy(h, w, targets, mask, chunk, vocab_major)  # a cotangent != 1
    loss, (dh, dw) = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(hidden, weight)
    np.testing.assert_allclose(loss, 0.7 * ref, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(chunked)(hidden, weight), loss, rtol=1e-6)  # the primal (no gradient)
    np.testing.assert_allclose(dh, 0.7 * ref_dh, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw, 0.7 * ref_dw, rtol=1e-5, atol=1e-7)
    assert dh.dtype == hidden.dtype and dw.dtype == weight.dtype


@pytest.mark.parametrize("vocab_major", [False, True])
def test_bf16_logits_equal_the_unchunked_loss_of_rounded_logits(vocab_major):
    """logits_dtype="bfloat16": the head GEMM's output rounded to bf16, then float32 math: the unchunked loss of the
    rounded logits and its autodiff gradients (the rounding passes the gradient through), not the float32 ones."""
    hidden, weight, targets, mask = _head_problem(vocab_major, v=300)
    eq = "bsd,vd->bsv" if vocab_major else "bsd,dv->bsv"

    def rounded(h, w):
        logits = jnp.einsum(eq, h, w, preferred_element_type=jnp.float32)
        # the rounded values, the gradient straight through in float32 (autodiff of astype would round it too)
        logits = logits + jax.lax.stop_gradient(logits.astype(jnp.bfloat16).astype(jnp.float32) - logits)
        return cross_entropy(logits, targets, mask)

    ref, (ref_dh, ref_dw) = jax.value_and_grad(rounded, argnums=(0, 1))(hidden, weight)
    chunked = lambda h, w: chunked_cross_entropy(h, w, targets, mask, 6, vocab_major, logits_dtype="bfloat16")
    loss, (dh, dw) = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(hidden, weight)
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    np.testing.assert_allclose(dh, ref_dh, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw, ref_dw, rtol=1e-5, atol=1e-7)
    exact = chunked_cross_entropy(hidden, weight, targets, mask, 6, vocab_major)
    assert loss != exact and abs(loss - exact) < 1e-2 * exact  # rounded, by bf16's few parts in a thousand


def test_layout_and_bad_arguments():
    assert chunk_positions(2, 7, 5) == (2, 4) and chunk_positions(2, 7, 1) == (1, 7)
    assert chunk_positions(2, 7, 1000) == (7, 1) and chunk_positions(8, 2048, 4096) == (512, 4)
    hidden, weight, targets, mask = _head_problem(False)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="chunk_tokens must be a positive int"):
            chunked_cross_entropy(hidden, weight, targets, mask, bad)
    with pytest.raises(ValueError, match=r"weight \(16, 50\) does not match"):
        chunked_cross_entropy(hidden, weight, targets, mask, 4, vocab_major=True)
    with pytest.raises(ValueError, match="logits_dtype must be 'float32' or 'bfloat16', got 'float16'"):
        chunked_cross_entropy(hidden, weight, targets, mask, 4, logits_dtype="float16")
    with pytest.raises(ValueError, match=r"ModelConfig.logits_dtype: got 'float16'; expected one of"):
        get_config("tiny", logits_dtype="float16")
    with pytest.raises(ValueError, match="ModelConfig.loss_chunk_tokens: must be a non-negative int, got -1"):
        get_config("tiny", loss_chunk_tokens=-1)
    # the GPU-sized presets chunk the loss with bf16 logits (decided: docs/performance.md); the CPU ones do not
    for name in ("reduced", "deepseek_v3_671b"):
        assert (get_config(name).loss_chunk_tokens, get_config(name).logits_dtype) == (4096, "bfloat16")
    for name in ("tiny", "small"):
        assert (get_config(name).loss_chunk_tokens, get_config(name).logits_dtype) == (0, "float32")


def test_batch_sharded_over_devices_gives_the_same_loss_and_grads():
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    hidden, weight, targets, mask = _head_problem(False, b=4, s=6)
    fn = jax.jit(jax.value_and_grad(lambda h, w, t, m: chunked_cross_entropy(h, w, t, m, 8), argnums=(0, 1)))
    ref, ref_grads = fn(hidden, weight, targets, mask)
    rows = NamedSharding(jax.sharding.Mesh(np.asarray(jax.devices()[:4]), ("data",)), P("data"))
    loss, grads = fn(jax.device_put(hidden, rows), weight, jax.device_put(targets, rows), jax.device_put(mask, rows))
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


def _model_loss_and_grads(cfg, batch):
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    (loss, metrics), grads = nnx.jit(nnx.value_and_grad(lm_loss, has_aux=True))(model, batch)
    return loss, metrics, nnx.to_flat_state(grads)


def _batch(cfg, b=2, s=16):
    tokens = jax.random.randint(jax.random.key(1), (b, s + 1), 0, cfg.vocab_size)
    mask = (jax.random.uniform(jax.random.key(2), (b, s)) > 0.2).astype(jnp.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


@pytest.mark.parametrize("dtype, rel, logits_dtype", [
    ("float32", 2e-5, "float32"),
    ("bfloat16", 4e-2, "float32"),  # bf16 dL/dlogits in the head's backward (module doc): bf16 rounding
    ("bfloat16", 4e-2, "bfloat16"),  # both paths round the logits
])
def test_model_loss_and_grads_match_unchunked(dtype, rel, logits_dtype):
    # main head + one MTP head; 2 x 16 tokens in chunks of 5 positions (10 tokens): 4 chunks, the last padded
    cfg = get_config("tiny", n_layers=2, max_seq_len=16, moe_path="ragged", dtype=dtype, logits_dtype=logits_dtype)
    batch = _batch(cfg)
    loss, metrics, grads = _model_loss_and_grads(cfg, batch)
    c_loss, c_metrics, c_grads = _model_loss_and_grads(cfg.replace(loss_chunk_tokens=10), batch)
    # bf16 logits: XLA:CPU's bf16-output dots of the two shapes need not round at the same place
    loss_rtol = 1e-6 if logits_dtype == "float32" else 1e-3
    for name in ("loss", "ce_loss", "mtp_loss"):
        np.testing.assert_allclose(c_metrics[name], metrics[name], rtol=loss_rtol, err_msg=name)
    np.testing.assert_array_equal(c_metrics["expert_load"], metrics["expert_load"])
    for (name, g), (c_name, c) in zip(grads, c_grads):
        assert name == c_name and c[...].dtype == g[...].dtype
        scale = float(jnp.max(jnp.abs(g[...])))  # leaf scale: tolerance relative to the largest entry
        np.testing.assert_allclose(c[...], g[...], rtol=rel, atol=rel * scale, err_msg=str(name))


def test_model_call_still_returns_logits():
    cfg = get_config("tiny", n_layers=2, max_seq_len=16, moe_path="ragged", loss_chunk_tokens=8)
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    inputs = _batch(cfg)["inputs"]
    out = model(inputs)
    assert out.logits.shape == (2, 16, cfg.vocab_size) and out.logits.dtype == jnp.float32
    assert out.mtp_logits[0].shape == (2, 16, cfg.vocab_size)
    hidden = model(inputs, apply_head=False)
    assert hidden.logits.shape == (2, 16, cfg.d_model) and hidden.logits.dtype == jnp.bfloat16
    np.testing.assert_array_equal(model.logits(hidden.logits), out.logits)


def test_no_whole_batch_logits_in_the_compiled_step():
    def compiled_text(cfg):
        graphdef, params, extra = nnx.split(DeepSeekModel(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
        step = jax.value_and_grad(lambda p, b: lm_loss(nnx.merge(graphdef, p, extra), b), has_aux=True)
        return jax.jit(step).lower(params, _batch(cfg)).compile().as_text()

    cfg = get_config("tiny", n_layers=2, max_seq_len=16, moe_path="ragged", vocab_size=300)
    assert "f32[2,16,300]" in compiled_text(cfg)  # (B, S, V) float32 logits
    chunked = compiled_text(cfg.replace(loss_chunk_tokens=10))
    assert "f32[2,16,300]" not in chunked and "f32[2,5,300]" in chunked  # one chunk's (B, 5, V)


def test_one_pass_logsumexp_matches_two_pass():
    from turbo_moe.model.chunked_loss import _logsumexp

    logits = jax.random.normal(jax.random.key(3), (3, 5, 1000), jnp.float32) * 30.0
    logits = logits.at[0].add(1e4).at[1, :, 7:].set(-jnp.inf)  # large offsets; rows masked down to 7 entries
    logits = logits.at[2, 0].set(-jnp.inf)  # a row of nothing: -inf, not nan
    got, want = jax.jit(_logsumexp)(logits), jax.nn.logsumexp(logits, axis=-1)
    assert got.shape == (3, 5) and got[2, 0] == -jnp.inf and not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=2e-6)
