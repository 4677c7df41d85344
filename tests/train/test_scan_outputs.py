"""TrainConfig.scan_outputs_uninitialized: the train step lowered with JAX's scan outputs left uninitialised.

On the CPU `lax.empty` lowers to zeros, so the numbers cannot differ here; what is checked is what the switch
does to the program (XLA's "AllocateBuffer" in place of the zero fills when lowered for CUDA), that it leaves
no trace on lowerings outside it, that training with it runs and matches, and that bad values are refused.
The GPU check (tests/gpu/test_scan_outputs_gpu.py) compares losses and gradients where the buffers are real.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.model import get_config
from turbo_moe.train import TrainConfig, run
from turbo_moe.train.scan_outputs import LoweredWithUninitializedScans, uninitialized_scan_outputs
from turbo_moe.train.step import abstract_batch, build_program, make_mesh, make_optimizer


def _scan_grad(x):
    def f(x):
        return jax.lax.scan(lambda c, xi: (c + xi, c * xi), jnp.zeros(x.shape[1:]), x)
    return jax.grad(lambda x: f(x)[1].sum() + f(x)[0].sum())(x)


def _allocations(fn, *args) -> int:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("@AllocateBuffer")


def test_the_context_swaps_zero_fills_for_allocations_and_leaves_nothing_behind():
    x = jnp.ones((5, 4))
    assert _allocations(_scan_grad, x) == 0
    with uninitialized_scan_outputs():
        inside = _allocations(_scan_grad, x)
    assert inside >= 2, inside  # the forward's stacked output and residual, the backward's stacked gradient
    assert _allocations(_scan_grad, x) == 0  # no cached lowering leaks out
    with uninitialized_scan_outputs():
        np.testing.assert_array_equal(jax.jit(_scan_grad)(x), jax.jit(_scan_grad)(x))


def test_the_train_step_lowers_with_allocations_for_cuda():
    cfg = get_config("tiny", n_layers=3)
    tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic", seq_len=16, steps=2, warmup_steps=1))
    mesh = make_mesh(jax.devices()[:1])
    program = build_program(cfg, tx, mesh, True, None, True)
    assert isinstance(program.train, LoweredWithUninitializedScans)
    batch = abstract_batch(2, 16, mesh)
    with uninitialized_scan_outputs():
        lowered = program.train.jitted.trace(program.abstract_state, batch).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("@AllocateBuffer") > 0


def test_training_with_it_matches_training_without():
    base = dict(model="tiny", model_overrides={"n_layers": 3}, dataset="synthetic", seq_len=16, per_device_batch=2,
                steps=3, warmup_steps=1, eval_every=0, eval_batches=1, progress=False)
    off = run(TrainConfig.from_dict(base))
    on = run(TrainConfig.from_dict({**base, "scan_outputs_uninitialized": True}))
    assert off.status == on.status == "ok", (off.error, on.error)
    np.testing.assert_allclose([h["loss"] for h in on.history], [h["loss"] for h in off.history], rtol=1e-6)
    assert on.summary["final_eval_loss"] == pytest.approx(off.summary["final_eval_loss"], rel=1e-6)


def test_a_bad_value_names_the_field():
    with pytest.raises((ValueError, TypeError), match=r"scan_outputs_uninitialized"):
        TrainConfig.from_dict(dict(model="tiny", dataset="synthetic", scan_outputs_uninitialized="yes"))
