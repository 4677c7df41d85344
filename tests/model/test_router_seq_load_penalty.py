"""The router recipe's sequence load penalty (`RouterRecipe.seq_load_penalty`, on in "short_run"): a sequence runs
through top-k chunk by chunk, and a token's selection is lowered on the experts that the earlier chunks of its
sequence over-used; causal, stop-gradient, off in DeepSeek-V3's recipe."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.model.conftest import requires_turbo, router_recipe_with
from turbo_moe.model import DeepSeekModel, get_config, lm_loss
from turbo_moe.model.router import SEQ_LOAD_PRIOR_TOKENS, Router, route, seq_load_penalized_selection


def _router(**overrides):
    cfg = get_config("tiny", **overrides)
    return cfg, Router(cfg, nnx.Rngs(0))


def test_old_penalty_fields_name_their_recipe_or_are_refused():
    assert get_config("reduced", router_seq_load_penalty=0.1, router_seq_load_chunk=128).router_recipe == "short_run"
    assert get_config("tiny", router_seq_load_penalty=0.0, router_seq_load_chunk=64).router_recipe == "deepseek_v3"
    with pytest.raises(ValueError, match=r"\['router_seq_load_chunk'\] were replaced by router_recipe.*"
                                         r"short_run: .*router_seq_load_chunk=128"):
        get_config("reduced", router_seq_load_chunk=64)
    with pytest.raises(TypeError, match=r"ModelConfig\.router_seq_load_chunk expects int, got 2\.5"):
        get_config("tiny", router_seq_load_chunk=2.5)


def test_too_many_chunks_is_refused_naming_the_length():
    with pytest.raises(ValueError, match=r"ModelConfig\.max_seq_len: router_recipe 'short_run'.*8320 tokens make 65 "
                                         r"chunks, at most 64 \(max_seq_len <= 8192\)"):
        get_config("reduced", max_seq_len=8320)
    get_config("reduced", max_seq_len=8320, router_recipe="deepseek_v3")  # off: no loop, no limit


@pytest.mark.parametrize("chunk", [16, 7, 64])  # 40 tokens: padded last chunk, odd chunk, one chunk
def test_penalty_matches_a_float64_reference(chunk):
    # One group: the top-k of each chunk is a plain top-k, which numpy's argsort reproduces.
    cfg = get_config("tiny", n_experts=12, top_k=3, n_groups=1, topk_groups=1)
    rng = np.random.default_rng(0)
    seq = 40
    sel = rng.uniform(0.2, 0.8, (2, seq, 12))
    sel[1, :, 4] += 0.5  # one expert every token of sequence 1 prefers
    bias = rng.normal(0, 0.05, 12)
    fair, prior = 3 / 12, SEQ_LOAD_PRIOR_TOKENS
    expect = sel.copy()
    for b in range(2):
        counts, seen = np.zeros(12), 0
        for start in range(0, seq, chunk):
            share = (counts + fair * prior) / ((seen + prior) * fair)
            part = sel[b, start:start + chunk] - 0.07 * np.maximum(share - 1, 0)
            expect[b, start:start + chunk] = part
            for row in part:
                counts[np.argsort(-(row + bias), kind="stable")[:3]] += 1
            seen += len(part)
    got = seq_load_penalized_selection(jnp.asarray(sel, jnp.float32), jnp.asarray(bias, jnp.float32), cfg, 0.07,
                                       chunk)
    np.testing.assert_allclose(np.asarray(got), expect, atol=1e-6)
    if chunk < seq:
        assert np.abs(expect - sel).max() > 0.02  # the penalty bit on sequence 1 (else the test shows nothing)


def test_off_by_default_and_zero_changes_nothing():
    assert get_config("tiny").router.seq_load_penalty == 0.0
    cfg, router = _router()
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model))
    ref = route(jax.nn.sigmoid(x @ router.gate()), router.bias[...], cfg)
    np.testing.assert_array_equal(np.asarray(router(x).expert_ids), np.asarray(ref.expert_ids))


def test_it_spreads_a_sequence_that_prefers_the_same_experts(monkeypatch):
    """Every token alike (a repeated line): without the penalty all take the same k experts; with it the later
    chunks move to other experts and the busiest one carries far less; combine weights stay the picked scores."""
    cfg, router = _router(n_groups=1, topk_groups=1)
    tok = jax.random.normal(jax.random.key(2), (1, 1, cfg.d_model))
    noise = jax.random.normal(jax.random.key(3), (1, 256, cfg.d_model))
    x = jnp.broadcast_to(tok, (1, 256, cfg.d_model)) + 1e-3 * noise

    def max_over_mean(ids):
        load = np.bincount(np.asarray(ids).ravel(), minlength=cfg.n_experts)
        return load.max() / load.mean()

    plain = max_over_mean(router(x).expert_ids)
    cfg_p, router_p = _router(n_groups=1, topk_groups=1, router_recipe=router_recipe_with(
        monkeypatch, seq_load_penalty=0.5, seq_load_chunk=16))
    out = router_p(x)
    assert plain == pytest.approx(cfg.n_experts / cfg.top_k)  # all on the same k experts
    assert max_over_mean(out.expert_ids) < 0.6 * plain
    scores = jax.nn.sigmoid(x @ router_p.gate())
    picked = jnp.take_along_axis(scores, out.expert_ids, axis=-1)
    np.testing.assert_allclose(np.asarray(out.weights),
                               np.asarray(picked / picked.sum(-1, keepdims=True) * cfg.routed_scaling_factor),
                               rtol=1e-6)


def test_causal_a_later_token_never_changes_an_earlier_choice(monkeypatch):
    cfg, router = _router(router_recipe=router_recipe_with(monkeypatch, seq_load_penalty=0.3, seq_load_chunk=4,
                                                           center_causal=True))
    x = jax.random.normal(jax.random.key(4), (1, 24, cfg.d_model))
    # From token 13 on (mid-chunk: tokens 12-15 are one chunk) the input changes: no earlier choice may move,
    # token 12 included, although its chunk holds changed tokens.
    y = x.at[:, 13:].set(jax.random.normal(jax.random.key(5), (1, 11, cfg.d_model)))
    a, b = np.asarray(router(x).expert_ids), np.asarray(router(y).expert_ids)
    np.testing.assert_array_equal(a[:, :13], b[:, :13])
    assert (a[:, 13:] != b[:, 13:]).any()


def test_needs_a_sequence_axis(monkeypatch):
    cfg, router = _router(router_recipe=router_recipe_with(monkeypatch, seq_load_penalty=0.1))
    with pytest.raises(ValueError, match="sequence load penalty needs the router input as"):
        router(jnp.ones((8, cfg.d_model)))


def test_the_model_with_it_has_finite_nonzero_gradients(monkeypatch):
    recipe = router_recipe_with(monkeypatch, seq_load_penalty=0.1, seq_load_chunk=4, center_causal=True)
    cfg = get_config("tiny", router_recipe=recipe, n_layers=2, mtp_depth=0, moe_path="ragged")
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(6), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((2, 16), jnp.float32)}
    grads = nnx.jit(nnx.grad(lambda m: lm_loss(m, batch)[0]))(model)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
    assert any(np.abs(np.asarray(g)).max() > 0 for g in leaves)


def test_the_backward_pass_does_not_run_the_penalty_again(monkeypatch):
    """Under remat "dots_no_batch" the compiled step holds the penalty's chunk loop once, as without remat ("full",
    which recomputes the whole block, twice): counted as the compare ops the penalty adds to the program."""
    import re

    def compares(policy, penalty):
        recipe = router_recipe_with(monkeypatch, seq_load_penalty=penalty, seq_load_chunk=4)
        cfg = get_config("tiny", n_layers=2, max_seq_len=16, moe_path="dense_cf", remat_policy=policy,
                         router_recipe=recipe)
        graphdef, state = nnx.split(DeepSeekModel(cfg, rngs=nnx.Rngs(0)))
        tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        step = jax.jit(jax.grad(lambda s, b: lm_loss(nnx.merge(graphdef, s), b)[0]))
        return len(re.findall(r"compare\(", step.lower(state, batch).compile().as_text()))

    added = {policy: compares(policy, 0.1) - compares(policy, 0.0) for policy in ("none", "dots_no_batch", "full")}
    assert added["none"] > 0, added  # the loop is in the program (else this test shows nothing)
    assert added["dots_no_batch"] == added["none"], added
    assert added["full"] == 2 * added["none"], added


@pytest.mark.parametrize("experts, k, groups, top_groups", [(12, 3, 1, 1), (8, 2, 4, 2), (64, 6, 8, 4), (16, 4, 16, 8)])
def test_the_sort_free_mask_picks_what_top_k_picks(experts, k, groups, top_groups):
    from turbo_moe.model.router import group_limited_topk, group_limited_topk_mask

    rng = np.random.default_rng(experts + k)
    scores = jnp.asarray(np.round(rng.uniform(0, 1, (3, 50, experts)), 1), jnp.float32)  # rounded: many ties
    bias = jnp.asarray(np.round(rng.normal(0, 0.1, experts), 1), jnp.float32)
    ids = group_limited_topk(scores, bias, top_k=k, n_groups=groups, topk_groups=top_groups)
    mask = group_limited_topk_mask(scores, bias, top_k=k, n_groups=groups, topk_groups=top_groups)
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(jax.nn.one_hot(ids, experts, dtype=bool).any(-2)))


def test_presets():
    assert get_config("reduced").router.seq_load_penalty == 0.1  # the "short_run" recipe
    assert get_config("deepseek_v3_671b").router.seq_load_penalty == 0.0  # DeepSeek-V3's published router
    assert get_config("tiny").router.seq_load_penalty == 0.0


@requires_turbo
@pytest.mark.parametrize("penalty, causal", [(0.1, True), (0.0, False)])
def test_the_kernel_gives_the_xla_loss_and_gradients(penalty, causal, monkeypatch):
    """The router_topk kernel (turbo_moe.ops.router_topk, what GPUs run: `router.topk_kernel_here`) picks what the jnp
    path picks: same loss, same grads."""
    from turbo_moe.model import router as router_module

    def loss_and_grads(kernel):
        monkeypatch.setattr(router_module, "topk_kernel_here", lambda: kernel)
        recipe = router_recipe_with(monkeypatch, seq_load_penalty=penalty, seq_load_chunk=4, center_causal=causal)
        cfg = get_config("tiny", router_recipe=recipe, n_layers=2, moe_path="ragged")
        model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.key(7), (2, 25), 0, cfg.vocab_size)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": jnp.ones((2, 24), jnp.float32)}
        loss, grads = nnx.jit(nnx.value_and_grad(lambda m: lm_loss(m, batch)[0]))(model)
        return loss, jax.tree.leaves(nnx.state(grads, nnx.Param))

    (loss_x, grads_x), (loss_k, grads_k) = loss_and_grads(False), loss_and_grads(True)
    np.testing.assert_allclose(float(loss_k), float(loss_x), rtol=1e-6)
    for a, b in zip(grads_k, grads_x):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
