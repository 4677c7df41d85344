"""TrainConfig.adam_mu_dtype (issue 14 cut): AdamW's first moment stored in bfloat16, validated, trained with
and saved/restored by the orbax checkpointer with its dtype."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from turbo_moe.model import get_config
from turbo_moe.train import TrainConfig
from turbo_moe.train.checkpoint import Checkpointer, check_resume_config
from turbo_moe.train.step import abstract_batch, build_program, make_mesh, make_optimizer


def _adam_state(opt_state) -> optax.ScaleByAdamState:
    return next(s for s in jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
                if isinstance(s, optax.ScaleByAdamState))


@pytest.mark.parametrize("value", ["float16", "bf16", 16, jnp.bfloat16])
def test_bad_value_names_the_field(value):
    with pytest.raises(ValueError, match=r"TrainConfig\.adam_mu_dtype: got .*expected one of"):
        TrainConfig(adam_mu_dtype=value)


def test_round_trip_and_default_unchanged():
    tc = TrainConfig(adam_mu_dtype="bfloat16")
    assert TrainConfig.from_dict(tc.to_dict()) == tc
    assert TrainConfig().adam_mu_dtype is None
    assert make_optimizer(TrainConfig()) is make_optimizer(TrainConfig(adam_mu_dtype=None))  # cache still hits
    assert make_optimizer(tc) is not make_optimizer(TrainConfig())
    with pytest.raises(ValueError, match="adam_mu_dtype='bfloat16' in the checkpoint, None now"):
        check_resume_config({"adam_mu_dtype": "bfloat16"}, {"adam_mu_dtype": None})


def test_bf16_mu_trains_and_checkpoints_with_its_dtype(tmp_path):
    cfg = get_config("tiny", n_layers=2, mtp_depth=0)  # fast compile
    tc = TrainConfig(model=cfg, dataset="synthetic", seq_len=16, steps=4, warmup_steps=1, adam_mu_dtype="bfloat16")
    mesh = make_mesh(jax.devices()[:1])
    program = build_program(cfg, make_optimizer(tc), mesh)
    state = program.init(jax.random.key(0))
    adam = _adam_state(state.opt_state)
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype(jnp.float32)}
    assert jax.tree.leaves(program.abstract_state.opt_state)[1].dtype == jax.tree.leaves(state.opt_state)[1].dtype

    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    compiled = program.train.lower(program.abstract_state, abstract_batch(2, 16, mesh)).compile()
    for _ in range(2):
        state, metrics = compiled(state, batch)
        assert np.isfinite(float(metrics["loss"]))
    mu = _adam_state(state.opt_state).mu
    assert {x.dtype for x in jax.tree.leaves(mu)} == {jnp.dtype(jnp.bfloat16)}
    assert any(float(jnp.abs(x.astype(jnp.float32)).max()) > 0 for x in jax.tree.leaves(mu))

    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(2, state, {"step": 2, "config": tc.to_dict()})
    assert ckpt.finish() is None
    restored, record = Checkpointer(tmp_path / "ckpt").restore(program.abstract_state, config=tc.to_dict())
    assert record["step"] == 2
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    state, metrics = compiled(restored, batch)  # the restored state runs the same executable
    assert np.isfinite(float(metrics["loss"]))
