"""Budgets behind 03_full_deepseek and the problem builder behind 01_ops (no kernel, no FFI)."""

import pytest

from turbo_moe.experiments import accounting
from turbo_moe.experiments.notebooks import ops as ops_check
from turbo_moe.model import count_params, get_config
from turbo_moe.model.paths import expert_capacity


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_analytic_parameter_count_matches_the_model(preset):
    cfg = get_config(preset)
    analytic = accounting.routed_expert_params(cfg) + accounting._other_params_estimate(cfg)
    assert analytic == pytest.approx(count_params(cfg)["total_with_mtp"], rel=0.01)


@pytest.mark.parametrize("preset", ["tiny", "reduced", "deepseek_v3_671b"])
def test_moe_blocks_count_the_mtp_blocks(preset):
    cfg = get_config(preset)
    assert accounting.moe_blocks_with_mtp(cfg) == cfg.n_moe_layers + cfg.mtp_depth


@pytest.mark.parametrize("seq_len, cf", [(32, 1.0), (64, 1.25), (128, 2.0)])
def test_capacity_matches_the_dense_cf_path(seq_len, cf):
    cfg = get_config("tiny", capacity_factor=cf)
    assert accounting.capacity(cfg, seq_len) == expert_capacity(seq_len, cfg.top_k, cfg.n_experts, cf)


def test_paths_differ_where_they_should():
    cfg = get_config("small", capacity_factor=1.25, dtype="bfloat16")  # pallas computes in bfloat16
    table = accounting.full_model_table(cfg, accounting.MeshShape(), per_device_batch=4, seq_len=128)
    assert table.loc["ragged", "executed GFLOP/token"] == table.loc["ragged", "useful GFLOP/token"]
    # the expert block (turbo and pallas: the permute exchange) keeps less for the backward than ragged's autodiff
    for dropless in ("turbo", "pallas"):
        assert table.loc[dropless, "total GiB/device"] < table.loc["ragged", "total GiB/device"]
        assert table.loc[dropless, "executed GFLOP/token"] == table.loc["ragged", "executed GFLOP/token"]
    assert table.loc["dense_cf", "executed GFLOP/token"] > table.loc["dense_cf", "useful GFLOP/token"]
    assert table.loc["dense_cf", "MoE layer working set GiB"] > table.loc["ragged", "MoE layer working set GiB"]


def test_states_shard_over_the_mesh():
    cfg = get_config("small")
    one = accounting.state_bytes_per_device(cfg, accounting.MeshShape())
    assert accounting.state_bytes_per_device(cfg, accounting.MeshShape(data=4, expert=2)) == pytest.approx(one / 8)
    replicated = accounting.state_bytes_per_device(cfg, accounting.MeshShape(data=4, fsdp=False))
    assert replicated == pytest.approx(one)
    with pytest.raises(ValueError, match="MeshShape.expert: must be a positive int"):
        accounting.MeshShape(expert=0)


def test_experts_that_fit_grows_with_memory():
    cfg = get_config("small")
    small, large = (accounting.experts_that_fit(cfg, m, 4, 128) for m in (2**27, 2**33))
    assert 0 <= small <= large == cfg.n_experts
    assert accounting.experts_that_fit(cfg, 1.0, 4, 128) == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [({"dtype": "int8"}, "parameter dtype"), ({"routing": "zipf"}, "parameter routing"),
     ({"top_k": 9}, "parameter top_k: 9 > num_experts=8"), ({"hidden": 0}, "parameter hidden")],
)
def test_ops_problem_rejects_bad_parameters(kwargs, message):
    args = {"num_tokens": 16, "hidden": 8, "ffn": 8, "num_experts": 8, "top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        ops_check.make_problem(args.pop("num_tokens"), args.pop("hidden"), args.pop("ffn"),
                               args.pop("num_experts"), args.pop("top_k"), **args)


def test_empty_groups_routing_leaves_experts_unused():
    p = ops_check.make_problem(64, 8, 8, 8, 2, routing="empty_groups")
    assert set(p.expert_ids.ravel().tolist()) <= set(range(4))
    assert p.weights.sum(axis=1) == pytest.approx(1.0)
