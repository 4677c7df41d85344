"""ModelConfig.router_center_ema (issue 13, part 5): the running mean of each MoE layer's router input,
subtracted before top-k selection only, updated after use by the forward, kept by the train step and
the checkpoints like the router bias."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from turbo_moe.model import DeepSeekModel, get_config
from turbo_moe.model import router as router_mod
from turbo_moe.model.router import Router, RouterCenter, route, updated_center
from turbo_moe.train import TrainConfig
from turbo_moe.train.checkpoint import Checkpointer
from turbo_moe.train.step import abstract_batch, build_program, make_mesh, make_optimizer

EMA = 0.25


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, True, "fast"])
def test_bad_value_names_the_field(value):
    with pytest.raises((ValueError, TypeError), match=r"ModelConfig\.router_center_ema"):
        get_config("tiny", router_center_ema=value)


def test_off_by_default_no_state_and_routing_unchanged():
    cfg = get_config("tiny")
    assert cfg.router_center_ema == 0.0
    router = Router(cfg, nnx.Rngs(0))
    assert not hasattr(router, "center")
    x = jax.random.normal(jax.random.key(1), (2, 8, cfg.d_model))
    out = router(x)
    ref = route(jax.nn.sigmoid(x @ router.gate()), router.bias[...], cfg)
    np.testing.assert_array_equal(np.asarray(out.expert_ids), np.asarray(ref.expert_ids))
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    assert not nnx.state(model, RouterCenter)  # the default train state (and its checkpoints) unchanged


def _shared_direction_inputs(cfg, n_tokens=64, strength=8.0, seed=0):
    """Router inputs that all carry one large shared direction u plus a small per-token part."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    u = jax.random.normal(k1, (cfg.d_model,))
    return strength * u + 0.3 * jax.random.normal(k2, (n_tokens, cfg.d_model)), strength * u


def test_centering_changes_the_selection_and_not_the_weights():
    cfg = get_config("tiny", n_experts=16, n_groups=4, topk_groups=2, top_k=2, routed_scaling_factor=2.5,
                     router_center_ema=EMA, router_init_std=0.1)
    router = Router(cfg, nnx.Rngs(0))
    x, shared = _shared_direction_inputs(cfg)
    uncentered = router(x)  # center 0: every token sees the same per-expert levels u.W
    router.center[...] = shared
    centered = router(x)
    n_sets = lambda r: len({tuple(sorted(t)) for t in np.asarray(r.expert_ids).tolist()})  # noqa: E731
    assert n_sets(uncentered) <= 2  # collapsed onto one expert set
    assert n_sets(centered) >= 10  # the per-token part decides
    load = np.bincount(np.asarray(centered.expert_ids).ravel(), minlength=16)
    assert load.max() / load.mean() < 3.0
    # The selection is top-k of sigmoid(x' W), x' = x without its component along the running mean c;
    # the scores and combine weights are the plain ones.
    gate = router.gate()
    unit = shared / jnp.linalg.norm(shared)
    projected = x - (x @ unit)[:, None] * unit
    ref = route(jax.nn.sigmoid(x @ gate), router.bias[...], cfg, jax.nn.sigmoid(projected @ gate))
    np.testing.assert_array_equal(np.asarray(centered.expert_ids), np.asarray(ref.expert_ids))
    scores = jax.nn.sigmoid(x @ gate)
    np.testing.assert_allclose(np.asarray(centered.scores), np.asarray(scores), rtol=1e-6)
    picked = np.take_along_axis(np.asarray(scores), np.asarray(centered.expert_ids), -1)
    np.testing.assert_allclose(np.asarray(centered.weights), picked / picked.sum(-1, keepdims=True) * 2.5,
                               rtol=1e-5)
    # The weights carry the gate's gradient; the centering adds none (selection is not differentiable).
    grad = jax.grad(lambda c: jnp.sum(route(scores, router.bias[...], cfg, jax.nn.sigmoid(x @ gate - c @ gate))
                                      .weights))(shared)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_updated_center_is_an_ema():
    c = jnp.array([1.0, -2.0, 0.0])
    m = jnp.array([3.0, 2.0, -4.0])
    np.testing.assert_allclose(np.asarray(updated_center(c, m, 0.25)), [1.5, -1.0, -1.0])
    np.testing.assert_allclose(np.asarray(updated_center(c, m, 1.0)), np.asarray(m))


def _recorded_router_inputs(monkeypatch):
    """Host copies of each router call's token-mean input, in call order (MoE stack, then MTP)."""
    seen = []
    orig = Router.center_statistic

    def recording(self, x, routing):
        stat = orig(self, x, routing)
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), stat, ordered=True)
        return stat

    monkeypatch.setattr(Router, "center_statistic", recording)
    return seen


@pytest.mark.parametrize("scan", [True, False])
def test_forward_updates_every_layer_center_by_the_ema_of_past_batches(monkeypatch, scan):
    cfg = get_config("tiny", n_layers=3, n_dense_layers=1, mtp_depth=1, router_center_ema=EMA, scan_layers=scan)
    seen = _recorded_router_inputs(monkeypatch)
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    assert [c[...].shape for c in model.router_centers()] == [(2, cfg.d_model), (cfg.d_model,)]
    batches = [jax.random.randint(jax.random.key(i), (2, 12), 0, cfg.vocab_size) for i in (1, 2)]
    expected = np.zeros((cfg.n_router_layers, cfg.d_model), np.float32)
    for tokens in batches:
        seen.clear()
        model(tokens, tokens)
        jax.effects_barrier()
        assert len(seen) == cfg.n_router_layers
        expected = expected + EMA * (np.stack(seen) - expected)
        got = np.concatenate([np.reshape(c[...], (-1, cfg.d_model)) for c in model.router_centers()])
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.abs(expected).max() > 0.01


