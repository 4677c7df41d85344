"""04_report: `turbo-moe report` executes it through papermill on the fixture results; nbval re-checks it."""

import json
import shutil

from nbhelpers import NOTEBOOKS, REPO, nbval

from turbo_moe import cli

FIXTURE = REPO / "tests" / "experiments" / "fixtures" / "results"


def test_report_command_draws_figures_and_passes_nbval(tmp_path, kernel, capsys, monkeypatch):
    from turbo_moe.experiments.report import report

    shutil.copytree(FIXTURE, tmp_path / "results")
    monkeypatch.chdir(tmp_path)  # not the repository root: the notebook is found from the package
    assert cli.main(["report", "--experiments-dir", str(tmp_path), "--kernel", kernel]) == 0
    figures_dir = tmp_path / "runs" / "report"  # this machine's report (git-ignored in the repository)
    out = capsys.readouterr().out
    for name in ("tgs_vs_batch", "peak_memory", "loss_curves", "dropped_fraction", "synthetic_vs_real",
                 "expert_load_cpu_loss", "kernel_tflops_h100"):
        assert (figures_dir / f"{name}.png").exists(), name
        assert f"{name}: {(figures_dir / name).resolve()}.png" in out
    assert "| cpu_loss | turbo |" in (figures_dir / "results.md").read_text()
    manifest = (figures_dir / "report.json").read_text()
    assert str(tmp_path) not in manifest
    # The notebook draws every figure the report has (the drop penalty too: skipped here, without its campaign).
    builders = report.figure_builders(report.load_report_data(tmp_path / "runs" / "store"))
    assert set(builders) <= set(json.loads(manifest)), set(builders) - set(json.loads(manifest))
    assert json.loads(manifest)["drop_penalty"].startswith("skipped")
    executed = tmp_path / "runs" / "report" / "04_report.ipynb"
    checked = nbval(executed)
    assert checked.returncode == 0, checked.stdout[-3000:]


def test_bad_store_dir_stops_in_the_first_cells(tmp_path, kernel):
    import papermill
    import pytest

    with pytest.raises(papermill.PapermillExecutionError) as err:
        papermill.execute_notebook(str(NOTEBOOKS / "04_report.ipynb"), str(tmp_path / "out.ipynb"),
                                   parameters={"store_dir": str(tmp_path / "typo"), "figures_dir": str(tmp_path)},
                                   kernel_name=kernel, cwd=str(NOTEBOOKS), progress_bar=False)
    assert err.value.ename == "ValueError" and "parameter store_dir" in err.value.evalue
    assert err.value.cell_index == 3  # markdown, parameters, injected parameters, then the check
