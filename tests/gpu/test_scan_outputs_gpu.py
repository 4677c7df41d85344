"""Scan outputs left uninitialised on the GPU (what `build_program` does there by default:
`step.uninitialized_scans_here`), where `lax.empty` is XLA's "AllocateBuffer" (real uninitialised memory): training
with it gives the losses and evaluation of training with the zero fills, for the scanned layer stack of every remat
policy whose backward reads stacked residuals."""
import numpy as np
import pytest

from tests.gpu import GPU, requires_gpu

pytestmark = requires_gpu

if GPU is not None:
    import jax

    from turbo_moe.model import get_config
    from turbo_moe.train import TrainConfig
    from turbo_moe.train.scan_outputs import LoweredWithUninitializedScans
    from turbo_moe.train.step import build_program, make_mesh, make_optimizer


def _steps(remat, scan_outputs_uninitialized, n=4):
    cfg = get_config("tiny", n_layers=4, max_seq_len=64, moe_path="turbo", remat_policy=remat)
    tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic", seq_len=64, steps=n, warmup_steps=1))
    program = build_program(cfg, tx, make_mesh(jax.devices()[:1]),
                            scan_outputs_uninitialized=scan_outputs_uninitialized)
    state = program.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (n + 1, 4, 65), 0, cfg.vocab_size)
    batches = [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]
    losses = []
    for batch in batches[:n]:
        state, metrics = program.train(state, batch)
        losses.append(float(metrics["loss"]))
    return program, losses, float(program.evaluate(state, batches[n])["ce_loss"])


@pytest.mark.parametrize("remat", ["dots_experts_attention", "full"])
def test_training_with_uninitialized_scan_outputs_matches(remat):
    default, losses, eval_loss = _steps(remat, None)  # the GPU default: uninitialised
    assert isinstance(default.train, LoweredWithUninitializedScans), "GPU runs lost the swap (see scan_outputs.py)"
    filled, filled_losses, filled_eval = _steps(remat, False)
    assert not isinstance(filled.train, LoweredWithUninitializedScans)
    np.testing.assert_allclose(losses, filled_losses, rtol=1e-5)
    assert np.isclose(eval_loss, filled_eval, rtol=1e-5)
