"""The report rebuilt from the committed fixture results tree (tests/experiments/fixtures/results)."""

import json
import shutil
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from turbo_moe import cli  # noqa: E402
from turbo_moe.experiments.report import report  # noqa: E402

FIXTURE = Path(__file__).parents[1] / "fixtures" / "results"
EXPECTED = ["tgs_vs_batch", "peak_memory", "loss_curves", "dropped_fraction", "expert_load_over_steps",
            "synthetic_vs_real", "expert_load_cpu_loss", "kernel_tflops_h100"]


@pytest.fixture
def fixture_store(tmp_path):
    """The fixture results tree brought into a results store (as `turbo-moe report` does)."""
    store_dir = tmp_path / "store"
    report.ingest_live_tables(FIXTURE, store_dir)
    return store_dir


def test_report_draws_every_figure_from_fixture(tmp_path):
    summary = report.build_report(FIXTURE, tmp_path / "figures", store_dir=tmp_path / "store")
    tmp_path = tmp_path / "figures"
    for name in EXPECTED:
        assert summary.entries[name] == f"{name}.png"  # relative to the figures folder
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    table = (tmp_path / "results.md").read_text()
    assert table.count("\n") == 2 + 4 + 16 + 6  # header, separator, then one line per point
    assert "| paths_x_batch | dense_cf (cf=2) | 8 |  |  | oom |" in table
    assert json.loads((tmp_path / "report.json").read_text()) == summary.entries
    assert "| cpu_loss | abc1234567 | 2026-11-21 |" in table  # every row says where it comes from


def test_report_data_picks_comparison_sweeps_only(fixture_store):
    data = report.load_report_data(fixture_store)
    assert report.comparison_sweeps(data.results) == ["cpu_loss"]
    assert set(data.histories["label"]) == {"dense_cf (cf=1)", "dense_cf (cf=2)", "ragged", "turbo"}
    assert data.loads["cpu_loss"]["turbo"].shape == (2, 8)


def test_missing_tables_skip_figures_with_a_note(tmp_path, capsys):
    results = tmp_path / "results"
    shutil.copytree(FIXTURE, results, ignore=shutil.ignore_patterns("kernels_*", "paths_x_batch.csv"))
    summary = report.build_report(results, tmp_path / "figures", store_dir=tmp_path / "store")
    assert summary.entries["kernel_tflops"].startswith("skipped: no experiments/results/kernels_")
    assert summary.entries["tgs_vs_batch"].startswith("skipped: no sweep varies per_device_batch")
    assert (tmp_path / "figures" / "loss_curves.png").exists()
    assert "skipped kernel_tflops" in capsys.readouterr().out


def test_empty_results_dir_gives_notes_not_errors(tmp_path):
    summary = report.build_report(tmp_path / "nothing_here", tmp_path / "figures", store_dir=tmp_path / "store")
    skipped = [k for k, v in summary.entries.items() if v.startswith("skipped")]
    assert len(skipped) == 9  # drop_penalty among them
    assert "_no results yet_" in (tmp_path / "figures" / "results.md").read_text()


def test_cli_report_in_process(tmp_path, capsys):
    shutil.copytree(FIXTURE, tmp_path / "results")
    assert cli.main(["report", "--experiments-dir", str(tmp_path), "--no-notebook"]) == 0
    out = capsys.readouterr().out
    assert f"loss_curves: {tmp_path / 'runs' / 'report' / 'loss_curves.png'}" in out
    assert not (tmp_path / "store").exists() and not (tmp_path / "figures").exists()  # nothing committed changes


def test_cli_report_missing_notebook_is_clear(tmp_path, capsys):
    shutil.copytree(FIXTURE, tmp_path / "results")
    assert cli.main(["report", "--experiments-dir", str(tmp_path), "--notebook", "nope.ipynb"]) == 2
    assert "report notebook 'nope.ipynb' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("label_args, label", [(("dense_cf", 1.25), "dense_cf (cf=1.25)"),
                                               (("ragged", 1.25), "ragged"), (("dense_cf", None), "dense_cf")])
def test_path_label(label_args, label):
    from turbo_moe.experiments.report.figures import path_label

    assert path_label(*label_args) == label


