"""ModelConfig.attention_impl: "cudnn_unpadded" is the GPU's cuDNN call with v at its own width; elsewhere it is
"auto" (here, on the CPU: XLA), and a bad value names the field."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.model import get_config
from turbo_moe.model.layers import causal_attention


def test_cudnn_unpadded_falls_back_off_the_gpu():
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((2, 12, 3, 24)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((2, 12, 3, 16)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, 12, 3, 16)), jnp.float32)
    outs = {impl: jax.vjp(lambda *a: causal_attention(*a, impl), q, k, v) for impl in ("xla", "cudnn_unpadded")}
    np.testing.assert_array_equal(outs["cudnn_unpadded"][0], outs["xla"][0])
    for a, b in zip(outs["cudnn_unpadded"][1](g), outs["xla"][1](g)):
        np.testing.assert_array_equal(a, b)
    assert outs["xla"][0].shape == (2, 12, 3, 16)


def test_a_bad_value_names_the_field():
    assert get_config("tiny", attention_impl="cudnn_unpadded").attention_impl == "cudnn_unpadded"
    with pytest.raises(ValueError, match=r"ModelConfig\.attention_impl.*'cudnn_unpadded'"):
        get_config("tiny", attention_impl="flash")
