"""The report's checks and figures, in-process on the fixture results (no kernel)."""

import json
import shutil
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest

matplotlib.use("Agg")

from turbo_moe.experiments.report import figures, report  # noqa: E402

FIXTURE = Path(__file__).parents[1] / "fixtures" / "results"


def test_parameters_are_checked_before_drawing(tmp_path):
    with pytest.raises(ValueError, match="parameter store_dir: '.*nope' is not a folder"):
        report.check_parameters(tmp_path / "nope", tmp_path / "figures")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="parameter store_dir: .* holds no records"):
        report.check_parameters(tmp_path / "empty", tmp_path / "figures")
    report.ingest_live_tables(FIXTURE, tmp_path / "store")
    with pytest.raises(ValueError, match="parameter figures_dir: the parent folder"):
        report.check_parameters(tmp_path / "store", tmp_path / "missing" / "figures")
    report.check_parameters(tmp_path / "store", tmp_path / "figures")
    assert (tmp_path / "figures").is_dir()


def test_manifest_has_no_machine_paths_and_is_stable(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "results")
    report.build_report(tmp_path / "results", tmp_path / "figures")
    first = (tmp_path / "figures" / "report.json").read_text()
    report.build_report(tmp_path / "results", tmp_path / "figures")
    assert (tmp_path / "figures" / "report.json").read_text() == first
    entries = json.loads(first)
    assert str(tmp_path) not in first and entries["tgs_vs_batch"] == "tgs_vs_batch.png"
    assert all(v.startswith("skipped") or (tmp_path / "figures" / v).is_file() for v in entries.values())


def _labels(fig):
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_batch_points_not_run_are_marked():
    rows = pd.DataFrame({"sweep": "s", "point": list("abcde"), "status": ["ok", "ok", "ok", "ok", "oom"],
                         "moe_path": ["turbo", "turbo", "ragged", "ragged", "ragged"],
                         "per_device_batch": [2, 8, 2, 8, 32], "tgs": [10.0, 20, 5, 6, np.nan]})
    fig = figures.tgs_vs_batch(rows)
    assert "turbo: not run" in _labels(fig) and "ragged: not run" not in _labels(fig)


def test_heatmaps_stack_runs_and_use_a_log_scale_around_one():
    load = np.ones((3, 64))
    load[:, 0] = 3.0  # one hot expert must not wash out a 1.5x imbalance elsewhere
    load[:, 1] = 1.5
    fig = figures.expert_load_heatmaps({"turbo": load, "ragged": np.ones((3, 64))}, pd.DataFrame())
    heat = [ax for ax in fig.axes if ax.get_xlabel() == "expert"]
    assert len(heat) == 2 and heat[0].get_position().x0 == pytest.approx(heat[1].get_position().x0)
    norm = heat[0].collections[0].norm
    assert isinstance(norm, matplotlib.colors.LogNorm) and norm.vmin * norm.vmax == pytest.approx(1.0)
    assert fig.get_figwidth() <= 10


def test_loss_curves_draw_raw_faint_and_smoothed():
    steps = np.arange(60)
    hist = pd.DataFrame({"sweep": "s", "label": "turbo", "step": steps, "loss": 5 + np.sin(steps),
                         "eval_loss": np.nan})
    fig = figures.loss_curves(hist, pd.DataFrame({"sweep": ["s"]}))
    lines = fig.axes[0].get_lines()
    assert [round(line.get_alpha() or 1, 2) for line in lines] == [0.25, 1.0]
    assert np.std(lines[1].get_ydata()) < np.std(lines[0].get_ydata())


def test_kernel_figure_is_one_routing_per_figure_one_op_per_row():
    kernels = pd.read_csv(FIXTURE / "kernels_h100.csv").assign(table="kernels_h100")
    builders = report.figure_builders(report.ReportData(pd.DataFrame(), pd.DataFrame(), {}, kernels))
    names = [n for n in builders if n.startswith("kernel_tflops")]
    assert names[0] == "kernel_tflops_h100"
    fig = builders[names[0]]()
    assert fig.get_figwidth() <= 10 and len([ax for ax in fig.axes if ax.get_title()]) >= 1


def test_batch_legend_covers_no_point_and_ooms_at_one_batch_do_not_overlap():
    """The committed figure's legend hid turbo's largest-batch point, and two paths out of memory at one
    batch had their names written on top of each other."""
    rows = pd.DataFrame({"sweep": "s", "point": list("abcdefgh"), "status": ["ok"] * 6 + ["oom", "oom"],
                         "moe_path": ["turbo", "turbo", "turbo", "dense_cf", "dense_cf", "ragged", "ragged", "pallas"],
                         "capacity_factor": [None, None, None, 1.0, 1.0, None, None, None],
                         "per_device_batch": [2, 8, 32, 2, 8, 2, 32, 32],
                         "tgs": [7.7e4, 1.24e5, 1.45e5, 4.3e4, 5.8e4, 7e3, np.nan, np.nan]})
    fig = figures.tgs_vs_batch(rows)
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    points = [ax.transData.transform(xy) for line in ax.get_lines() for xy in line.get_xydata()]
    assert points and not any(legend.contains(x, y) for x, y in points)
    red = [t.get_window_extent() for t in ax.texts if t.get_color() == "red"]
    assert red and not any(a.overlaps(b) for i, a in enumerate(red) for b in red[i + 1:])


def test_heatmap_rows_are_the_moe_layers_then_the_mtp_block():
    from turbo_moe.model.config import get_config

    cfg = get_config("small")  # 4 MoE layers and one MoE MTP block: 5 rows of expert load
    load = np.ones((cfg.n_router_layers, 16))
    load[0, 3] = 0.0
    names = figures.moe_row_labels(cfg)
    fig = figures.expert_load_heatmaps({"turbo": load}, pd.DataFrame(), {"turbo": names})
    ax = [a for a in fig.axes if a.get_xlabel() == "expert"][0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["layer 1", "layer 2", "layer 3", "layer 4", "MTP 0"]
    assert ax.get_title().endswith(", 1 idle expert")
