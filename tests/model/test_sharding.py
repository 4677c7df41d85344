"""Sharding declared on the parameters (logical axes metadata) and the ZeRO-3 / FSDP rule."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from tests.model.conftest import micro_config
from turbo_moe.model import DeepSeekModel, get_config
from turbo_moe.model.sharding import logical_axes, partition_spec
from turbo_moe.train import TrainConfig
from turbo_moe.train.step import build_program, make_mesh, make_optimizer


def test_partition_spec_rule():
    mesh = {"data": 2, "expert": 4}
    # Routed experts: E over expert, the largest other dim over data; the layer axis never split.
    assert partition_spec((3, 8, 64, 96), ("layer", "expert", None, None), mesh) == P(None, "expert", None, "data")
    # Everything else over all devices on its largest divisible dim.
    assert partition_spec((32768, 1280), (None, None), mesh) == P(("data", "expert"), None)
    assert partition_spec((3, 1280, 100), ("layer", None, None), mesh) == P(None, ("data", "expert"), None)
    # Nothing divides: replicated. fsdp=False: only the expert dim is split.
    assert partition_spec((3, 7), ("layer", None), mesh) == P(None, None)
    assert partition_spec((4096, 1280), (None, None), mesh, fsdp=False) == P(None, None)
    assert partition_spec((8, 64, 96), ("expert", None, None), mesh, fsdp=False) == P("expert", None, None)
    # One device per axis: nothing to split.
    assert partition_spec((8, 64), ("expert", None), {"data": 1, "expert": 1}) == P(None, None)
    with pytest.raises(ValueError, match="expert dim 6"):
        partition_spec((6, 64, 96), ("expert", None, None), mesh)


def test_stacked_parameters_declare_layer_and_expert_axes():
    cfg = get_config("tiny", n_layers=4, n_dense_layers=2, max_seq_len=16)
    model = nnx.eval_shape(lambda: DeepSeekModel(cfg, rngs=nnx.Rngs(0)))
    experts = model.moe_layers.blocks.ffn.experts
    assert logical_axes(experts.w_gate_up) == ("layer", "expert", None, None)
    assert experts.w_gate_up.shape[:2] == (2, model.cfg.n_experts)
    assert logical_axes(model.dense_layers.blocks.attn.wo.kernel) == ("layer", None, None)
    assert logical_axes(model.mtp[0].block.ffn.experts.w_down) == ("expert", None, None)  # not stacked
    assert model.moe_layers.blocks.ffn.router.bias.shape == (2, model.cfg.n_experts)


@pytest.mark.parametrize("fsdp", [True, False])
def test_train_state_bytes_per_device_shrink_with_fsdp(fsdp):
    """On 8 devices (data 4 x expert 2) FSDP keeps about 1/8 of the state on each device."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    cfg = micro_config(moe_path="ragged", d_model=64, vocab_size=512)
    tx = make_optimizer(TrainConfig(model=cfg, dataset="synthetic"))
    program = build_program(cfg, tx, make_mesh(jax.devices()[:8], expert_parallel=2), fsdp)
    abstract = jax.eval_shape(program.init, jax.random.key(0))
    shardings = program.init.lower(jax.random.key(0)).compile().output_shardings
    total = per_device = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        nbytes = leaf.size * leaf.dtype.itemsize
        total += nbytes
        per_device += np.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    ratio = per_device / total
    if fsdp:
        assert ratio < 1 / 8 * 1.05, f"FSDP keeps {ratio:.3f} of the state on a device"
    else:
        assert ratio > 0.5, f"without FSDP only the experts are split: {ratio:.3f}"
