"""The expert block (`turbo_moe.ops.expert_block`) as the model runs it on the paths with the permute exchange: the
path's outputs and gradients equal the float32 reference and the ops' own VJPs (`moe_path_fn(...,
expert_backward="autodiff")`), with the gate/up GEMM and SwiGLU as one call (`swiglu_impl="kernel"`, the GPU's
"auto") or two, and it keeps neither the permuted rows nor the down GEMM's output for the backward pass, without
running any grouped GEMM twice. The op itself is tested in tests/ops/test_expert_block.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.model.conftest import model_paths_with, requires_turbo
from tests.model.path_cases import fake_pallas  # noqa: F401  (a fixture)
from tests.model.test_moe_paths import (TOLERANCE, make_case, path_loss_and_grads, reference_experts,
                                        reference_loss_and_grads)
from turbo_moe.model import DeepSeekModel, get_config, lm_loss, moe_path_fn
from turbo_moe.model.paths import PATHS, device_gemms

pytestmark = requires_turbo


@pytest.mark.parametrize("expert_backward,swiglu_impl", [("block", "kernel"), ("block", "xla"), ("autodiff", "xla")])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("path", ["turbo", "pallas"])
def test_block_matches_reference_outputs_and_grads(path, dtype, expert_backward, swiglu_impl, request):
    if path == "pallas":
        if dtype == jnp.float32:
            pytest.skip("the Pallas Mosaic-GPU GEMM computes in bfloat16/float16")
        request.getfixturevalue("fake_pallas")
    x, routing, weights, cotangent = make_case()
    fn = moe_path_fn(path, float(weights.n_experts), expert_backward=expert_backward, swiglu_impl=swiglu_impl)
    y, _ = jax.jit(fn)(x.astype(dtype), routing, weights)
    np.testing.assert_allclose(np.asarray(y, np.float32), reference_experts(x.astype(dtype), routing, weights),
                               **TOLERANCE[dtype])
    got = path_loss_and_grads(fn, x, routing, weights, cotangent, dtype)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(reference_loss_and_grads(dtype))):
        scale = float(jnp.max(jnp.abs(w))) or 1.0
        np.testing.assert_allclose(np.asarray(g) / scale, np.asarray(w) / scale, **TOLERANCE[dtype])


def _step(cfg):
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    batch = {k: v for k, v in zip(("inputs", "targets"), (jnp.arange(32).reshape(2, 16) % cfg.vocab_size,) * 2)}
    loss = lambda s: lm_loss(nnx.merge(graphdef, s), batch)[0]
    compiled = jax.jit(jax.value_and_grad(loss)).lower(state).compile()
    return compiled(state), compiled


@pytest.mark.parametrize("swiglu_impl", ["kernel", "model"])
def test_model_step_same_loss_and_grads_no_gemm_twice_fewer_residual_bytes(swiglu_impl, monkeypatch):
    """The model as it runs (the block, "auto" SwiGLU) and the block with the SwiGLU kernels, against the ops' own
    VJPs in the same model."""
    # 4 scanned MoE layers (+ the MTP block): their saved values, stacked over the layers, set the peak
    cfg = get_config("tiny", n_layers=5, max_seq_len=16, moe_path="turbo", remat_policy="dots_experts_attention",
                     dtype="float32")
    with monkeypatch.context() as patch:
        model_paths_with(patch, expert_backward="autodiff")
        (ref_loss, ref_grads), ref_compiled = _step(cfg)
    with monkeypatch.context() as patch:
        if swiglu_impl == "kernel":
            model_paths_with(patch, swiglu_impl="kernel")
        (loss, grads), compiled = _step(cfg)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    calls = lambda c, target: len(re.findall(f'custom_call_target="{target}"', c.as_text()))
    gemm_calls = lambda c: calls(c, "turbo_moe_grouped_gemm") + calls(c, "turbo_moe_grouped_gemm_swiglu")
    # the scanned MoE block and the MTP block, each 2 forward + 2 data-gradient GEMMs in the program text
    assert gemm_calls(compiled) == gemm_calls(ref_compiled) == 8
    # with the kernel (on the CPU "auto" is XLA's SwiGLU), each block's gate/up GEMM is the fused call (the autodiff
    # path never uses it)
    fused = swiglu_impl == "kernel" or jax.default_backend() == "gpu"
    assert calls(compiled, "turbo_moe_grouped_gemm_swiglu") == (2 if fused else 0)
    assert calls(ref_compiled, "turbo_moe_grouped_gemm_swiglu") == 0
    # the autodiff step keeps the permuted rows, the down output and act of every MoE layer; the block none of them
    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    assert temp(compiled) < 0.85 * temp(ref_compiled), (temp(compiled), temp(ref_compiled))


def test_auto_takes_the_kernels_on_gpus_only(monkeypatch):
    from turbo_moe.model import paths

    turbo, ragged = PATHS[("turbo", paths.ONE_DEVICE)], PATHS[("ragged", paths.ONE_DEVICE)]
    fused = lambda row, impl: device_gemms(row, "x", impl).gate_up_swiglu is not None
    assert fused(turbo, "kernel") and not fused(turbo, "xla") and not fused(ragged, "kernel")
    assert fused(turbo, "auto") == (jax.default_backend() == "gpu")
    monkeypatch.setattr(paths.jax, "default_backend", lambda: "gpu")
    assert fused(turbo, "auto")
    monkeypatch.setattr(paths.jax, "default_backend", lambda: "cpu")
    assert not fused(turbo, "auto")
