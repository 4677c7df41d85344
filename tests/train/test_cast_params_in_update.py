"""TrainConfig.cast_params_in_update: the stacked layers' cast-at-use weights live in the train state in the compute
dtype, written by each optimizer update. The steps equal the cast-at-the-start ones bit for bit (same values, same
gradients), the copy always equals the cast of the master weights, and a resumed run rebuilds it (not checkpointed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from turbo_moe.model import get_config
from turbo_moe.train import TrainConfig, run
from turbo_moe.train.step import build_program, make_mesh, make_optimizer

MICRO = {"n_layers": 2, "mtp_depth": 0, "cast_params_before_scan": True}


def _steps(cast_in_update: bool, n: int = 3):
    cfg = get_config("tiny", **MICRO)
    tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic", seq_len=16, steps=8, warmup_steps=1))
    program = build_program(cfg, tx, make_mesh(jax.devices()[:1]), True, None, False, cast_in_update)
    state = program.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (n, 2, 17), 0, cfg.vocab_size)
    losses = []
    for i in range(n):
        state, metrics = program.train(state, {"inputs": tokens[i, :, :-1], "targets": tokens[i, :, 1:]})
        losses.append(float(metrics["loss"]))
    return state, losses


def test_same_steps_and_the_copy_is_the_cast_of_the_master_weights():
    ref_state, ref_losses = _steps(False)
    state, losses = _steps(True)
    assert losses == ref_losses  # bit-identical
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_array_equal(a, b)
    copy = nnx.to_flat_state(state.compute)
    assert ref_state.compute is None and len(copy) >= 4  # every stacked Linear kernel and both expert weights
    params = dict(nnx.to_flat_state(state.params))
    for path, var in copy:
        assert var[...].dtype == jnp.bfloat16 and params[path][...].dtype == jnp.float32, path
        np.testing.assert_array_equal(var[...], params[path][...].astype(jnp.bfloat16), err_msg=str(path))
    assert not any("router" in "/".join(map(str, p)) or "norm" in "/".join(map(str, p)) for p, _ in copy)


def test_resume_rebuilds_the_copy(tmp_path):
    base = TrainConfig(model="tiny", model_overrides=MICRO, dataset="synthetic", per_device_batch=1, seq_len=16,
                       steps=6, lr_schedule_steps=6, warmup_steps=1, eval_batches=0, progress=False,
                       cast_params_in_update=True)
    whole = run(base)
    assert whole.status == "ok", whole.error
    ckpt = str(tmp_path / "ckpt")
    assert run(base.replace(steps=3, checkpoint_dir=ckpt, checkpoint_every=3)).status == "ok"
    resumed = run(base.replace(checkpoint_dir=ckpt, resume=True))
    assert resumed.status == "ok", resumed.error
    assert resumed.summary["resumed_from_step"] == 3
    assert resumed.losses() == whole.losses()  # steps 3-5 from the restored params and their rebuilt copy


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="cast_params_in_update: must be a bool"):
        TrainConfig(model="tiny", cast_params_in_update="yes")
    cfg = get_config("tiny", dtype="float32")
    tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic", seq_len=16, steps=2, warmup_steps=1))
    with pytest.raises(ValueError, match="cast_params_in_update: the model computes in its parameter dtype"):
        build_program(cfg, tx, make_mesh(jax.devices()[:1]), True, None, False, True)
