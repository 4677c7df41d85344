"""`TrainConfig.deterministic` on the CPU: the field (validated, recorded), the XLA options it compiles with on each
platform, XLA_FLAGS that would change the program unrecorded refused, cuDNN attention backwards marked in a lowered
module, the state digest (bit-exact, whatever the sharding), and a `tiny` run that repeats bit for bit.
The GPU side (each op repeated, XLA's crash): tests/gpu/test_determinism_gpu.py."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from turbo_moe.train import TrainConfig, run
from turbo_moe.train import determinism, step


def test_the_field_is_validated_and_recorded():
    with pytest.raises(ValueError, match="TrainConfig.deterministic: must be a bool"):
        TrainConfig(deterministic="yes")
    tc = TrainConfig(deterministic=True)
    assert tc.to_dict()["deterministic"] is True
    assert TrainConfig.from_dict(tc.to_dict()) == tc
    assert tc.replace(seed=1).deterministic and not TrainConfig().deterministic


def test_options_per_platform():
    assert determinism.compiler_options(True, "gpu") == determinism.GPU_OPTIONS == {"xla_gpu_deterministic_ops": True}
    assert determinism.compiler_options(True, "cpu") == {} and determinism.compiler_options(False, "gpu") == {}
    assert step.compiler_options(0, True, "gpu") == {"xla_gpu_deterministic_ops": True, "xla_gpu_autotune_level": 0}
    assert step.compiler_options(None, True, "cpu") is None and step.compiler_options(None, False, "gpu") is None


@pytest.mark.parametrize("flags", ["--xla_gpu_deterministic_ops=true", "--a=1 --xla_gpu_exclude_nondeterministic_ops"])
def test_determinism_flags_in_xla_flags_are_refused(flags):
    with pytest.raises(ValueError, match="TrainConfig.deterministic"):
        determinism.check_xla_flags(False, flags)
    determinism.check_xla_flags(False, "--xla_force_host_platform_device_count=8")  # others pass


def test_attention_backwards_are_marked_in_place():
    from jax._src.interpreters import mlir

    config = json.dumps({"operation_queue_id": "0", "cudnn_fmha_backend_config": {"fmha_scale": 0.125}})
    escaped = config.replace('"', "\\22")
    t = "tensor<2x8x2x16xbf16>"
    text = f"""func.func @main(%q: {t}) -> ({t}, {t}, {t}) {{
      %0 = stablehlo.custom_call @"__cudnn$fmhaSoftmaxBackward"(%q) {{backend_config = "{escaped}"}} : ({t}) -> {t}
      %1 = stablehlo.custom_call @"__cudnn$fmhaSoftmax"(%q) {{backend_config = "{escaped}"}} : ({t}) -> {t}
      %2 = stablehlo.custom_call @other(%q) : ({t}) -> {t}
      return %0, %1, %2 : {t}, {t}, {t}
    }}"""
    module = mlir.ir.Module.parse(text, context=mlir.make_ir_context())
    assert determinism.mark_attention_deterministic(module) == 1
    ops = list(module.body.operations[0].regions[0].blocks[0].operations)
    backward, forward = (json.loads(op.attributes["backend_config"].value) for op in ops[:2])
    assert backward["cudnn_fmha_backend_config"] == {"fmha_scale": 0.125, "force_deterministic": True}
    assert forward == json.loads(config) and backward["operation_queue_id"] == "0"


def test_state_digest_is_bit_exact_and_independent_of_sharding():
    rng = np.random.default_rng(0)
    state = {"w": jnp.asarray(rng.standard_normal((64, 32)), jnp.float32), "b": jnp.ones((8,), jnp.bfloat16),
             "step": jnp.int32(7), "none": None, "key": jax.random.key(1)}
    digest = determinism.state_digest(state)
    assert digest == determinism.state_digest(jax.tree.map(lambda x: x + 0 if x.dtype != state["key"].dtype else x,
                                                           state))
    flipped = state["w"].at[3, 5].set(jnp.nextafter(state["w"][3, 5], jnp.inf))  # one ulp
    assert determinism.state_digest({**state, "w": flipped}) != digest
    assert determinism.state_digest({**state, "w": state["w"].T}) != digest  # same values, other layout
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("d",))
    sharded = {**state, "w": jax.device_put(state["w"], NamedSharding(mesh, P("d")))}
    assert determinism.state_digest(sharded) == digest


def test_a_deterministic_tiny_run_repeats_bit_for_bit():
    config = TrainConfig(model="tiny", model_overrides={"n_layers": 2, "mtp_depth": 0}, dataset="synthetic",  # cheap
                         per_device_batch=1, seq_len=16, steps=3, warmup_steps=1, eval_batches=0, progress=False, seed=2,
                         deterministic=True)
    runs = [run(config) for _ in range(2)]
    assert all(r.status == "ok" for r in runs), [r.error for r in runs]
    losses, norms = ([[row[key] for row in r.history] for r in runs] for key in ("loss", "grad_norm"))
    digests = [r.summary["state_digest"] for r in runs]
    assert losses[0] == losses[1] and norms[0] == norms[1] and digests[0] == digests[1]
    assert runs[0].provenance["config"]["deterministic"] is True
