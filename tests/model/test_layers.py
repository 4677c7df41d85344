"""The attention layers (`turbo_moe.model.layers`).

- RoPE and the attention's head splits with written-out backwards (`apply_rope`, `split_last`): the gradients of
  autodiff, and the attention's backward built without pads (autodiff's pad + pad + add fused into loops that read
  every operand at every element).
- `causal_attention`'s impl: "auto" (what the model runs) and "cudnn_unpadded" are the GPU's cuDNN call with v at its
  own width; elsewhere both are XLA's attention (here, on the CPU)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from turbo_moe.model import get_config
from turbo_moe.model.layers import _rope, apply_rope, causal_attention, rope_tables, split_last


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_gradient_equals_autodiff(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 9, 3, 16)), dtype)
    g = jnp.asarray(rng.standard_normal((2, 9, 3, 16)), dtype)
    cos, sin = rope_tables(9, 16, 10000.0)
    np.testing.assert_array_equal(apply_rope(x, cos, sin), _rope(x, cos, sin, inverse=False))
    ours = jax.vjp(lambda a: apply_rope(a, cos, sin), x)[1](g)[0]
    theirs = jax.vjp(lambda a: _rope(a, cos, sin, inverse=False), x)[1](g)[0]
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(theirs, np.float32), rtol=1e-6, atol=1e-6)


def test_split_last_gradient_is_the_concatenated_cotangents():
    x = jnp.arange(2 * 3 * 10, dtype=jnp.float32).reshape(2, 3, 10)
    weights = [jnp.full((2, 3, n), float(i + 1)) for i, n in enumerate((4, 1, 5))]
    loss = lambda parts: sum(jnp.sum(p * w) for p, w in zip(parts, weights))
    ours = jax.grad(lambda a: loss(split_last(a, (4, 1, 5))))(x)
    theirs = jax.grad(lambda a: loss((a[..., :4], a[..., 4:5], a[..., 5:])))(x)
    np.testing.assert_array_equal(ours, theirs)
    with pytest.raises(ValueError, match="sizes .* must add up to the last dim 10"):
        split_last(x, (4, 4))


def _pads_of_attention_gradient(layers_module):
    """The last-dim (low, high) paddings of every pad in the jaxpr of the attention's gradient, at head dims that
    tell the splits' pads (8, 16, 24 wide) from v's own pad to the qk width (12)."""
    cfg = get_config("tiny", qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
    graphdef, state = nnx.split(layers_module.MLAttention(cfg, rngs=nnx.Rngs(0)))
    cos, sin = rope_tables(16, cfg.qk_rope_head_dim, cfg.rope_theta)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x, cos, sin).astype(jnp.float32))

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, jnp.ones((2, 16, cfg.d_model), jnp.float32)))
    jaxpr = re.sub(r"np\.int64\((-?\d+)\)", r"\1", jaxpr)  # (np.int64(0), np.int64(12), 0) -> (0, 12, 0)
    configs = re.findall(r"pad\[\s*padding_config=\((.*?)\)\s*\]", jaxpr, flags=re.S)
    return [tuple(int(v) for v in re.findall(r"-?\d+", c.split("), (")[-1])[:2]) for c in configs]


def test_attention_backward_pads_only_v():
    from turbo_moe.model import layers

    pads = _pads_of_attention_gradient(layers)
    assert pads and set(pads) <= {(0, 12), (0, -12)}, pads  # v to the qk width (24) and that pad's transpose


@pytest.mark.parametrize("impl", ["auto", "cudnn_unpadded"])
def test_attention_impl_falls_back_to_xla_off_the_gpu(impl):
    rng = np.random.default_rng(0)
    q, k = (jnp.asarray(rng.standard_normal((2, 12, 3, 24)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((2, 12, 3, 16)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, 12, 3, 16)), jnp.float32)
    outs = {name: jax.vjp(lambda *a, name=name: causal_attention(*a, name), q, k, v) for name in ("xla", impl)}
    np.testing.assert_array_equal(outs[impl][0], outs["xla"][0])
    for a, b in zip(outs[impl][1](g), outs["xla"][1](g)):
        np.testing.assert_array_equal(a, b)
    assert outs["xla"][0].shape == (2, 12, 3, 16)

