"""03_full_deepseek: exact-config accounting, then a shrunken 'full-width' slice trained on CPU."""

import json

import pandas as pd
import papermill
import pytest

from nbhelpers import execute

# On CPU the slice cannot be full width; the test shrinks it through model_overrides.
SHRUNK = {"d_model": 64, "n_heads": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
          "qk_rope_head_dim": 8, "v_head_dim": 16, "dense_ffn_dim": 64, "moe_ffn_dim": 32, "vocab_size": 256,
          "remat_policy": "none"}  # no remat needed at this size (and faster to compile)
TINY = dict(n_layers=2, n_dense_layers=1, n_experts=16, model_overrides=SHRUNK, paths=["ragged"],
            per_device_batch=2, seq_len=32, steps=3, dataset="synthetic")


def test_accounting_and_slice_run(tmp_path, kernel):
    executed = execute("03_full_deepseek.ipynb", tmp_path, kernel, **TINY, results_dir=str(tmp_path / "results"))
    table = pd.read_csv(tmp_path / "results" / "full_deepseek.csv")
    assert list(table["status"]) == ["ok"] and table.loc[0, "n_experts"] == 16 and table.loc[0, "tgs"] > 0
    record = json.loads((tmp_path / "results" / table.loc[0, "record"]).read_text())
    assert record["provenance"]["model_config"]["d_model"] == 64
    text = executed.read_text()
    assert "671.03" in text  # total (main) parameters, billions, of the exact config
    assert "what the exact widths need" in text and "slice with your model_overrides" in text
    assert "error None" not in text and "not comparable" in text
    assert "ragged: train loss" in text and "at the first step ->" in text


def test_bad_path_stops_in_first_cells(tmp_path, kernel):
    with pytest.raises(papermill.PapermillExecutionError) as err:
        execute("03_full_deepseek.ipynb", tmp_path, kernel, paths=["dense", "ragged"])
    assert err.value.ename == "ValueError" and "parameter paths" in err.value.evalue
    assert err.value.cell_index == 3
