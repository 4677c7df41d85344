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


def test_round_trip_and_default():
    tc = TrainConfig(adam_mu_dtype="bfloat16")
    assert TrainConfig.from_dict(tc.to_dict()) == tc
    # "auto": bfloat16 on GPUs (the update is memory-bound), the parameters' dtype on the CPU
    assert TrainConfig().adam_mu_dtype == "auto"
    assert TrainConfig().resolved("gpu").adam_mu_dtype == "bfloat16"
    assert TrainConfig().resolved("cpu").adam_mu_dtype is None
    assert make_optimizer(TrainConfig()) is make_optimizer(TrainConfig(adam_mu_dtype=None))  # on the CPU: one optimizer
    assert make_optimizer(tc) is not make_optimizer(TrainConfig())
    with pytest.raises(ValueError, match="adam_mu_dtype='bfloat16' in the checkpoint, None now"):
        check_resume_config({"adam_mu_dtype": "bfloat16"}, {"adam_mu_dtype": None})


@pytest.mark.parametrize("nu_dtype", [None, "bfloat16"])  # mu alone; both moments (DeepSeek-V3's recipe)
def test_bf16_moments_train_and_checkpoint_with_their_dtype(tmp_path, nu_dtype):
    cfg = get_config("tiny", n_layers=2, mtp_depth=0)  # fast compile
    tc = TrainConfig(model=cfg, dataset="synthetic", seq_len=16, steps=4, warmup_steps=1, adam_mu_dtype="bfloat16",
                     adam_nu_dtype=nu_dtype)
    want_nu = jnp.dtype(nu_dtype or jnp.float32)
    mesh = make_mesh(jax.devices()[:1])
    program = build_program(cfg, make_optimizer(tc), mesh)
    state = program.init(jax.random.key(0))
    for adam in (_adam_state(state.opt_state), _adam_state(program.abstract_state.opt_state)):  # the step's layout too
        assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
        assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {want_nu}

    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    compiled = program.train.lower(program.abstract_state, abstract_batch(2, 16, mesh)).compile()
    for _ in range(3):
        state, metrics = compiled(state, batch)
        assert np.isfinite(float(metrics["loss"]))
    adam = _adam_state(state.opt_state)
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {want_nu}
    assert any(float(jnp.abs(x.astype(jnp.float32)).max()) > 0 for x in jax.tree.leaves(adam.mu))
    assert all(float(x.astype(jnp.float32).min()) >= 0 for x in jax.tree.leaves(adam.nu))
    assert any(float(x.astype(jnp.float32).max()) > 0 for x in jax.tree.leaves(adam.nu))

    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(3, state, {"step": 3, "config": tc.to_dict()})
    assert ckpt.finish() is None
    restored, record = Checkpointer(tmp_path / "ckpt").restore(program.abstract_state, config=tc.to_dict())
    assert record["step"] == 3
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    state, metrics = compiled(restored, batch)  # the restored state runs the same executable
    assert np.isfinite(float(metrics["loss"]))
    changed = "adam_nu_dtype" if nu_dtype else "adam_mu_dtype"  # resuming with another moment dtype is refused
    with pytest.raises(ValueError, match=f"{changed}='bfloat16' in the checkpoint, None now"):
        Checkpointer(tmp_path / "ckpt").restore(program.abstract_state, config=tc.replace(**{changed: None}).to_dict())
