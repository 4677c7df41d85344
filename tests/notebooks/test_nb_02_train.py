"""02_train: a tiny run through papermill writes its record; bad parameters stop in the first cells."""

import json

import papermill
import pytest

from nbhelpers import execute, nbval

TINY = dict(model="tiny", moe_path="dense_cf", capacity_factor=1.0, per_device_batch=2, seq_len=32, steps=3,
            warmup_steps=1, eval_every=0, eval_batches=1, dataset="synthetic")


def test_tiny_run_writes_record_and_passes_nbval(tmp_path, kernel):
    record = tmp_path / "record.json"
    executed = execute("02_train.ipynb", tmp_path, kernel, **TINY, result_json=str(record))
    result = json.loads(record.read_text())
    assert result["status"] == "ok", result["error"]
    assert [row["step"] for row in result["history"]] == [0, 1, 2]
    assert result["summary"]["steps_done"] == 3 and result["summary"]["tgs"] > 0
    assert {len(layer) for layer in result["expert_load"]} == {8}  # (L_moe, E), tiny has 8 experts
    text = executed.read_text()
    assert "image/png" in text and "dense_cf" in text
    # What survives in the saved notebook: the final status (a display, not a widget) and the summary line.
    assert "application/vnd.jupyter.widget-view+json" not in text
    assert "train dense_cf: finished 3/3 steps" in text and "compiling the train step" in text
    assert "train dense_cf: ok | 3 steps in" in text and "peak memory" in text
    assert "TGS (tokens/device/s)" in text and "1433915392" not in text
    from nbconvert import HTMLExporter

    html, _ = HTMLExporter().from_filename(str(executed))  # what an HTML export shows: the final state
    assert "train dense_cf: finished 3/3 steps" in html and "0/3 [" not in html
    checked = nbval(executed)  # re-runs the notebook; the parameter/description cell must match
    assert checked.returncode == 0, checked.stdout[-3000:]


@pytest.mark.parametrize(
    "bad, message",
    [({"moe_path": "bogus"}, "parameter moe_path: unknown path 'bogus'"),
     ({"per_device_batch": -4}, "parameter per_device_batch: must be a positive int, got -4")],
)
def test_bad_parameter_stops_in_first_cells(tmp_path, kernel, bad, message):
    with pytest.raises(papermill.PapermillExecutionError) as err:
        execute("02_train.ipynb", tmp_path, kernel, **{**TINY, **bad})
    assert err.value.ename == "ValueError" and message in err.value.evalue
    # Cell 0 is markdown, 1 the parameters, 2 papermill's injected parameters, 3 the validation cell.
    assert err.value.cell_index == 3
