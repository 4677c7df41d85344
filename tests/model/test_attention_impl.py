"""ModelConfig.attention_impl: "auto" (the default) and "cudnn_unpadded" are the GPU's cuDNN call with v at its own
width; elsewhere both are XLA's attention (here, on the CPU), and a bad value names the field."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turbo_moe.model import get_config
from turbo_moe.model.layers import causal_attention


@pytest.mark.parametrize("impl", ["auto", "cudnn_unpadded"])
def test_falls_back_to_xla_off_the_gpu(impl):
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((2, 12, 3, 24)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((2, 12, 3, 16)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, 12, 3, 16)), jnp.float32)
    outs = {name: jax.vjp(lambda *a, name=name: causal_attention(*a, name), q, k, v) for name in ("xla", impl)}
    np.testing.assert_array_equal(outs[impl][0], outs["xla"][0])
    for a, b in zip(outs[impl][1](g), outs["xla"][1](g)):
        np.testing.assert_array_equal(a, b)
    assert outs["xla"][0].shape == (2, 12, 3, 16)


def test_a_bad_value_names_the_field():
    assert get_config("tiny").attention_impl == "auto"
    assert get_config("tiny", attention_impl="cudnn_unpadded").attention_impl == "cudnn_unpadded"
    with pytest.raises(ValueError, match=r"ModelConfig\.attention_impl.*'cudnn_unpadded'"):
        get_config("tiny", attention_impl="flash")
