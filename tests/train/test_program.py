"""Program.abstract_state is what init returns (shapes, dtypes, shardings), so the train step can be
compiled from it before init has run (turbo_moe.train.run overlaps the two compiles); `with_head_bias` sets the
output-head bias of a state in any layout."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from turbo_moe.model import get_config
from turbo_moe.train import TrainConfig, init_state, with_head_bias
from turbo_moe.train.step import abstract_batch, build_program, make_mesh, make_optimizer


def test_abstract_state_matches_init_and_compiles_the_step():
    cfg = get_config("tiny")
    tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic", seq_len=32, steps=4, warmup_steps=1))
    mesh = make_mesh(jax.devices()[:1])
    program = build_program(cfg, tx, mesh)
    state = program.init(jax.random.key(0))
    real, abstract = jax.tree.leaves(state), jax.tree.leaves(program.abstract_state)
    assert jax.tree.structure(state) == jax.tree.structure(program.abstract_state)
    for r, a in zip(real, abstract):
        assert (r.shape, r.dtype) == (a.shape, a.dtype)
        assert r.sharding.is_equivalent_to(a.sharding, r.ndim)
    compiled = program.train.lower(program.abstract_state, abstract_batch(2, 32, mesh)).compile()
    batch = {k: jax.numpy.zeros((2, 32), jax.numpy.int32) for k in ("inputs", "targets")}
    _, metrics = compiled(state, batch)  # the executable compiled from shapes alone runs the real state
    assert jax.numpy.isfinite(metrics["loss"])


@pytest.mark.parametrize("n_devices", [1, 4])
def test_with_head_bias_sets_values_in_any_layout(n_devices):
    if jax.device_count() < n_devices:
        pytest.skip(f"needs {n_devices} devices")
    cfg = get_config("tiny", router_recipe="short_run")  # its head_bias "unigram"
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
    _, plain = init_state(cfg.replace(router_recipe="deepseek_v3"), tx, 0, mesh)
    with pytest.raises(ValueError, match="head_bias is 'none'"):
        with_head_bias(plain, values)
