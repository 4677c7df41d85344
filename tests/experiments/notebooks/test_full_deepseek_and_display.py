"""03's Part 2 plan (exact slice, shrunk slice, user overrides) and the human tables (no kernel)."""

import math

import pytest

from turbo_moe.experiments.notebooks import display, full_deepseek, full_deepseek_slice
from turbo_moe.experiments.notebooks.display import GIB

PLAN = dict(n_layers=4, n_dense_layers=1, n_experts=None, width_divisor=None, model_overrides={}, paths=None,
            per_device_batch=2, seq_len=4096, capacity_factor=1.25)
H200 = full_deepseek_slice.Devices(141e9, "test", "gpu", 1, fp8=True)  # "141 GB"
H200_LIMIT = 138.1e9  # what JAX's allocator gives a process on one H200 at XLA_PYTHON_CLIENT_MEM_FRACTION=0.92


def _gpus(memory_bytes, count=1, fp8=True):
    return full_deepseek_slice.Devices(memory_bytes, "test", "gpu", count, fp8)


def test_one_h200_trains_the_exact_widths_with_all_256_experts():
    for memory in (141e9, H200_LIMIT):
        plan = full_deepseek.plan_slice(**PLAN, devices=_gpus(memory))
        assert plan.exact and plan.expert_parallel == 1 and "d_model" not in plan.overrides
        assert {k: plan.overrides[k] for k in ("n_layers", "n_dense_layers", "mtp_depth", "n_experts")} == {
            "n_layers": 2, "n_dense_layers": 1, "mtp_depth": 0, "n_experts": 256}
        assert plan.overrides["param_dtype"] == "bfloat16" and plan.need_bytes <= memory
        assert plan.label == ("DeepSeek-V3's exact widths: 2 of 61 layers (1 dense + 1 MoE, no MTP block), 256 of 256 "
                              "routed experts, bfloat16 weights")
        assert plan.paths == ("dense_cf", "turbo", "turbo_fp8")  # Hopper runs turbo_fp8; ragged not at these widths
    # The ladder: layers went first (float32 masters, then bfloat16), and every rung before the pick kept 256 experts.
    assert list(plan.ladder["routed experts"]) == [256] * 12 and plan.ladder["fits"].tolist() == [False] * 11 + [True]
    assert plan.ladder["layers"].tolist()[:6] == [4, 4, 3, 3, 2, 2]


def test_smaller_devices_drop_experts_before_widths_and_more_gpus_split_them():
    small = full_deepseek.plan_slice(**PLAN, devices=_gpus(70e9, fp8=False))
    assert small.exact and 16 <= small.overrides["n_experts"] < 256 and small.overrides["n_layers"] == 2
    assert small.ladder.iloc[-1]["fits"] and not small.ladder.iloc[:-1]["fits"].any()
    assert "turbo_fp8" not in small.paths  # no FP8 kernels on this device
    two = full_deepseek.plan_slice(**PLAN, devices=_gpus(H200_LIMIT, count=2))
    assert two.exact and two.expert_parallel == 2 and two.overrides["n_experts"] == 256
    assert two.overrides["param_dtype"] == "float32" and "over 2 GPUs (expert parallelism)" in two.label
    eight = full_deepseek.plan_slice(**PLAN, devices=_gpus(H200_LIMIT, count=8))
    assert eight.overrides["n_layers"] == 4 and eight.overrides["mtp_depth"] == 1  # the asked layers, MTP included
    with pytest.raises(ValueError, match="parameter n_experts: 100 routed experts do not split over 8 GPUs"):
        full_deepseek.plan_slice(**{**PLAN, "n_experts": 100}, devices=_gpus(H200_LIMIT, count=8))


def test_halved_widths_only_when_asked_or_where_no_exact_slice_fits():
    halved = full_deepseek.plan_slice(**{**PLAN, "width_divisor": 2}, devices=H200)
    assert halved.shrink == 2 and halved.overrides["d_model"] == 3584 and "as asked" in halved.label
    with pytest.raises(ValueError, match="parameter width_divisor: no slice of these widths fits"):
        full_deepseek.plan_slice(**{**PLAN, "width_divisor": 1}, devices=_gpus(GIB))
    with pytest.raises(ValueError, match="parameter width_divisor: must be None"):
        full_deepseek.plan_slice(**{**PLAN, "width_divisor": 3}, devices=H200)
    # A CPU: no exact-width rung fits its memory and step budget, so a labelled shrunk slice (and a shorter sequence)
    cpu = full_deepseek_slice.Devices(21.9 * GIB, "test", "cpu", 8)
    plan = full_deepseek.plan_slice(**PLAN, devices=cpu, max_step_tflop=full_deepseek.default_max_step_tflop("cpu"))
    assert not plan.exact and plan.shrink == 64 and plan.expert_parallel == 1 and 64 <= plan.seq_len < 4096
    assert plan.label.startswith("SHRUNK slice") and f"sequence {plan.seq_len} of 4096" in plan.label
    assert "exact widths do not fit this device" in plan.notes[0] and not plan.ladder["fits"].any()
    assert plan.paths == ("dense_cf", "ragged", "turbo")
    # Without a step budget memory alone decides: a smaller shrink.
    assert full_deepseek.plan_slice(**PLAN, devices=cpu).shrink < plan.shrink
    assert full_deepseek.default_max_step_tflop("gpu") is None


