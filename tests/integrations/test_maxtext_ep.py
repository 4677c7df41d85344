"""Under expert parallelism (MaxText's ici_expert_parallelism = 2 and 4, and 2 with fsdp 2), `turbo_maxtext.enable()`
runs MaxText's routed body on turbo's dispatch -> experts -> combine and gives the output, load-balance loss, bias
update and gradients (input and every parameter) of MaxText's own body; a config it cannot take is counted as a
fallback and still gives MaxText's results.

MaxText's own EP body exchanges rows with `jax.lax.ragged_all_to_all`, which XLA:CPU does not implement: its
reference here runs with that one collective replaced, inside maxtext.layers.moe only, by the same exchange written
with all_gather (each rank takes the rows every sender addressed to it, at the sender's output offsets). The turbo
EP body does not call it. Needs `maxtext` (skipped where it does not import, as in CI)."""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

moe = pytest.importorskip("maxtext.layers.moe", reason="maxtext is not installed (see tests/integrations/"
                          "test_maxtext.py for the packages)")

from tests.integrations.test_maxtext import assert_same, make_config, run_layer  # noqa: E402
from turbo_moe.integrations import maxtext as turbo_maxtext  # noqa: E402
from turbo_moe.integrations.maxtext import _Overlay  # noqa: E402 (a module with some attributes replaced)

EP_KEYS = dict(megablox=False, use_tokamax_gmm=False, load_balance_loss_weight=0.01)
DEEPSEEK_KEYS = dict(model_name="deepseek3-test", override_model_config=True, num_experts=8, num_experts_per_tok=2,
                     base_emb_dim=32, base_moe_mlp_dim=24, base_mlp_dim=24, routed_bias_update_rate=0.01)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    """jax.lax.ragged_all_to_all's semantics from all_gather: rank `me` receives, from every sender s, the rows
    [input_offsets_s[me], + send_sizes_s[me]) of s's operand at output_offsets_s[me] of its own output."""
    assert axis_index_groups is None
    del recv_sizes  # implied by the senders' plans
    me = jax.lax.axis_index(axis_name)
    every = [jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes, output_offsets)]
    rows = jnp.arange(operand.shape[0])
    for src in range(jax.lax.axis_size(axis_name)):
        x, start, size, at = (a[src] for a in every)
        start, size, at = start[me], size[me], at[me]
        sent = (rows >= start) & (rows < start + size)
        output = output.at[jnp.where(sent, rows - start + at, output.shape[0])].set(x, mode="drop")
    return output


@pytest.fixture
def cpu_ragged_all_to_all(monkeypatch):
    """maxtext.layers.moe sees the emulated ragged_all_to_all (CPU only; the real one elsewhere)."""
    if jax.devices()[0].platform == "cpu":
        lax = _Overlay(jax.lax, ragged_all_to_all=emulated_ragged_all_to_all)
        monkeypatch.setattr(moe, "jax", _Overlay(jax, lax=lax))


def layer_results(cfg, n_devices: int):
    """(output, lb_loss, bias_updates, d_inputs, d_params) of RoutedMoE on `n_devices`, loss = sum(output * probe)
    + 3 lb_loss."""
    def objective(outputs, probe):
        out, lb_loss, _ = outputs
        return jnp.sum(out * probe) + (0.0 if lb_loss is None else 3.0 * lb_loss), outputs

    (out, lb_loss, bias_updates), d_x, d_params = run_layer(cfg, n_devices, objective)
    return out, lb_loss, bias_updates, d_x, d_params


def maxtext_and_turbo(cfg, n_devices: int, ep_weights: str = "fused"):
    """(MaxText's own results, turbo's results, turbo_maxtext.stats() of the turbo run)."""
    turbo_maxtext.disable()
    ref = layer_results(cfg, n_devices)
    turbo_maxtext.reset_stats()
    with turbo_maxtext.grouped_gemm(ep_weights):
        got = layer_results(cfg, n_devices)
    return ref, got, turbo_maxtext.stats()


def assert_same_results(got, ref):
    for name, a, b in zip(("output", "lb_loss", "bias_updates", "d_inputs", "d_params"), got, ref):
        assert (a is None) == (b is None), name
        assert_same(a, b, name)
    if ref[1] is not None:  # the loss is small: relative to itself, not to 1
        np.testing.assert_allclose(float(got[1]), float(ref[1]), rtol=2e-5, err_msg="lb_loss")


