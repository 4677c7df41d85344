"""ModelConfig.router_center_causal (issue 13, part 7): top-k reads each token's gate logits minus the
running mean of its own sequence so far; combine weights, gradients and the default are unchanged."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from turbo_moe.model import DeepSeekModel, get_config, lm_loss
from turbo_moe.model.router import Router, causal_centered_selection, route


def _router(**overrides):
    cfg = get_config("tiny", **overrides)
    return cfg, Router(cfg, nnx.Rngs(0))


@pytest.mark.parametrize("value", [1, "yes", None])
def test_bad_value_names_the_field(value):
    with pytest.raises((ValueError, TypeError), match=r"ModelConfig\.router_center_causal"):
        get_config("tiny", router_center_causal=value)


def test_cannot_combine_with_the_running_mean():
    with pytest.raises(ValueError, match=r"router_center_causal.*router_center_ema"):
        get_config("tiny", router_center_causal=True, router_center_ema=0.3)


def test_selection_is_the_logits_minus_their_causal_mean():
    cfg, router = _router(router_center_causal=True)
    x = jax.random.normal(jax.random.key(1), (3, 16, cfg.d_model))
    logits = np.asarray(x, np.float64) @ np.asarray(router.gate(), np.float64)  # (B, S, E)
    mean = np.cumsum(logits, axis=1) / np.arange(1, 17)[None, :, None]
    expect = 1 / (1 + np.exp(-(logits - mean)))
    np.testing.assert_allclose(np.asarray(causal_centered_selection(jnp.asarray(logits, jnp.float32))), expect,
                               atol=1e-6)
    out = router(x)
    ref = route(jax.nn.sigmoid(x @ router.gate()), router.bias[...], cfg, jnp.asarray(expect, jnp.float32))
    np.testing.assert_array_equal(np.asarray(out.expert_ids), np.asarray(ref.expert_ids))
    # the combine weights are the picked raw scores, as without centering
    np.testing.assert_allclose(np.asarray(out.weights), np.asarray(ref.weights), rtol=1e-6)


def test_a_vector_shared_by_every_token_does_not_move_the_choice():
    cfg, router = _router(router_center_causal=True)
    x = jax.random.normal(jax.random.key(2), (2, 32, cfg.d_model))
    shared = 5.0 * jax.random.normal(jax.random.key(3), (2, 1, cfg.d_model))  # one per sequence, large
    plain = np.asarray(router(x).expert_ids)
    shifted = np.asarray(router(x + shared).expert_ids)
    np.testing.assert_array_equal(plain, shifted)
    _, uncentered = _router()
    assert (np.asarray(uncentered(x).expert_ids) != np.asarray(uncentered(x + shared).expert_ids)).any(), \
        "without centering the shared vector must change some choice (else this test shows nothing)"


def test_causal_a_later_token_never_changes_an_earlier_choice():
    cfg, router = _router(router_center_causal=True)
    x = jax.random.normal(jax.random.key(4), (1, 24, cfg.d_model))
    y = x.at[:, 12:].set(jax.random.normal(jax.random.key(5), (1, 12, cfg.d_model)))
    a, b = np.asarray(router(x).expert_ids), np.asarray(router(y).expert_ids)
    np.testing.assert_array_equal(a[:, :12], b[:, :12])
    assert (a[:, 12:] != b[:, 12:]).any()


def test_needs_a_sequence_axis():
    cfg, router = _router(router_center_causal=True)
    with pytest.raises(ValueError, match="router_center_causal needs"):
        router(jnp.ones((8, cfg.d_model)))


def test_the_model_with_it_has_finite_nonzero_gradients():
    """The whole model traces and differentiates with the (stop-gradient) centered choice."""
    cfg = get_config("tiny", router_center_causal=True, n_layers=2, mtp_depth=0)  # one MoE layer: CI time
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(6), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((2, 16), jnp.float32)}
    grads = nnx.jit(nnx.grad(lambda m: lm_loss(m, batch)[0]))(model)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert leaves and all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert any(np.abs(np.asarray(g)).max() > 0 for g in leaves)


def test_the_reduced_preset_uses_it_and_deepseek_width_does_not():
    assert get_config("reduced").router_center_causal  # the issue-13 routing recipe (NOTES part 8)
    assert not get_config("deepseek_v3_671b").router_center_causal  # DeepSeek-V3's published router
    assert not get_config("tiny").router_center_causal