def test_user_overrides_are_kept_or_named_when_they_cannot_fit():
    tiny = {"d_model": 64, "n_heads": 2, "moe_ffn_dim": 32, "dense_ffn_dim": 64, "vocab_size": 256,
            "q_lora_rank": 16, "kv_lora_rank": 16}
    plan = full_deepseek.plan_slice(**{**PLAN, "model_overrides": tiny, "n_experts": 16, "seq_len": 32},
                                    devices=_gpus(8 * GIB))
    assert plan.overrides["d_model"] == 64 and plan.overrides["n_experts"] == 16 and plan.shrink == 1
    assert "your model_overrides" in plan.label
    with pytest.raises(ValueError, match="parameter model_overrides: no slice of these widths fits"):
        full_deepseek.plan_slice(**{**PLAN, "model_overrides": {"n_heads": 128}}, devices=_gpus(GIB))
    with pytest.raises(ValueError, match="parameter n_layers: must be a positive int"):
        full_deepseek.plan_slice(**{**PLAN, "n_layers": 0}, devices=H200)
    with pytest.raises(ValueError, match="parameter n_dense_layers: must be an int in"):
        full_deepseek.plan_slice(**{**PLAN, "n_layers": 1}, devices=H200)
    with pytest.raises(ValueError, match="parameter paths"):
        full_deepseek.plan_slice(**{**PLAN, "paths": ["dense"]}, devices=H200)
    with pytest.raises(ValueError, match="parameter seq_len: even widths / 64 do not fit"):
        full_deepseek.plan_slice(**PLAN, devices=_gpus(0.01 * GIB))


def test_interactive_rows_stay_out_of_the_committed_results(tmp_path):
    assert full_deepseek.results_location(None, tmp_path) == tmp_path / "experiments" / "runs" / "full_deepseek"
    assert full_deepseek.results_location(tmp_path / "mine", tmp_path) == tmp_path / "mine"
    assert "not comparable" in full_deepseek.memory_note("cpu")


def _slice_rows():
    history = [{"step": i, "loss": 7.0 - 0.2 * i, "ce_loss": 6.9 - 0.2 * i} for i in range(4)]
    return [{"path": p, "status": "ok", "tgs": 1000.0 + i, "measured_bytes": 2.5 * 2**30, "memory_source": "rss",
             "predicted_bytes": 0.04 * 2**30, "error": None, "first_loss": 7.0, "final_loss": 6.4,
             "history": history} for i, p in enumerate(("dense_cf", "turbo"))]


def test_cpu_memory_panel_draws_no_prediction_beside_the_rss():
    import matplotlib
    import matplotlib.pyplot as plt

    matplotlib.use("Agg")
    plan = full_deepseek.plan_slice(**{**PLAN, "n_layers": 2, "per_device_batch": 1, "seq_len": 64},
                                    devices=full_deepseek_slice.Devices(8 * GIB, "test", "cpu"), max_step_tflop=0.01)
    for platform, bars in (("cpu", 2), ("gpu", 4)):  # bars on the memory axes: measured (+ predicted on a GPU)
        fig = full_deepseek.plot_paths(_slice_rows(), plan, platform)
        ax_mem = fig.axes[1]
        assert len([p for p in ax_mem.patches if p.get_height() > 0]) == bars
        assert ("RSS" in ax_mem.get_ylabel()) == (platform == "cpu")
        plt.close(fig)
    fig = full_deepseek.plot_losses({r["path"]: r["history"] for r in _slice_rows()}, plan)
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["dense_cf", "turbo"]
    assert full_deepseek.plot_losses({"turbo": []}, plan) is None
    plt.close(fig)


def test_run_summary_is_human():
    summary = {"steps_done": 20, "phase_seconds": {"setup": 0.6, "compilation": 33.8, "training": 6.3, "done": 0.0},
               "tgs": 3093.4, "tgs_steps": 15, "mfu": math.nan, "peak_memory_bytes": 1433915392,
               "memory_source": "process peak RSS (host)", "dropped_fraction_mean": 0.0, "moe_path": "turbo",
               "compiled_memory": {"temp_size_in_bytes": 1}, "final_eval_loss": math.nan, "final_loss": 5.4321}
    table = display.run_summary("ok", None, summary)["value"]
    assert table["peak memory"] == "1.34 GiB (process peak RSS)"
    assert table["wall time"] == "40.7 s (setup 0.6 s, compile 33.8 s, train 6.3 s)"
    assert table["TGS (tokens/device/s)"] == "3,093 (last 15 steps)"
    assert table["dropped token copies"] == "none (dropless path)"
    assert "MFU" not in table and "error" not in table and "final eval cross-entropy (nats/token)" not in table
    assert not any(text in " ".join(table) for text in ("nan", "None", "{"))
    cf = display.run_summary("ok", None, {**summary, "moe_path": "dense_cf", "dropped_fraction_mean": 0.25})
    assert cf.loc["dropped token copies", "value"] == "25.0 % (mean over steps)"


def test_slice_results_table_formats_and_hides_empty_errors():
    rows = [{"path": "turbo", "status": "ok", "tgs": 1234.5, "measured_bytes": 1.5 * GIB, "memory_source": "RSS",
             "predicted_bytes": 0.005 * GIB, "error": None},
            {"path": "ragged", "status": "oom", "tgs": math.nan, "measured_bytes": None, "memory_source": None,
             "predicted_bytes": GIB, "error": "out of memory during compilation\ntrace"}]
    table = display.slice_results(rows)
    assert table.loc["turbo", "TGS (tok/dev/s)"] == "1,234" and table.loc["turbo", "measured peak"] == "1.50 GiB"
    assert table.loc["turbo", "predicted (states + activations)"] == "0.005 GiB"
    assert table.loc["turbo", "error"] == "" and table.loc["ragged", "error"] == "out of memory during compilation"
    assert "error" not in display.slice_results(rows[:1])
