"""The train step lowered with JAX's scan outputs left uninitialised: what runs on GPU meshes wherever this JAX's scan
builds its outputs the way `turbo_moe.train.scan_outputs` replaces (`step.uninitialized_scans_here`).

On the CPU `lax.empty` lowers to zeros, so the numbers cannot differ here; what is checked is what the swap does to
the program (XLA's "AllocateBuffer" in place of the zero fills when lowered for CUDA), that it leaves no trace on
lowerings outside it, that the JAX we run supports it, where `build_program` takes it, that training with it matches,
and that the removed TrainConfig field is accepted only at the behaviour kept. The GPU check
(tests/gpu/test_scan_outputs_gpu.py) compares losses where the buffers are real.
"""
from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.model import get_config
from turbo_moe.train import TrainConfig, scan_outputs
from turbo_moe.train.scan_outputs import LoweredWithUninitializedScans, uninitialized_scan_outputs
from turbo_moe.train.step import abstract_batch, build_program, make_mesh, make_optimizer, uninitialized_scans_here


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
    cfg = get_config("tiny", n_layers=3, moe_path="ragged")
    tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic", seq_len=16, steps=2, warmup_steps=1))
    mesh = make_mesh(jax.devices()[:1])
    program = build_program(cfg, tx, mesh, True, None, True)
    assert isinstance(program.train, LoweredWithUninitializedScans)
    batch = abstract_batch(2, 16, mesh)
    with uninitialized_scan_outputs():
        lowered = program.train.jitted.trace(program.abstract_state, batch).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("@AllocateBuffer") > 0


def test_this_jax_supports_it_and_gpu_meshes_take_it():
    """The swap replaces a private JAX function: the JAX versions we support (the one the tests run) must have it in
    the expected form, else GPU runs silently lose it."""
    assert scan_outputs.supported(), f"jax {jax.__version__}: loops._empty_array changed (train/scan_outputs.py)"
    scan_outputs.check_supported()
    assert not uninitialized_scans_here(make_mesh(jax.devices()[:1]))  # on the CPU `lax.empty` is zeros anyway
    gpu_mesh = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="gpu")]))
    assert uninitialized_scans_here(gpu_mesh)
    # two GPUs: XLA would partition the bare AllocateBuffer as a global buffer cut per device (a copy), so zeros
    two_gpus = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="gpu")] * 2))
    assert not uninitialized_scans_here(two_gpus)


def test_an_unsupported_jax_is_named(monkeypatch):
    monkeypatch.setattr(scan_outputs, "_EXPECTED_PARAMETERS", ["something", "else"])
    assert not scan_outputs.supported()
    gpu_mesh = types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="gpu")]))
    assert not uninitialized_scans_here(gpu_mesh)  # GPU runs then keep the zero fills instead of failing
    with pytest.raises(RuntimeError, match=f"jax {jax.__version__} does not build scan outputs with"):
        scan_outputs.check_supported()


def _steps(scan_outputs_uninitialized, n=3):
    cfg = get_config("tiny", n_layers=3, max_seq_len=16, moe_path="ragged")
    tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic", seq_len=16, steps=n, warmup_steps=1))
    program = build_program(cfg, tx, make_mesh(jax.devices()[:1]),
                            scan_outputs_uninitialized=scan_outputs_uninitialized)
    state = program.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (n + 1, 2, 17), 0, cfg.vocab_size)
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
    losses = []
    for batch in batches[:n]:
        state, metrics = program.train(state, batch)
        losses.append(float(metrics["loss"]))
    return program, losses, float(program.evaluate(state, batches[n])["ce_loss"])


def test_training_with_it_matches_training_without():
    default, losses, eval_loss = _steps(None)  # what runs on the CPU: the zero fills
    assert not isinstance(default.train, LoweredWithUninitializedScans)
    swapped, swapped_losses, swapped_eval = _steps(True)
    assert isinstance(swapped.train, LoweredWithUninitializedScans)
    assert isinstance(swapped.evaluate, LoweredWithUninitializedScans)
    np.testing.assert_allclose(swapped_losses, losses, rtol=1e-6)
    assert swapped_eval == pytest.approx(eval_loss, rel=1e-6)


def test_the_removed_field_is_accepted_at_the_kept_behaviour_only():
    base = dict(model="tiny", dataset="synthetic")
    assert TrainConfig.from_dict({**base, "scan_outputs_uninitialized": True}) == TrainConfig.from_dict(base)
    with pytest.raises(ValueError, match=r"TrainConfig field 'scan_outputs_uninitialized' was removed \(scan outputs "
                                         r"are left uninitialised on one-GPU meshes"):
        TrainConfig.from_dict({**base, "scan_outputs_uninitialized": False})
