"""Program.abstract_state is what init returns (shapes, dtypes, shardings), so the train step can be
compiled from it before init has run (turbo_moe.train.run overlaps the two compiles)."""
from __future__ import annotations

import jax

from turbo_moe.model import get_config
from turbo_moe.train import TrainConfig
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
