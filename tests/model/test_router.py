"""Group-limited sigmoid router vs a direct numpy implementation; balance loss; bias update; the router recipes
(`ModelConfig.router_recipe`) and the old fields they replaced; causal sequence centering of the selection
(`RouterRecipe.center_causal`); who picks the experts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.model.conftest import requires_turbo, router_recipe_with
from turbo_moe.model import DeepSeekModel, get_config, lm_loss
from turbo_moe.model import router as router_module
from turbo_moe.model.router import (Router, bias_rate_at, causal_centered_selection, route, sequence_balance_loss,
                                    updated_bias)


def numpy_route(scores, bias, top_k, n_groups, topk_groups, scale):
    """DeepSeek-V3 routing, one token at a time, written directly from the paper/reference code."""
    n_tokens, n_experts = scores.shape
    per_group = n_experts // n_groups
    ids = np.zeros((n_tokens, top_k), np.int64)
    weights = np.zeros((n_tokens, top_k), np.float64)
    for t in range(n_tokens):
        biased = scores[t] + bias
        group_score = [np.sort(biased[g * per_group:(g + 1) * per_group])[::-1][:min(2, per_group)].sum()
                       for g in range(n_groups)]
        kept_groups = np.argsort(-np.array(group_score), kind="stable")[:topk_groups]
        candidates = [e for e in range(n_experts) if e // per_group in kept_groups]
        best = sorted(candidates, key=lambda e: (-biased[e], e))[:top_k]
        ids[t] = best
        picked = scores[t, best]
        weights[t] = picked / picked.sum() * scale
    return ids, weights


@pytest.mark.parametrize("n_experts, n_groups, topk_groups, top_k", [(16, 4, 2, 3), (8, 8, 3, 2), (12, 1, 1, 4)])
def test_group_limited_router_matches_numpy(n_experts, n_groups, topk_groups, top_k):
    cfg = get_config("tiny", n_experts=n_experts, n_groups=n_groups, topk_groups=topk_groups, top_k=top_k,
                     routed_scaling_factor=2.5)
    rng = np.random.default_rng(n_experts + top_k)
    scores = rng.uniform(size=(64, n_experts)).astype(np.float32)
    bias = rng.normal(scale=0.2, size=(n_experts,)).astype(np.float32)
    out = route(jnp.asarray(scores), jnp.asarray(bias), cfg)
    ids, weights = numpy_route(scores, bias, top_k, n_groups, topk_groups, 2.5)
    np.testing.assert_array_equal(np.asarray(out.expert_ids), ids)
    np.testing.assert_allclose(np.asarray(out.weights), weights, rtol=1e-5)
    # The bias steers selection only: weights built from biased scores would differ.
    biased_picked = np.take_along_axis(scores + bias, ids, 1)
    assert not np.allclose(np.asarray(out.weights), biased_picked / biased_picked.sum(1, keepdims=True) * 2.5)


def test_group_limit_excludes_experts_outside_the_best_groups():
    cfg = get_config("tiny", n_experts=8, n_groups=4, topk_groups=1, top_k=2)
    # Expert 0 is the single best expert, but group 3 (experts 6, 7) has the best pair sum.
    scores = jnp.array([[0.99, 0.0, 0.1, 0.1, 0.2, 0.2, 0.9, 0.9]], jnp.float32)
    out = route(scores, jnp.zeros(8), cfg)
    assert sorted(np.asarray(out.expert_ids)[0].tolist()) == [6, 7]


def test_balance_loss_is_one_when_uniform_and_larger_when_skewed():
    b, s, e, k = 2, 8, 4, 2
    uniform_scores = jnp.full((b, s, e), 0.5)
    cyclic_ids = jnp.stack([jnp.arange(b * s) % e, (jnp.arange(b * s) + 1) % e], -1).reshape(b, s, k)
    np.testing.assert_allclose(sequence_balance_loss(uniform_scores, cyclic_ids, e), 1.0, rtol=1e-6)
    skewed_scores = jnp.tile(jnp.array([0.9, 0.9, 0.1, 0.1]), (b, s, 1))
    skewed_ids = jnp.tile(jnp.array([0, 1]), (b, s, 1))
    assert float(sequence_balance_loss(skewed_scores, skewed_ids, e)) > 1.5


def test_bias_update_reduces_imbalance_on_skewed_router():
    cfg = get_config("tiny", n_experts=8, n_groups=1, topk_groups=1, top_k=2)
    router = Router(cfg, nnx.Rngs(0))
    # Diverse tokens, plus a constant feature that pushes experts 0 and 1 far up for every token.
    tokens = jax.random.normal(jax.random.key(1), (512, cfg.d_model)).at[:, 0].set(1.0)
    kernel = np.asarray(jax.random.normal(jax.random.key(2), (cfg.d_model, cfg.n_experts))) * 0.1
    kernel[0, :2] = 3.0
    router.kernel[...] = jnp.asarray(kernel, jnp.float32)

    scores = router(tokens).scores  # (T, E); the bias changes the selection, never the scores
    load_for = jax.jit(lambda bias: jnp.bincount(route(scores, bias, cfg).expert_ids.reshape(-1),
                                                 length=cfg.n_experts))
    bias = router.bias[...]
    load = load_for(bias)
    start = float(load.max() / load.mean())
    for _ in range(200):
        bias = updated_bias(bias, load, 0.01)
        load = load_for(bias)
    end = float(load.max() / load.mean())
    assert start > 3.0
    assert end < 1.5, (start, end)


def test_bias_rate_is_router_bias_rate_at_every_step():
    """DeepSeek-V3's one constant rate (the schedule lost its A/B), also for a traced step."""
    cfg = get_config("tiny", router_bias_rate=1e-3)
    for step in (0, 7, 10_000):
        np.testing.assert_allclose(bias_rate_at(cfg, step), 1e-3, rtol=1e-6)
    rates = np.asarray(jax.jit(jax.vmap(lambda s: bias_rate_at(cfg.replace(router_bias_rate=2e-2), s)))(
        jnp.arange(0, 301, dtype=jnp.int32)))
    np.testing.assert_allclose(rates, 2e-2, rtol=1e-6)


