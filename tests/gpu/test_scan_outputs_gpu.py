"""TrainConfig.scan_outputs_uninitialized on the GPU, where `lax.empty` is XLA's "AllocateBuffer" (real uninitialised
memory): training with it gives the losses and evaluation of training without it, for the scanned layer stack of
every remat policy whose backward reads stacked residuals."""
import numpy as np
import pytest

from tests.gpu import GPU, requires_gpu

pytestmark = requires_gpu

if GPU is not None:
    from turbo_moe.train import TrainConfig, run


@pytest.mark.parametrize("remat", ["dots_experts_attention", "full"])
def test_training_with_uninitialized_scan_outputs_matches(remat):
    base = dict(model="tiny", model_overrides={"n_layers": 4, "moe_path": "turbo", "remat_policy": remat},
                dataset="synthetic", seq_len=64, per_device_batch=4, steps=4, warmup_steps=1, eval_every=0,
                eval_batches=1, progress=False)
    off = run(TrainConfig.from_dict(base))
    on = run(TrainConfig.from_dict({**base, "scan_outputs_uninitialized": True}))
    assert off.status == on.status == "ok", (off.error, on.error)
    np.testing.assert_allclose([h["loss"] for h in on.history], [h["loss"] for h in off.history], rtol=1e-5)
    assert np.isclose(on.summary["final_eval_loss"], off.summary["final_eval_loss"], rtol=1e-5)
