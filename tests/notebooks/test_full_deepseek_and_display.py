"""03's Part 2 plan (exact slice, shrunk slice, user overrides) and the human tables (no kernel)."""

import math

import pytest

from turbo_moe.experiments import display, full_deepseek
from turbo_moe.experiments.display import GIB

PLAN = dict(n_layers=4, n_dense_layers=1, n_experts=None, model_overrides={}, memory_source="test",
            per_device_batch=1, seq_len=4096, capacity_factor=1.25)


def test_exact_widths_run_when_they_fit():
    plan = full_deepseek.plan_slice(**PLAN, memory_bytes=200 * GIB)
    assert plan.exact and plan.overrides["n_layers"] == 4 and "d_model" not in plan.overrides
    assert 8 <= plan.overrides["n_experts"] <= 256 and plan.label.startswith("exact widths")


def test_cpu_sized_memory_gets_a_labelled_shrunk_slice():
    plan = full_deepseek.plan_slice(**PLAN, memory_bytes=21.9 * GIB, max_step_tflop=0.25)
    assert not plan.exact and plan.shrink in full_deepseek.SHRINKS and plan.seq_len == 4096
    assert plan.label.startswith("SHRUNK slice") and plan.overrides["d_model"] == 7168 // plan.shrink
    # The exact widths' need is shown: more than the device has, for the fewest and the 256 experts.
    need = plan.exact_need["GiB needed (largest path)"]
    assert need.min() > 21.9 and "256 experts" in plan.exact_need.index
    assert "do not fit this device" in plan.notes[0]
    # Without a step budget the shrink is smaller (memory alone decides).
    assert full_deepseek.plan_slice(**PLAN, memory_bytes=21.9 * GIB).shrink < plan.shrink
    # A CPU's budget also shortens the sequence, and says so.
    cpu = full_deepseek.plan_slice(**PLAN, memory_bytes=21.9 * GIB,
                                   max_step_tflop=full_deepseek.default_max_step_tflop("cpu"))
    assert cpu.shrink == 64 and 64 <= cpu.seq_len < 4096 and cpu.overrides["max_seq_len"] == cpu.seq_len
    assert f"sequence {cpu.seq_len} of 4096" in cpu.label
    assert full_deepseek.default_max_step_tflop("gpu") is None


def test_user_overrides_are_kept_or_named_when_they_cannot_fit():
    tiny = {"d_model": 64, "n_heads": 2, "moe_ffn_dim": 32, "dense_ffn_dim": 64, "vocab_size": 256,
            "q_lora_rank": 16, "kv_lora_rank": 16}
    plan = full_deepseek.plan_slice(**{**PLAN, "model_overrides": tiny, "n_experts": 16, "seq_len": 32},
                                    memory_bytes=8 * GIB)
    assert plan.overrides["d_model"] == 64 and plan.overrides["n_experts"] == 16 and plan.shrink == 1
    with pytest.raises(ValueError, match="parameter model_overrides: with these overrides no expert count fits"):
        full_deepseek.plan_slice(**{**PLAN, "model_overrides": {"n_heads": 128}}, memory_bytes=GIB)
    with pytest.raises(ValueError, match="parameter n_layers: must be a positive int"):
        full_deepseek.plan_slice(**{**PLAN, "n_layers": 0}, memory_bytes=GIB)
    with pytest.raises(ValueError, match="parameter seq_len: even widths / 64 do not fit"):
        full_deepseek.plan_slice(**PLAN, memory_bytes=0.01 * GIB)


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
    plan = full_deepseek.plan_slice(n_layers=2, n_dense_layers=1, n_experts=None, model_overrides={},
                                    memory_bytes=8 * 2**30, memory_source="test", per_device_batch=1, seq_len=64,
                                    capacity_factor=1.25, max_step_tflop=0.01)
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
