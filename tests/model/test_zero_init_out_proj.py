"""ModelConfig.zero_init_out_proj (issue 13): the projections back into the residual stream start at zero,
so every block starts as the identity; nothing else changes and training moves them off zero."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from turbo_moe.model import DeepSeekModel, get_config, lm_loss

OUT_PROJECTIONS = ("wo", "w_down")


def _flat_params(model):
    return {tuple(str(p) for p in path): leaf[...] for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _is_out(path):
    return any(name in path for name in OUT_PROJECTIONS)


@pytest.mark.parametrize("moe_path", ["ragged", "dense_cf"])
def test_blocks_start_as_identity_and_nothing_else_changes(moe_path):
    cfg = get_config("tiny", moe_path=moe_path, dtype="float32")
    plain = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    zero = DeepSeekModel(cfg.replace(zero_init_out_proj=True), rngs=nnx.Rngs(0))
    plain_params, zero_params = _flat_params(plain), _flat_params(zero)
    assert plain_params.keys() == zero_params.keys()
    outs = [path for path in zero_params if _is_out(path)]
    # attention + SwiGLU wo in the dense and MoE stacks and the MTP block, the experts' w_down
    assert len(outs) >= 5 and any("w_down" in p for p in outs) and any("mtp" in p for p in outs)
    for path, value in zero_params.items():
        if _is_out(path):
            np.testing.assert_array_equal(value, 0.0, err_msg=str(path))
            assert float(jnp.max(jnp.abs(plain_params[path]))) > 0
        else:
            np.testing.assert_array_equal(value, plain_params[path], err_msg=str(path))
    inputs = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    expected = zero.logits(zero.final_norm(zero.embed(inputs)))  # every block the identity
    np.testing.assert_allclose(zero(inputs).logits, expected, rtol=1e-5, atol=1e-6)


def test_training_moves_the_zero_projections():
    cfg = get_config("tiny", moe_path="ragged", dtype="float32", zero_init_out_proj=True)
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    for _ in range(2):  # step 1 moves the last wo (its input is non-zero); step 2 the ones behind it
        grads = nnx.grad(lambda m: lm_loss(m, batch)[0])(model)
        optimizer.update(model, grads)
    for path, value in _flat_params(model).items():
        if _is_out(path) and "mtp" not in path:
            assert float(jnp.max(jnp.abs(value))) > 0, path


def test_validation():
    with pytest.raises(TypeError, match="ModelConfig.zero_init_out_proj expects bool, got 1"):
        get_config("tiny", zero_init_out_proj=1)
    assert all(not get_config(name).zero_init_out_proj for name in ("tiny", "small", "deepseek_v3_671b"))
    assert get_config("reduced").zero_init_out_proj  # the issue-13 routing recipe
