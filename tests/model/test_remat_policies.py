"""remat_policy "dots_experts_attention": same loss and gradients, and the expert GEMMs and the routing are not
run again.

Under "dots_no_batch" the routed experts' grouped GEMMs (FFI calls, not dots) run a second time in the
backward pass to rebuild their outputs; the new policy saves those outputs (named in
`turbo_moe.model.experts.expert_ffn`), so the compiled step holds fewer grouped-GEMM calls.
"""

import re

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import micro_config, model_paths_with, requires_turbo
from turbo_moe.model import DeepSeekModel, lm_loss


def make_batch(cfg, batch=2, seq=16):
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab_size)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def grad_fn():
    return nnx.jit(nnx.value_and_grad(lm_loss, has_aux=True))


def compiled_hlo(cfg) -> str:
    model = DeepSeekModel(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def loss(state, batch):
        return lm_loss(nnx.merge(graphdef, state), batch)[0]

    return jax.jit(jax.grad(loss)).lower(state, make_batch(cfg)).compile().as_text()


@pytest.mark.parametrize("path", ["dense_cf", pytest.param("turbo", marks=requires_turbo)])
def test_policy_keeps_loss_and_grads(path):
    base = dict(dtype="float32", moe_path=path, capacity_factor=8.0)
    batch = make_batch(micro_config(**base))
    (ref_loss, _), ref_grads = grad_fn()(DeepSeekModel(micro_config(**base), rngs=nnx.Rngs(0)), batch)
    cfg = micro_config(**base, remat_policy="dots_experts_attention")
    (loss, _), grads = grad_fn()(DeepSeekModel(cfg, rngs=nnx.Rngs(0)), batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)


@requires_turbo
@pytest.mark.parametrize("expert_backward, rebuilt", [("autodiff", 4), ("block", 2)])
def test_policy_does_not_run_the_expert_gemms_again(expert_backward, rebuilt, monkeypatch):
    # the model runs the expert block; the ops' own VJPs ("autodiff") through the path's reference argument
    if expert_backward == "autodiff":
        model_paths_with(monkeypatch, expert_backward="autodiff")
    # forward + data gradient use the same FFI target (with the SwiGLU kernels, on GPUs, the block's gate/up forward
    # is the fused one with SwiGLU); the weight gradient has its own
    gemm_calls = lambda hlo: len(re.findall(r'custom_call_target="turbo_moe_grouped_gemm(_swiglu)?"', hlo))
    counts = {policy: gemm_calls(compiled_hlo(micro_config(moe_path="turbo", remat_policy=policy)))
              for policy in ("none", "dots_no_batch", "dots_experts_attention")}
    # Two MoE blocks (the MoE layer and the MTP block), two GEMMs each: 2 x 2 forward + 2 x 2 data gradient.
    assert counts["none"] == 8, counts
    # + the forward GEMMs rebuilt in the backward pass: all 4 for autodiff; the block's backward needs no down
    # GEMM output (turbo_moe.model.expert_block), so only the 2 gate/up ones
    assert counts["dots_no_batch"] == 8 + rebuilt, counts
    assert counts["dots_experts_attention"] == 8, counts


@requires_turbo
def test_policy_does_not_run_the_routing_again():
    """The routing's int32 results are saved too (the router's picks, the permute's row index, the group sizes):
    under "dots_experts_attention" the backward pass runs neither the permute nor the router's selection (here
    causal centering + the sequence load penalty's chunk walk) a second time, as with no remat at all."""
    def counts(policy, penalty):
        cfg = micro_config(moe_path="turbo", remat_policy=policy, router_center_causal=True,
                           router_seq_load_penalty=penalty, router_seq_load_chunk=4)
        hlo = compiled_hlo(cfg)
        return (len(re.findall(r'custom_call_target="turbo_moe_permute"', hlo)), len(re.findall(r"compare\(", hlo)))

    permutes = {policy: counts(policy, 0.1)[0] for policy in ("none", "dots_no_batch", "dots_experts_attention")}
    assert permutes["dots_no_batch"] > permutes["none"], permutes  # rebuilt there (else the test shows nothing)
    assert permutes["dots_experts_attention"] == permutes["none"], permutes
    # the compare ops the penalty's walk adds: once per MoE block without remat, and no more with the policy
    walk = {policy: counts(policy, 0.1)[1] - counts(policy, 0.0)[1] for policy in ("none", "dots_experts_attention")}
    assert walk["none"] > 0 and walk["dots_experts_attention"] == walk["none"], walk


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="remat_policy"):
        micro_config(remat_policy="dots_experts")
