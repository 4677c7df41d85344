"""04_report: executed through papermill on the fixture results, then checked by nbval."""

import shutil

from nbhelpers import REPO, execute, nbval

FIXTURE = REPO / "tests" / "sweep" / "fixtures" / "results"


def test_report_notebook_draws_figures_and_passes_nbval(tmp_path, kernel):
    results_dir = tmp_path / "results"
    shutil.copytree(FIXTURE, results_dir)
    figures_dir = tmp_path / "figures"
    executed = execute("04_report.ipynb", tmp_path, kernel,
                       results_dir=str(results_dir), figures_dir=str(figures_dir))
    for name in ("tgs_vs_batch", "peak_memory", "loss_curves", "dropped_fraction", "synthetic_vs_real",
                 "expert_load_cpu_loss", "kernel_tflops_h100"):
        assert (figures_dir / f"{name}.png").exists(), name
    assert "| cpu_loss | turbo |" in (figures_dir / "results.md").read_text()
    checked = nbval(executed)
    assert checked.returncode == 0, checked.stdout[-3000:]
