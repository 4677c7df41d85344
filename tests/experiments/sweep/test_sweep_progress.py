"""What a sweep prints while it runs (a real papermill run of a toy notebook): a start line, heartbeats
naming the running cell and its last output line, a result line with TGS/loss/dropped, a summary table,
the report command, and no Jupyter transport warning."""

import json

from turbo_moe.experiments.sweep import output as sweep_output, runner
from turbo_moe.experiments.sweep.runner import SweepLayout, run_sweep
from turbo_moe.experiments.sweep.spec import spec_from_dict

SLOW_CELL = ("import time\nif mode == 'slow':\n    for i in range(6):\n        print(f'step {i}/6', flush=True)\n"
             "        time.sleep(1.0)\n")


def test_heartbeat_result_line_and_summary(toy_notebook, test_kernel, tmp_path, monkeypatch, capfd):
    nb = json.loads(toy_notebook.read_text())
    nb["cells"].insert(1, {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
                           "source": SLOW_CELL})
    toy_notebook.write_text(json.dumps(nb))
    monkeypatch.setattr(sweep_output, "AUTOSAVE_S", 1)
    monkeypatch.setattr(sweep_output, "HEARTBEAT_S", 1.5)
    spec = spec_from_dict({"name": "toy", "notebook": str(toy_notebook), "kernel": test_kernel,
                           "points": [{"x": 2, "mode": "slow"}]})
    layout = SweepLayout(results_dir=tmp_path / "results", runs_dir=tmp_path / "runs", sweep="toy")
    lines = []
    (row,) = run_sweep(spec, layout=layout, log=lines.append)
    assert row["status"] == "ok", row["error"]
    assert lines[1] == "[1/1] x-2__mode-slow: started"
    beats = [m for m in lines if ": running " in m]
    assert beats and any("cell 3/5: step " in m for m in beats), lines  # papermill's injected cell is 2/5
    assert "[1/1] x-2__mode-slow: ok  TGS 20  loss 0.5000  dropped -" in "\n".join(lines)
    table_head = lines.index(next(m for m in lines if m.strip().startswith("point")))
    assert lines[table_head + 2].split()[:3] == ["x-2__mode-slow", "ok", "20"]
    assert lines[-1].startswith(f"report: turbo-moe report --experiments-dir {tmp_path}")
    captured = capfd.readouterr()
    assert "without encryption" not in captured.out + captured.err


def test_result_line_of_a_failed_point_and_progress_of_a_notebook(tmp_path):
    row = {"point": "p", "status": "error", "error": "RuntimeError: boom\n" + "x" * 500, "elapsed_s": 3.2}
    line = sweep_output.result_line(row)
    assert line.startswith("error  RuntimeError: boom x") and line.endswith("...  (3 s)") and len(line) < 230
    nb = {"cells": [{"cell_type": "code", "metadata": {"papermill": {"status": "completed"}}, "outputs": []},
                    {"cell_type": "code", "metadata": {"papermill": {"status": "running"}},
                     "outputs": [{"output_type": "display_data",
                                  "data": {"text/plain": "train turbo: training | step 41/200\n  (compiling 3 s)"}}]}]}
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps(nb))
    assert sweep_output.notebook_progress(path) == "cell 2/2: train turbo: training | step 41/200"
    path.write_text('{"cells": [')  # caught mid-write
    assert sweep_output.notebook_progress(path) is None


def test_trial_spec_stays_out_of_the_results_folder(tmp_path, toy_notebook, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = spec_from_dict({"name": "try", "notebook": str(toy_notebook), "grid": {"x": [1]}},
                          source=tmp_path / "try.yaml")
    assert runner.default_experiments_dir(spec) == tmp_path / "experiments" / "runs" / "trials"