def test_minimal_table_without_provenance_still_draws(tmp_path):
    from turbo_moe.experiments.store.results import append_row

    for batch, status in ((1, "ok"), (2, "ok"), (4, "oom")):
        append_row(tmp_path / "results" / "mini.csv", {"sweep": "mini", "point": f"b{batch}", "status": status,
                                                       "moe_path": "ragged", "per_device_batch": batch,
                                                       "tgs": 100.0 * batch if status == "ok" else None})
    summary = report.build_report(tmp_path / "results", tmp_path / "figures")  # store: this machine's
    assert (tmp_path / "runs" / "store" / "records" / "campaign=mini").is_dir()
    assert not (tmp_path / "store").exists()  # the committed store is written only by --publish
    assert summary.entries["tgs_vs_batch"].endswith("tgs_vs_batch.png")
    assert "| mini | ragged | 4 | oom |" in (tmp_path / "figures" / "results.md").read_text()


def test_routing_phases_average_the_first_and_last_steps_of_each_run(fixture_store):
    """The results table reports drop and load as at init and late in the run (balanced regime)."""
    import pandas as pd

    steps = range(40)
    run = pd.DataFrame({"step": list(steps), "dropped_fraction": [0.5 if s < 2 else 0.1 for s in steps],
                        "load_max_over_mean": [4.0 if s < 30 else 1.5 for s in steps]})
    phases = report.routing_phases(pd.concat([run.assign(sweep="s", point="a"),
                                              run.assign(sweep="s", point="b", dropped_fraction=0.0)]))
    a, b = phases.set_index("point").loc["a"], phases.set_index("point").loc["b"]
    assert (a["dropped_init"], a["dropped_late"], a["load_init"], a["load_late"]) == (0.5, 0.1, 4.0, 1.5)
    assert (b["dropped_init"], b["dropped_late"]) == (0.0, 0.0)
    data = report.load_report_data(fixture_store)
    assert data.results.loc[data.results["sweep"] == "cpu_loss", "load_late"].notna().all()
    assert "load max/mean, last 25%" in report.results_markdown(data.results)


def test_seed_repeats_get_their_own_label_and_curve():
    """A comparison sweep that repeats one path with another seed (to show seed-to-seed noise) keeps
    both runs apart: labels name the seed, and the sweep still counts as a comparison sweep."""
    import pandas as pd

    from turbo_moe.experiments.report.figures import with_path_labels

    frame = pd.DataFrame({"sweep": ["s"] * 4, "moe_path": ["turbo", "turbo", "ragged", "dense_cf"],
                          "capacity_factor": [None, None, None, 1.0], "seed": [0, 1, 0, 0],
                          "status": ["ok"] * 4, "record_path": ["r"] * 4})
    labels = with_path_labels(frame)["path"].tolist()
    assert labels == ["turbo (seed 0)", "turbo (seed 1)", "ragged", "dense_cf (cf=1)"]
    assert report.comparison_sweeps(frame) == ["s"]


def test_memory_bars_are_the_train_steps_need_and_markers_the_measured_peak():
    """The measured peak covers the parameter init too: at small batches it is the init's, the same for every path.
    The bars show the compiled step's own need, so the paths stay apart."""
    import pandas as pd
    from matplotlib.collections import PathCollection

    from turbo_moe.experiments.report import figures

    gib = figures.GIB
    rows = pd.DataFrame([
        {"sweep": "s", "status": "ok", "moe_path": path, "per_device_batch": batch, "device_kind": "gpu",
         "peak_memory_bytes": peak * gib, "compiled_total_bytes": need * gib, "memory_source": "device peak"}
        for path, batch, need, peak in [("turbo", 2, 20, 44), ("turbo", 8, 30, 44), ("ragged", 2, 38, 44),
                                        ("ragged", 8, 83, 85)]])
    fig = figures.peak_memory(rows)
    ax = fig.axes[0]
    heights = sorted(round(b.get_height()) for b in ax.patches if b.get_height() > 0)
    assert heights == [20, 30, 38, 83]
    peaks = sorted(round(y) for c in ax.collections if isinstance(c, PathCollection) for _, y in c.get_offsets())
    assert peaks == [44, 44, 44, 85]
    assert "XLA memory analysis" in ax.get_title()
    without = figures.peak_memory(rows.drop(columns="compiled_total_bytes"))  # older records: the peak as bars
    assert sorted(round(b.get_height()) for b in without.axes[0].patches if b.get_height() > 0) == [44, 44, 44, 85]