CASES = {  # name: (devices, config keys, ep_weights)
    "softmax_ep2": (2, dict(ici_expert_parallelism=2), "fused"),
    "softmax_ep2_split": (2, dict(ici_expert_parallelism=2), "split"),
    "softmax_ep4": (4, dict(ici_expert_parallelism=4), "fused"),
    "deepseek_ep2": (2, dict(ici_expert_parallelism=2, **DEEPSEEK_KEYS), "fused"),
    "deepseek_ep2_split": (2, dict(ici_expert_parallelism=2, **DEEPSEEK_KEYS), "split"),
    # the batch over both axes; prefuse_moe_weights: MaxText's wi_0 / wi_1 are halves of one (E, D, 2F) parameter
    "softmax_fsdp2_ep2": (4, dict(ici_expert_parallelism=2, ici_fsdp_parallelism=2, prefuse_moe_weights=True),
                          "fused"),
}


def needs_devices(n: int) -> None:
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices (XLA_FLAGS=--xla_force_host_platform_device_count={n})")


@pytest.mark.parametrize("case", CASES)
def test_ep_body_on_turbo_gives_maxtexts_results(cpu_ragged_all_to_all, case):
    """softmax: MaxText's default top-k softmax router with its Switch-style loss; deepseek: DeepSeek-V3's sigmoid
    router with the aux-free routed bias (its bias update), routed scaling and the loss on pre-bias scores.
    ep_weights "fused": turbo's expert block on the concatenated gate/up; "split": three grouped GEMMs."""
    n_devices, keys, ep_weights = CASES[case]
    needs_devices(n_devices)
    cfg = make_config(n_devices, **EP_KEYS, **keys)
    ref, got, stats = maxtext_and_turbo(cfg, n_devices, ep_weights)
    assert stats.get("turbo_ep:sparse_matmul", 0) >= 1, stats
    assert not any(k.startswith(("fallback", "turbo:")) for k in stats), stats  # MaxText's GEMMs never ran
    out, lb_loss, bias_updates = ref[:3]
    assert float(jnp.abs(out).max()) > 0 and lb_loss is not None and float(lb_loss) > 0  # something was computed
    assert (bias_updates is not None) == case.startswith("deepseek")
    if bias_updates is not None:
        assert float(jnp.abs(bias_updates).max()) > 0
    assert_same_results(got, ref)


@pytest.mark.parametrize("keys,n_devices,reason", [
    (dict(mlp_bias=True), 2, "expert_bias"),
    (dict(ici_context_parallelism=2), 4, "batch_not_split"),  # the sequence split over a second axis
])
def test_a_config_the_ep_body_cannot_take_falls_back(cpu_ragged_all_to_all, keys, n_devices, reason):
    """MaxText's own EP body runs (its GEMMs on turbo), counted with the reason, and gives its own results."""
    needs_devices(n_devices)
    cfg = make_config(n_devices, ici_expert_parallelism=2, **keys, **EP_KEYS)
    ref, got, stats = maxtext_and_turbo(cfg, n_devices)
    assert stats.get(f"fallback_ep:{reason}", 0) >= 1 and "turbo_ep:sparse_matmul" not in stats, stats
    assert stats.get("turbo:ragged_dot", 0) >= 3, stats  # wi_0, wi_1, wo still on turbo
    assert_same_results(got, ref)


def test_an_unknown_ep_weights_is_refused():
    with pytest.raises(ValueError, match="ep_weights"):
        turbo_maxtext.enable(ep_weights="interleaved")
    assert not turbo_maxtext.is_enabled()


def test_enabling_again_with_other_options_is_refused():
    turbo_maxtext.enable()
    try:
        turbo_maxtext.enable()  # the same options: nothing changes
        with pytest.raises(ValueError, match="already on with ep_weights='fused'"):
            turbo_maxtext.enable(ep_weights="split")
        assert turbo_maxtext.is_enabled()
    finally:
        turbo_maxtext.disable()
    assert not turbo_maxtext.is_enabled()


def test_disable_restores_maxtexts_sparse_matmul():
    own = moe.RoutedMoE.__dict__["sparse_matmul"]
    with turbo_maxtext.grouped_gemm():
        assert moe.RoutedMoE.__dict__["sparse_matmul"] is not own
    assert moe.RoutedMoE.__dict__["sparse_matmul"] is own