def test_the_gate_kernel_is_initialised_with_init_std():
    cfg = get_config("tiny", d_model=256, n_experts=64, n_groups=8, topk_groups=4, top_k=6, init_std=0.006)
    kernel = np.asarray(Router(cfg, nnx.Rngs(0)).kernel[...])
    assert abs(kernel.std() / 0.006 - 1) < 0.03, kernel.std()


def test_proportional_bias_update_moves_by_the_relative_load_gap():
    bias = jnp.zeros((2, 4))
    load = jnp.array([[10.0, 0.0, 2.0, 4.0], [4.0, 4.0, 4.0, 4.0]])  # means 4 and 4
    np.testing.assert_allclose(updated_bias(bias, load, 0.1, "proportional"),
                               [[-0.15, 0.1, 0.05, 0.0], [0, 0, 0, 0]], atol=1e-7)
    np.testing.assert_allclose(updated_bias(bias, load, 0.1, "sign"), [[-0.1, 0.1, 0.1, 0.0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="rule"):
        updated_bias(bias, load, 0.1, "signum")


def test_proportional_update_undoes_a_large_level_gap_in_a_few_steps():
    """One expert sits far above the rest for every token (the warm-up collapse, docs/notes/routing.md):
    the sign rule covers the gap at `rate` per step, the proportional rule at rate * (load/mean - 1)."""
    cfg = get_config("tiny", n_experts=16, n_groups=1, topk_groups=1, top_k=2)
    noise = jax.random.normal(jax.random.key(0), (512, 16)) * 0.05
    scores = jax.nn.sigmoid(noise.at[:, 3].add(1.5))  # (T, E); expert 3 is 0.3 above the others

    def ratio_after(rule, steps=10):
        bias = jnp.zeros(16)
        for _ in range(steps):
            load = jnp.bincount(route(scores, bias, cfg).expert_ids.reshape(-1), length=16).astype(jnp.float32)
            bias = updated_bias(bias, load, 1e-2, rule)
        load = jnp.bincount(route(scores, bias, cfg).expert_ids.reshape(-1), length=16)
        return float(load.max() / load.mean())

    assert ratio_after("sign") > 6.0
    assert ratio_after("proportional") < 2.0


def test_router_lr_scale_keeps_the_gate_and_scales_its_adam_steps(monkeypatch):
    import optax

    cfg = get_config("tiny", init_std=0.02)
    slow = cfg.replace(router_recipe=router_recipe_with(monkeypatch, lr_scale=0.1))
    a, b = Router(cfg, nnx.Rngs(0)), Router(slow, nnx.Rngs(0))
    np.testing.assert_allclose(a.gate(), b.gate(), rtol=1e-6)  # same effective init
    x = jax.random.normal(jax.random.key(1), (16, cfg.d_model))
    np.testing.assert_allclose(a(x).scores, b(x).scores, rtol=1e-5)
    moved = []
    for router in (a, b):  # one Adam step on a loss of the scores: the gate moves ~lr * scale per element
        graphdef, params, rest = nnx.split(router, nnx.Param, ...)
        loss = lambda p: nnx.merge(graphdef, p, rest)(x).scores[:, 0].sum()
        tx = optax.adam(1e-3)
        updates, _ = tx.update(jax.grad(loss)(params), tx.init(params), params)
        new = nnx.merge(graphdef, optax.apply_updates(params, updates), rest)
        moved.append(float(jnp.abs(new.gate() - router.gate()).max()))
    np.testing.assert_allclose(moved, [1e-3, 1e-4], rtol=1e-3)


def test_the_recipes_and_the_presets():
    short_run = get_config("reduced").router
    assert get_config("reduced").router_recipe == "short_run"
    assert (short_run.head_bias, short_run.zero_init_out_proj, short_run.lr_scale, short_run.bias_update,
            short_run.center_causal, short_run.seq_load_penalty, short_run.seq_load_chunk) == (
        "unigram", True, 0.1, "proportional", True, 0.1, 128)
    for name in ("tiny", "small", "deepseek_v3_671b"):
        own = get_config(name).router
        assert get_config(name).router_recipe == "deepseek_v3"
        assert (own.head_bias, own.zero_init_out_proj, own.lr_scale, own.bias_update, own.center_causal,
                own.seq_load_penalty) == ("none", False, 1.0, "sign", False, 0.0)
    with pytest.raises(ValueError, match=r"ModelConfig\.router_recipe: got 'balanced'; expected one of "
                                         r"\('deepseek_v3', 'short_run'\)"):
        get_config("tiny", router_recipe="balanced")
    # the balance loss's weight: DeepSeek-V3's alpha in both recipes, so an old config's 1e-4 loads and another is
    # refused naming the field and the recipes
    for name in ("tiny", "reduced"):
        cfg = get_config(name)
        assert cfg.balance_loss_weight == cfg.router.balance_loss_weight == 1e-4
        assert get_config(name, balance_loss_weight=1e-4) == cfg
    with pytest.raises(ValueError, match=r"\['balance_loss_weight'\] were replaced by router_recipe"):
        get_config("tiny", balance_loss_weight=0.0)


# Every one of the seven fields the recipe replaced, at short_run's value, as an old record or spec holds them.
OLD_SHORT_RUN = dict(head_bias="unigram", zero_init_out_proj=True, router_lr_scale=0.1,
                     router_bias_update="proportional", router_center_causal=True, router_seq_load_penalty=0.1,
                     router_seq_load_chunk=128)
OLD_DEEPSEEK = dict(head_bias="none", zero_init_out_proj=False, router_lr_scale=1.0, router_bias_update="sign",
                    router_center_causal=False, router_seq_load_penalty=0.0, router_seq_load_chunk=128)


def test_old_router_fields_name_the_recipe_they_equal():
    from turbo_moe.model import ModelConfig

    reduced = get_config("reduced").to_dict()
    old = {k: v for k, v in reduced.items() if k != "router_recipe"}
    assert ModelConfig.from_dict({**old, **OLD_SHORT_RUN}) == get_config("reduced")
    assert ModelConfig.from_record({**old, **OLD_SHORT_RUN}) == get_config("reduced")
    assert ModelConfig.from_dict({**old, **OLD_DEEPSEEK}).router_recipe == "deepseek_v3"
    # as YAML or --set gives them (strings), one at a time over a preset, and with the recipe named too
    strings = {k: str(v) for k, v in OLD_SHORT_RUN.items()}
    assert ModelConfig.from_dict({**old, **strings}).router_recipe == "short_run"
    assert get_config("reduced", router_lr_scale=0.1).router_recipe == "short_run"
    assert get_config("tiny", router_recipe="short_run", head_bias="unigram").router_recipe == "short_run"
    assert get_config("tiny", **OLD_SHORT_RUN).router_recipe == "short_run"
    assert get_config("reduced").replace(**OLD_DEEPSEEK).router_recipe == "deepseek_v3"
    assert ModelConfig.from_yaml("preset: tiny\nhead_bias: unigram\nzero_init_out_proj: true\nrouter_lr_scale: 0.1\n"
                                 "router_bias_update: proportional\nrouter_center_causal: true\n"
                                 "router_seq_load_penalty: 0.1\n") == get_config("tiny", router_recipe="short_run")


@pytest.mark.parametrize("changed", [dict(router_center_causal=True), dict(head_bias="zero"),
                                     dict(router_lr_scale=0.1, router_bias_update="proportional")])
def test_other_old_router_combinations_are_refused_naming_the_fields_and_the_recipes(changed):
    from turbo_moe.model import ModelConfig

    fields = sorted(changed)
    pattern = (r"ModelConfig fields " + repr(fields).replace("[", r"\[").replace("]", r"\]")
               + r" were replaced by router_recipe.*on top of router_recipe 'deepseek_v3'.*the recipes are "
                 r"deepseek_v3: head_bias='none'.*; short_run: head_bias='unigram'")
    with pytest.raises(ValueError, match=pattern):
        get_config("tiny", **changed)
    # History is still read: the routing studies' records hold such combinations (that run ran with them, and its
    # record keeps the fields), read on top of the recipe they changed
    record = {k: v for k, v in get_config("tiny").to_dict().items() if k != "router_recipe"}
    assert ModelConfig.from_record({**record, **changed}) == get_config("tiny")


# ------------------------------------------------------------------ center_causal: top-k reads each token's
# gate logits minus the running mean of its own sequence so far; combine weights, gradients and the default unchanged

def _router(**overrides):
    cfg = get_config("tiny", **overrides)
    return cfg, Router(cfg, nnx.Rngs(0))


@pytest.fixture
def centered(monkeypatch):
    """A recipe with causal centering alone."""
    return router_recipe_with(monkeypatch, center_causal=True)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_center_causal_bad_value_names_the_field(value):
    with pytest.raises((ValueError, TypeError), match=r"ModelConfig\.router_center_causal"):
        get_config("tiny", router_center_causal=value)


def test_selection_is_the_logits_minus_their_causal_mean(centered):
    cfg, router = _router(router_recipe=centered)
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


def test_a_vector_shared_by_every_token_does_not_move_the_choice(centered):
    cfg, router = _router(router_recipe=centered)
    x = jax.random.normal(jax.random.key(2), (2, 32, cfg.d_model))
    shared = 5.0 * jax.random.normal(jax.random.key(3), (2, 1, cfg.d_model))  # one per sequence, large
    plain = np.asarray(router(x).expert_ids)
    shifted = np.asarray(router(x + shared).expert_ids)
    np.testing.assert_array_equal(plain, shifted)
    _, uncentered = _router()
    assert (np.asarray(uncentered(x).expert_ids) != np.asarray(uncentered(x + shared).expert_ids)).any(), \
        "without centering the shared vector must change some choice (else this test shows nothing)"


def test_causal_a_later_token_never_changes_an_earlier_choice(centered):
    cfg, router = _router(router_recipe=centered)
    x = jax.random.normal(jax.random.key(4), (1, 24, cfg.d_model))
    y = x.at[:, 12:].set(jax.random.normal(jax.random.key(5), (1, 12, cfg.d_model)))
    a, b = np.asarray(router(x).expert_ids), np.asarray(router(y).expert_ids)
    np.testing.assert_array_equal(a[:, :12], b[:, :12])
    assert (a[:, 12:] != b[:, 12:]).any()


def test_center_causal_needs_a_sequence_axis(centered):
    cfg, router = _router(router_recipe=centered)
    with pytest.raises(ValueError, match="causal centering needs the router input as"):
        router(jnp.ones((8, cfg.d_model)))


def test_the_model_with_center_causal_has_finite_nonzero_gradients(centered):
    """The whole model traces and differentiates with the (stop-gradient) centered choice."""
    cfg = get_config("tiny", router_recipe=centered, n_layers=2, mtp_depth=0, moe_path="ragged")  # one MoE layer
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(6), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((2, 16), jnp.float32)}
    grads = nnx.jit(nnx.grad(lambda m: lm_loss(m, batch)[0]))(model)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert leaves and all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert any(np.abs(np.asarray(g)).max() > 0 for g in leaves)


def test_center_causal_presets():
    assert get_config("reduced").router.center_causal  # the "short_run" recipe
    assert not get_config("deepseek_v3_671b").router.center_causal  # DeepSeek-V3's published router
    assert not get_config("tiny").router.center_causal


# ------------------------------------------------------------------ who picks the experts


@requires_turbo
def test_the_router_topk_kernel_picks_on_gpus_only(monkeypatch):
    """The device decides (both pick the same: tests/model/test_router_seq_load_penalty.py); the router calls the kernel
    exactly when `topk_kernel_here`."""
    assert router_module.topk_kernel_here() == (jax.default_backend() == "gpu")
    cfg, router = _router(n_experts=8, n_groups=1, topk_groups=1, top_k=2)
    x = jax.random.normal(jax.random.key(8), (2, 8, cfg.d_model))
    lowered = lambda: jax.jit(lambda v: router(v).expert_ids).lower(x).as_text()
    assert ("turbo_moe_router_topk" in lowered()) == (jax.default_backend() == "gpu")
    monkeypatch.setattr(router_module, "topk_kernel_here", lambda: True)
    assert "turbo_moe_router_topk" in lowered()
    monkeypatch.setattr(router_module, "topk_kernel_here", lambda: False)
    assert "turbo_moe_router_topk" not in lowered()
