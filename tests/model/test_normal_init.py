"""model/normal_init.py: the model's normal initializer is flax's outside `one_draw`; inside it every normal
parameter is its own slice of one draw (stacked layers each their own), at its std; the CPU init program uses it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from turbo_moe.model import DeepSeekModel, get_config, normal_init
from turbo_moe.model.mesh import make_mesh
from turbo_moe.train.step import build_program


def test_outside_one_draw_it_is_flax_normal_bit_for_bit():
    key = jax.random.key(4)
    np.testing.assert_array_equal(normal_init.normal(0.3)(key, (5, 7)), nnx.initializers.normal(0.3)(key, (5, 7)))


def test_one_draw_hands_out_disjoint_scaled_slices_and_refuses_to_overrun():
    key = jax.random.key(1)
    flat = jax.random.normal(key, (30,))
    with normal_init.one_draw(key, 30):
        a = normal_init.normal(2.0)(None, (2, 5))
        b = normal_init.normal(0.5)(None, (4,), jnp.bfloat16)
        with pytest.raises(ValueError, match="more than the 30 normal elements"):
            normal_init.normal(1.0)(None, (17,))
    np.testing.assert_allclose(a, 2.0 * flat[:10].reshape(2, 5))
    assert b.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray((0.5 * flat[10:14]).astype(jnp.bfloat16), np.float32))


def test_vmap_layers_gives_each_layer_its_own_row():
    def new_layer(key):
        return {"w": normal_init.normal(1.0)(key, (3, 2)), "v": normal_init.normal(1.0)(key, (4,))}

    keys = jax.random.split(jax.random.key(0), 3)
    assert jax.tree.map(jnp.shape, normal_init.vmap_layers(new_layer, keys)) == {"w": (3, 3, 2), "v": (3, 4)}
    total = normal_init.count_normal(lambda k: normal_init.vmap_layers(new_layer, jax.random.split(k, 3)), keys[0])
    assert total == 3 * (6 + 4)
    flat = jax.random.normal(keys[1], (total,))
    with normal_init.one_draw(keys[1], total):
        got = normal_init.vmap_layers(new_layer, keys)
    rows = flat.reshape(3, 10)
    np.testing.assert_allclose(got["w"], rows[:, :6].reshape(3, 3, 2))
    np.testing.assert_allclose(got["v"], rows[:, 6:])


def test_the_cpu_init_program_draws_once_with_every_parameters_std():
    cfg = get_config("tiny")
    program = build_program(cfg, optax.adamw(1e-3), make_mesh(jax.devices()[:1]))
    state = program.init(jax.random.key(0))
    assert program.init.last_choice.get("normal_draws") == "one"
    params = state.params
    abstract = nnx.eval_shape(lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0)))
    normals = normal_init.count_normal(lambda k: nnx.state(DeepSeekModel(cfg, rngs=nnx.Rngs(k)), nnx.Param),
                                       jax.random.key(0))
    assert normals > 0.9 * sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    gate_up = np.asarray(params["moe_layers"]["blocks"]["ffn"]["experts"]["w_gate_up"][...], np.float32)
    assert gate_up.shape[0] == cfg.n_moe_layers >= 2
    assert not np.array_equal(gate_up[0], gate_up[1])  # each layer its own values
    assert abs(gate_up.std() / cfg.init_std - 1) < 0.05 and abs(gate_up.mean()) < 0.1 * cfg.init_std
    embed = np.asarray(params["embed"]["embedding"][...], np.float32)
    assert abs(embed.std() / cfg.embedding_std - 1) < 0.05
    wo = np.asarray(params["moe_layers"]["blocks"]["attn"]["wo"]["kernel"][...], np.float32)
    assert abs(np.corrcoef(wo.ravel()[:500], gate_up.ravel()[:500])[0, 1]) < 0.2  # no two share a draw
