"""ModelConfig.cast_params_before_scan (issue 14 cut): the stacked matmul weights are cast to the compute
dtype once before the layer scan. Rounding to bfloat16 commutes with slicing a layer out, and the cast's
gradient (a cast back) commutes with stacking the per-layer gradients, so loss and gradients must be
bit-identical to casting each layer's slice inside the scan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import requires_turbo
from turbo_moe.model import DeepSeekModel, get_config, lm_loss
from turbo_moe.model.stack import cast_stacked_weights


def _config(**overrides):
    # bfloat16 compute, float32 params (tiny's defaults); 2 MoE blocks in the scanned stack + an MoE MTP block
    return get_config("tiny", n_layers=3, max_seq_len=16, capacity_factor=1.0, **overrides)


def _loss_and_grads(cfg):
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    (loss, metrics), grads = nnx.jit(nnx.value_and_grad(lm_loss, has_aux=True))(model, batch)
    return loss, metrics, nnx.to_flat_state(grads)


def _case(path, scan_layers, remat="none"):
    marks = requires_turbo if path == "turbo" else ()
    name = f"{path}-{'scan' if scan_layers else 'unrolled'}-{remat}"
    return pytest.param(path, scan_layers, remat, marks=marks, id=name)


# Each path once scanned, the unrolled stack once (the cast is the same code for both paths' experts), and
# turbo scanned under `reduced`'s remat policy (the cast sits outside the rematerialised block); CI time.
@pytest.mark.parametrize("path, scan_layers, remat", [
    _case("dense_cf", True), _case("turbo", False),
    _case("turbo", True, "dots_no_batch"),
])
def test_loss_and_grads_bit_identical(path, scan_layers, remat):
    cfg = _config(moe_path=path, scan_layers=scan_layers, remat_policy=remat)
    loss, metrics, grads = _loss_and_grads(cfg)
    cast_loss, cast_metrics, cast_grads = _loss_and_grads(cfg.replace(cast_params_before_scan=True))
    np.testing.assert_array_equal(cast_loss, loss)
    np.testing.assert_array_equal(cast_metrics["expert_load"], metrics["expert_load"])
    assert len(grads) == len(cast_grads)
    for (name, g), (cast_name, c) in zip(grads, cast_grads):
        assert name == cast_name and c[...].dtype == g[...].dtype == jnp.float32
        np.testing.assert_array_equal(c[...], g[...], err_msg=f"{path}: {name}")


def test_only_the_weights_cast_at_use_are_cast():
    cfg = _config(moe_path="dense_cf")
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    stack = model.moe_layers
    _, state = nnx.split(stack.blocks)
    cast = {path: var[...] for path, var in nnx.to_flat_state(cast_stacked_weights(stack.blocks, state, jnp.bfloat16))}
    bf16 = {path for path, value in cast.items() if value.dtype == jnp.bfloat16}
    assert bf16 == {
        ("attn", name, "kernel") for name in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")} | {
        ("ffn", "shared", name, "kernel") for name in ("wi_gate", "wi_up", "wo")} | {
        ("ffn", "experts", "w_gate_up"), ("ffn", "experts", "w_down")}
    # norm scales, the float32 router gate and its bias stay float32, each with its stacked shape
    for path in (("attn_norm", "scale"), ("attn", "kv_norm", "scale"), ("ffn", "router", "kernel"),
                 ("ffn", "router", "bias")):
        assert cast[path].dtype == jnp.float32
    original = dict(nnx.to_flat_state(state))
    for path, value in cast.items():
        assert value.shape == original[path][...].shape
        np.testing.assert_array_equal(value, original[path][...].astype(value.dtype))
    assert original[("attn", "wo", "kernel")][...].dtype == jnp.float32  # the model's own state is untouched


def test_the_scans_read_bfloat16_weights():
    def scan_weight_dtypes(cfg):  # dtypes of the (L, ...) matrices each layer scan slices
        graphdef, state = nnx.split(DeepSeekModel(cfg, rngs=nnx.Rngs(0)))
        jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(jnp.zeros((1, 8), jnp.int32)).logits)(state)
        scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        return [sorted(str(v.aval.dtype) for v in e.invars if v.aval.ndim >= 3 and v.aval.shape[0] == 3)
                for e in scans]

    cfg = _config(moe_path="dense_cf", n_dense_layers=0, mtp_depth=0)  # one stack of 3 MoE blocks
    # (3, ...) weights: 5 attention, 3 shared expert, 2 routed experts, the router gate; h (1, 8, 64) is not one
    assert scan_weight_dtypes(cfg) == [["float32"] * 11]
    assert scan_weight_dtypes(cfg.replace(cast_params_before_scan=True)) == [["bfloat16"] * 10 + ["float32"]]


def test_validation_and_presets():
    with pytest.raises((TypeError, ValueError), match="ModelConfig.cast_params_before_scan"):
        _config(cast_params_before_scan=1)
    assert all(get_config(name).cast_params_before_scan is False  # presets keep today's behaviour
               for name in ("tiny", "small", "reduced", "deepseek_v3_671b"))