def test_scanned_and_unrolled_agree():
    outs = {}
    for scan in (True, False):
        cfg = get_config("tiny", n_layers=3, n_dense_layers=1, router_center_ema=EMA, scan_layers=scan,
                         dtype="float32")
        model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.key(3), (2, 12), 0, cfg.vocab_size)
        for _ in range(3):  # the later forwards select with a nonzero center
            out = model(tokens, tokens)
        outs[scan] = (np.asarray(out.logits), np.asarray(out.moe.expert_load),
                      np.concatenate([np.reshape(c[...], (-1, cfg.d_model)) for c in model.router_centers()]))
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_centered_selection_uses_past_steps_only():
    """A later token changes neither the selection nor the output of the earlier ones (no mean over the
    current batch), while this forward still moves the running mean."""
    cfg = get_config("tiny", n_layers=2, n_dense_layers=1, mtp_depth=0, router_center_ema=EMA, dtype="float32")
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(4), (1, 12), 0, cfg.vocab_size)
    model(tokens)  # a nonzero center
    state = nnx.state(model)
    other = tokens.at[0, -1].set((tokens[0, -1] + 1) % cfg.vocab_size)
    a = model(tokens).logits
    nnx.update(model, state)
    b = model(other).logits
    np.testing.assert_allclose(np.asarray(a[0, :-1]), np.asarray(b[0, :-1]), rtol=1e-5, atol=1e-6)


def test_train_step_keeps_and_checkpoints_the_centers(tmp_path, monkeypatch):
    cfg = get_config("tiny", n_layers=2, mtp_depth=1, router_center_ema=EMA, dtype="float32")
    tc = TrainConfig(model=cfg, dataset="synthetic", seq_len=16, steps=3, warmup_steps=1)
    mesh = make_mesh(jax.devices()[:1])
    program = build_program(cfg, make_optimizer(tc), mesh)
    state = program.init(jax.random.key(0))
    centers = lambda s: jax.tree.leaves(nnx.State(s.extra).filter(RouterCenter))  # noqa: E731
    assert len(centers(state)) == 2 and all(float(jnp.abs(c).max()) == 0 for c in centers(state))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    compiled = program.train.lower(program.abstract_state, abstract_batch(2, 16, mesh)).compile()
    state, _ = compiled(state, batch)
    first = [np.asarray(c) for c in centers(state)]
    assert all(np.abs(c).max() > 0 for c in first)  # the step kept what its forward wrote
    # The second step's forward (the state after step 1) sees these router inputs, layer by layer:
    seen = _recorded_router_inputs(monkeypatch)
    # (on copies: merge reuses the state's Variables, and this forward moves the centers)
    nnx.merge(program.graphdef, *jax.tree.map(jnp.copy, (state.params, state.extra)))(batch["inputs"],
                                                                                     batch["targets"])
    jax.effects_barrier()
    state, metrics = compiled(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    second = np.concatenate([np.reshape(c, (-1, cfg.d_model)) for c in centers(state)])
    c1 = np.concatenate([np.reshape(c, (-1, cfg.d_model)) for c in first])
    np.testing.assert_allclose(second, c1 + EMA * (np.stack(seen) - c1), rtol=1e-4, atol=1e-5)

    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(2, state, {"step": 2, "config": tc.to_dict()})
    assert ckpt.finish() is None
    restored, _ = Checkpointer(tmp_path / "ckpt").restore(program.abstract_state, config=tc.to_dict())
    for a, b in zip(centers(state), centers(restored)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_projection_also_removes_each_tokens_share_of_the_direction():
    """Tokens that carry the shared direction u in different amounts a_t: subtracting the mean input
    leaves (a_t - mean a) u.W, one pattern over the experts for every token ("input"); the projection
    ("project", the default) removes it, and the per-token part decides."""
    old = router_mod.CENTER_SPACE
    cfg = get_config("tiny", n_experts=16, n_groups=4, topk_groups=2, top_k=2, router_center_ema=EMA,
                     router_init_std=0.1)
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    u = jax.random.normal(k1, (cfg.d_model,))
    share = 8.0 + 2.0 * jax.random.normal(k2, (256, 1))  # a_t
    x = share * u + 0.3 * jax.random.normal(k3, (256, cfg.d_model))
    ratio = {}
    try:
        for space in ("project", "input"):
            router_mod.CENTER_SPACE = space
            router = Router(cfg, nnx.Rngs(0))
            router.center[...] = x.mean(0)  # even a perfect running mean
            load = np.bincount(np.asarray(router(x).expert_ids).ravel(), minlength=16)
            ratio[space] = load.max() / load.mean()
    finally:
        router_mod.CENTER_SPACE = old
    assert ratio["input"] > 2.5
    assert ratio["project"] < 0.7 * ratio["input"]
