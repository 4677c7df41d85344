"""The routed experts' SwiGLU (`ops.expert_block.swiglu`) with its written-out backward: the gradient of autodiff in
float32, closer to float64 than autodiff's bf16 arithmetic in bf16, and built as one concatenate (autodiff of the two
slices gave pad + pad + add, which XLA evaluated for both halves at every element)."""
import jax
import jax.numpy as jnp
import numpy as np

from turbo_moe.ops.expert_block import _swiglu
from turbo_moe.ops.expert_block import swiglu as swiglu_fused


def _grads(fn, h, g):
    return jax.vjp(fn, h)[1](g)[0]


def test_forward_and_gradient_equal_autodiff_in_float32():
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((3, 50, 2 * 24)) * 3, jnp.float32)  # large |gate|: both sigmoid tails
    g = jnp.asarray(rng.standard_normal((3, 50, 24)), jnp.float32)
    np.testing.assert_array_equal(swiglu_fused(h), _swiglu(h))
    np.testing.assert_allclose(_grads(swiglu_fused, h, g), _grads(_swiglu, h, g), rtol=1e-5, atol=1e-5)


def test_bfloat16_gradient_is_closer_to_float64_than_autodiff():
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.standard_normal((256, 2 * 64)) * 2, jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((256, 64)), jnp.bfloat16)
    with jax.enable_x64(True):
        exact = np.asarray(_grads(_swiglu, h.astype(jnp.float64), g.astype(jnp.float64)))
    ours = np.asarray(_grads(swiglu_fused, h, g), np.float64)
    autodiff = np.asarray(_grads(_swiglu, h, g), np.float64)
    assert np.abs(ours - exact).max() < np.abs(autodiff - exact).max()
    assert np.abs(ours - exact).max() / np.abs(exact).max() < 8e-3  # one bf16 rounding


def test_backward_is_one_concatenate_not_pads():
    h = jnp.ones((8, 16), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda h, g: _grads(swiglu_fused, h, g))(h, jnp.ones((8, 8), jnp.bfloat16)))
    assert "concatenate" in jaxpr and " pad" not in jaxpr, jaxpr
