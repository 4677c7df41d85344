"""`ModelConfig.block_micro_batches`: each MoE block runs every device's sequences in n micro-batches. The training
steps equal one batch's (losses, router loads, parameters), on one device and under expert parallelism."""

import jax
import numpy as np
import pytest

from tests.model.conftest import requires_turbo
from turbo_moe.model import get_config
from turbo_moe.train import TrainConfig
from turbo_moe.train.step import build_program, make_mesh, make_optimizer

MICRO = {"n_layers": 2, "dtype": "float32", "moe_path": "turbo"}  # one dense + one MoE block + the MoE MTP block


def _steps(micro_batches: int, data: int, expert: int, per_device_batch: int = 2, n: int = 3):
    if jax.device_count() < data * expert:
        pytest.skip(f"needs {data * expert} devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    cfg = get_config("tiny", block_micro_batches=micro_batches, **MICRO)
    tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic", seq_len=16, steps=8, warmup_steps=1))
    program = build_program(cfg, tx, make_mesh(jax.devices()[: data * expert], expert_parallel=expert))
    state = program.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (n, data * expert * per_device_batch, 17), 0, cfg.vocab_size)
    metrics = []
    for i in range(n):
        state, m = program.train(state, {"inputs": tokens[i, :, :-1], "targets": tokens[i, :, 1:]})
        metrics.append(jax.device_get(m))
    return state, metrics


@requires_turbo
@pytest.mark.parametrize("data, expert", [(1, 1), (2, 2)], ids=["one_device", "ep2_data2"])
def test_micro_batches_train_as_one_batch(data, expert):
    ref_state, ref = _steps(1, data, expert)
    state, got = _steps(2, data, expert)
    for step, (m, r) in enumerate(zip(got, ref)):
        for key in ("loss", "ce_loss", "mtp_loss", "balance_loss"):
            np.testing.assert_allclose(m[key], r[key], rtol=2e-5, err_msg=f"step {step}: {key}")
        np.testing.assert_array_equal(m["expert_load"], r["expert_load"], err_msg=f"step {step}")
    assert ref[-1]["loss"] != ref[0]["loss"]  # the steps trained: the comparison is not of two inits
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_batch_that_does_not_split_is_named():
    with pytest.raises(ValueError, match=r"block_micro_batches=2: each device's batch must divide by it; got 3 "
                                         r"sequences over 1 device\(s\) \(per_device_batch 3\)"):
        _steps(2, 1, 1, per_device_batch=3, n=1)
    with pytest.raises(ValueError, match=r"ModelConfig.block_micro_batches: must be an int >= 1"):
        get_config("tiny", block_micro_batches=0)
    with pytest.raises(ValueError, match=r"TrainConfig.per_device_batch: 3 does not divide into the model's "
                                         r"block_micro_batches=2"):
        TrainConfig(model="tiny", model_overrides={"block_micro_batches": 2}, per_device_batch=3)
