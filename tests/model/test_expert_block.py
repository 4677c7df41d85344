"""The expert block (`turbo_moe.model.expert_block`), what the model runs on the paths with the permute exchange: one
custom VJP over permute -> experts -> unpermute. Its outputs and gradients equal the float32 reference and the ops' own
VJPs (`moe_path_fn(..., expert_backward="autodiff")`; dropped copies, experts with no rows, token counts that are not
multiples of 8, skewed routing), with the gate/up GEMM and SwiGLU as one call (`swiglu_impl="kernel"`, the GPU's
"auto") or two, and it keeps neither the permuted rows nor the down GEMM's output for the backward pass, without
running any grouped GEMM twice."""

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
from turbo_moe.model import DeepSeekModel, ExpertWeights, get_config, lm_loss, moe_path_fn
from turbo_moe.model.gemms import GEMMS, SWIGLU_KERNELS
from turbo_moe.model.paths import ExpertFfn

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


def _exchange(block: bool, fused: bool = False):
    from turbo_moe.model.exchanges import permute_exchange

    def run(tokens, ids, combine_w, w_gu, w_down):
        ffn = ExpertFfn(ExpertWeights(w_gu, w_down), GEMMS["turbo"], block, SWIGLU_KERNELS["turbo"] if fused else None)
        return permute_exchange(tokens, ids, combine_w, w_gu.shape[0], ffn)
    return run


@pytest.mark.parametrize("fused", [False, True], ids=["swiglu_xla", "swiglu_kernel"])
@pytest.mark.parametrize("routing", ["random", "skewed", "dropped"])
def test_block_equals_the_ops_own_vjps(routing, fused):
    t, k, d, f, e = 13, 3, 24, 12, 6  # T*k = 39 rows: no multiple of 8
    keys = jax.random.split(jax.random.key(7), 6)
    tokens = jax.random.normal(keys[0], (t, d))
    ids = jax.random.randint(keys[1], (t, k), 0, e)
    if routing == "skewed":  # every copy on experts 0 and 1: four experts get no rows
        ids = jnp.where(jnp.arange(k) == 0, 0, 1) * jnp.ones((t, 1), jnp.int32)
    if routing == "dropped":  # ids outside [0, E) drop their copies; token 0 loses all of them
        ids = ids.at[0].set(-1).at[3, 1].set(e).at[5, 2].set(e + 3)
    combine_w = jax.random.uniform(keys[2], (t, k), minval=0.1, maxval=1.0)
    w_gu = jax.random.normal(keys[3], (e, d, 2 * f)) * 0.3
    w_down = jax.random.normal(keys[4], (e, f, d)) * 0.3
    cot = jax.random.normal(keys[5], (t, d))

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a)[0] * cot)

    args = (tokens, ids, combine_w, w_gu, w_down)
    argnums = (0, 2, 3, 4)
    (y_ref, n_ref), (y, n) = (jax.jit(_exchange(b, b and fused))(*args) for b in (False, True))
    np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
    assert int(n) == int(n_ref)
    want = jax.jit(jax.grad(loss(_exchange(False)), argnums))(*args)
    got = jax.jit(jax.grad(loss(_exchange(True, fused)), argnums))(*args)
    for name, g, w in zip(("tokens", "combine_w", "w_gate_up", "w_down"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
    if routing == "dropped":
        assert np.all(np.asarray(got[0][0]) == 0) and np.all(np.asarray(got[1][0]) == 0)  # dropped: no gradient
        assert float(got[1][3, 1]) == 0.0 and float(got[1][5, 2]) == 0.0


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
    from turbo_moe.model import gemms

    assert gemms.swiglu_kernels("turbo", "kernel") is SWIGLU_KERNELS["turbo"]
    assert gemms.swiglu_kernels("turbo", "xla") is None and gemms.swiglu_kernels("ragged_dot", "kernel") is None
    assert gemms.swiglu_kernels("turbo", "auto") is (SWIGLU_KERNELS["turbo"] if jax.default_backend() == "gpu" else None)
    monkeypatch.setattr(gemms.jax, "default_backend", lambda: "gpu")
    assert gemms.swiglu_kernels("turbo", "auto") is SWIGLU_KERNELS["turbo"]
    monkeypatch.setattr(gemms.jax, "default_backend", lambda: "cpu")
    assert gemms.swiglu_kernels("turbo", "auto") is None


def test_bad_shapes():
    from turbo_moe.model.expert_block import expert_block

    weights = ExpertWeights(jnp.zeros((4, 8, 6)), jnp.zeros((4, 3, 8)))
    with pytest.raises(ValueError, match=r"combine_w must be \(T, k\)"):
        expert_block(jnp.zeros((5, 8)), jnp.zeros((5, 2), jnp.int32), jnp.zeros((5, 3)), weights, 4, GEMMS["turbo"])
    with pytest.raises(TypeError, match="expert_ids"):
        expert_block(jnp.zeros((5, 8)), jnp.zeros((5, 2)), jnp.zeros((5, 2)), weights, 4, GEMMS["turbo"])
    with pytest.raises(TypeError, match="tokens"):
        expert_block(jnp.zeros((5, 8), jnp.int32), jnp.zeros((5, 2), jnp.int32), jnp.zeros((5, 2)), weights, 4,
                     GEMMS["turbo"])
    with pytest.raises(TypeError, match="n_experts must be a Python int"):
        expert_block(jnp.zeros((5, 8)), jnp.zeros((5, 2), jnp.int32), jnp.zeros((5, 2)), weights, 4.0, GEMMS["turbo"])
