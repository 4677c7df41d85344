"""causal_attention's "cudnn_unpadded" (and "auto", what the model runs, which is it on the GPU): cuDNN with v at
its own width gives the padded call's output and gradients (to bf16 rounding), at `reduced`'s MLA head dims. Skipped
without a CUDA device:
    JAX_PLATFORMS=cuda,cpu python -m pytest tests/gpu/test_attention_unpadded_gpu.py -q
"""
import numpy as np

import jax
import jax.numpy as jnp

from tests.gpu import GPU, requires_gpu

pytestmark = requires_gpu


def test_unpadded_equals_padded_with_gradients():
    from turbo_moe.model.layers import causal_attention

    rng = np.random.default_rng()
    q, k = (jax.device_put(jnp.asarray(rng.standard_normal((2, 512, 4, 96)), jnp.bfloat16), GPU) for _ in range(2))
    v = jax.device_put(jnp.asarray(rng.standard_normal((2, 512, 4, 64)), jnp.bfloat16), GPU)
    g = jax.device_put(jnp.asarray(rng.standard_normal((2, 512, 4, 64)), jnp.bfloat16), GPU)
    results = {}
    for impl in ("cudnn", "cudnn_unpadded", "auto"):
        out, vjp = jax.vjp(lambda *a: causal_attention(*a, impl), q, k, v)
        results[impl] = [np.asarray(t, np.float32) for t in (out, *vjp(g))]
    for a, b in zip(results["cudnn_unpadded"], results["cudnn"]):
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max(), np.abs(a - b).max()
    for a, b in zip(results["auto"], results["cudnn_unpadded"]):
        np.testing.assert_array_equal(a, b)
