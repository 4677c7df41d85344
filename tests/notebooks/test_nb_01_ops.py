"""01_ops: executed through papermill with a tiny problem, then checked by nbval."""

import papermill
import pytest

from nbhelpers import execute, nbval

TINY = dict(num_tokens=64, hidden=32, ffn=48, num_experts=8, top_k=2, routing="empty_groups", timing_iters=2)


def test_ops_notebook_checks_pass_and_nbval_agrees(tmp_path, kernel):
    executed = execute("01_ops.ipynb", tmp_path, kernel, **TINY)
    text = executed.read_text()
    assert "T=64 k=2 H=32 F=48 E=8 (empty_groups)" in text
    assert "jax.lax.ragged_dot" in text and "image/png" in text
    assert "timing " in text and "ms per call" in text  # the timing cell reports as it goes
    # Human text in the saved outputs: a CPU's throughput in GFLOP/s, tables as DataFrames (no Styler repr).
    assert "GFLOP/s" in text and "Styler" not in text and " at 0x" not in text
    checked = nbval(executed)
    assert checked.returncode == 0, checked.stdout[-3000:]


def test_bad_parameter_stops_in_first_cells(tmp_path, kernel):
    with pytest.raises(papermill.PapermillExecutionError) as err:
        execute("01_ops.ipynb", tmp_path, kernel, **{**TINY, "top_k": -1})
    assert err.value.ename == "ValueError" and "parameter top_k: must be a positive int" in err.value.evalue
    assert err.value.cell_index == 3
