"""dense_cf's drops on the dropless paths (turbo_moe.model.capacity): the same pairs dropped, the same losses,
gradients (the router's included) and dropped fraction as dense_cf over several training steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tests.model.conftest import micro_config, requires_turbo
from flax import nnx

from turbo_moe.model import (
    DeepSeekModel,
    capacity,
    get_config,
    lm_loss,
    update_router_bias,
)
from turbo_moe.model.exchanges import expert_capacity
from turbo_moe.model.router import Routing

# ragged drops the same way (the mask is applied before any exchange); turbo is the path the comparison runs
DROPLESS = [pytest.param("turbo", marks=requires_turbo)]


def batches(cfg, n, batch=4, seq=16):
    keys = jax.random.split(jax.random.key(7), n)
    out = []
    for key in keys:
        tokens = jax.random.randint(key, (batch, seq + 1), 0, cfg.vocab_size)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def train(cfg, steps=6):
    """Losses, dropped fractions and the first step's gradients of `steps` Adam steps with the router bias update."""
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        (loss, metrics), grads = nnx.value_and_grad(lm_loss, has_aux=True)(model, batch)
        optimizer.update(model, grads)
        return loss, metrics, grads

    losses, dropped, first_grads = [], [], None
    for batch in batches(cfg, steps):
        loss, metrics, grads = step(model, optimizer, batch)
        update_router_bias(model, metrics["expert_load"])
        losses.append(float(loss))
        dropped.append(float(metrics["dropped_fraction"]))
        first_grads = nnx.to_flat_state(grads) if first_grads is None else first_grads
    return np.array(losses), np.array(dropped), first_grads


@pytest.fixture(scope="module", params=[1.0, 1.25])
def dense_cf_run(request):
    cf = request.param
    return cf, train(micro_config(dtype="float32", moe_path="dense_cf", capacity_factor=cf))


@pytest.mark.parametrize("path", DROPLESS)
def test_dropless_path_with_drop_tokens_trains_as_dense_cf(path, dense_cf_run):
    cf, (ref_losses, ref_dropped, ref_grads) = dense_cf_run
    losses, dropped, grads = train(micro_config(dtype="float32", moe_path=path, capacity_factor=cf, drop_tokens=True))
    assert ref_dropped.min() > 0.02  # the comparison means something: dense_cf drops at this size
    np.testing.assert_allclose(dropped, ref_dropped, rtol=0, atol=1e-6)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert [k for k, _ in grads] == [k for k, _ in ref_grads]
    for (name, g), (_, ref) in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g[...]), np.asarray(ref[...]), rtol=2e-4, atol=2e-6, err_msg=str(name))
    assert any("router" in str(name) for name, _ in grads)  # the router's gradient is among those compared


def test_dropless_unless_asked_and_the_field_is_checked():
    cfg = micro_config(dtype="float32", moe_path="turbo")
    assert cfg.capacity_factor > 0 and capacity.drop_capacity_factor(cfg) is None
    assert capacity.regime(cfg) == "dropless" and capacity.regime(get_config("reduced")) == "dropless"
    ids = jax.random.randint(jax.random.key(0), (2, 16, cfg.top_k), 0, cfg.n_experts)
    routing = Routing(expert_ids=ids, weights=jnp.ones(ids.shape), scores=jnp.ones((2, 16, cfg.n_experts)))
    assert capacity.drop_overflow(routing, cfg) == (routing, None)  # untouched: the path's own (no) drops
    dropping = cfg.replace(capacity_factor=1.0, drop_tokens=True)
    masked, dropped = capacity.drop_overflow(routing, dropping)
    kept = np.asarray(capacity.kept_pairs(ids, cfg.n_experts, 1.0))
    np.testing.assert_array_equal(np.asarray(masked.weights) > 0, kept)
    assert float(dropped) == pytest.approx(1 - kept.mean()) and 0 < float(dropped) < 1
    assert capacity.regime(cfg.replace(drop_tokens=True)) == "drops as dense_cf at cf=1.25"
    assert capacity.regime(cfg.replace(moe_path="dense_cf", capacity_factor=1.0)) == "drops at cf=1"
    assert capacity.drop_capacity_factor(cfg.replace(moe_path="dense_cf", capacity_factor=-1.0)) is None
    for bad in (dict(moe_path="dense_cf"), dict(capacity_factor=0.0), dict(capacity_factor=-1.0)):
        with pytest.raises(ValueError, match="drop_tokens"):
            cfg.replace(drop_tokens=True, **bad)
    with pytest.raises(TypeError, match="ModelConfig.drop_tokens expects bool, got 'yes'"):
        cfg.replace(drop_tokens="yes")
    with pytest.raises(ValueError, match="per sequence"):
        capacity.drop_overflow(routing._replace(expert_ids=ids[0]), dropping)


def test_kept_pairs_follow_token_then_choice_order():
    # one sequence of 4 tokens, k=2, E=2: capacity ceil(4*2/2)*0.5 = 2 slots per expert
    ids = jnp.array([[[0, 1], [1, 0], [0, 1], [1, 0]]], jnp.int32)
    assert expert_capacity(4, 2, 2, 0.5) == 2
    kept = np.asarray(capacity.kept_pairs(ids, 2, 0.5))
    np.testing.assert_array_equal(kept[0], [[True, True], [True, True], [False, False], [False, False]])
    ids = jnp.array([[[0, 1], [0, 1], [0, 1], [1, 0]]], jnp.int32)  # expert 0 fills with tokens 0, 1
    kept = np.asarray(capacity.kept_pairs(ids, 2, 0.5))
    np.testing.assert_array_equal(kept[0], [[True, True], [True, True], [False, False], [False, False]])
