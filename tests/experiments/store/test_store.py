"""The results store: round trip, migration of a small results tree, damaged files named, incremental ingest."""

import gzip
import json
import shutil
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from turbo_moe.experiments.report import compare
from turbo_moe.experiments.store import migrate, migration_check, store
from turbo_moe.experiments.store.results import append_row
from turbo_moe.experiments.store.store import Record, StoreError

FIXTURE = Path(__file__).parents[1] / "fixtures" / "results"
PROV = {"device_kind": "cpu", "git_commit": "abc1234567", "date": "2026-11-21T20:00:00+00:00"}


def test_round_trip_keeps_config_provenance_summary_and_history(tmp_path):
    run = Record("p@1", "run", "toy", "toy.csv", status="ok", config={"moe_path": "turbo", "nested": {"a": [1, 2]}},
                 provenance=PROV, summary={"tgs": 1234.5, "mfu": float("nan")},
                 history=[{"step": s, "loss": 10.0 - s, "eval_loss": None} for s in range(3)])
    bench = Record("k#0", "benchmark", "kernels", "kernels.csv", config={"shape": "s"}, summary={"tflops": 7.0})
    assert store.write_campaign(tmp_path, "c1", [run, bench]) == 2

    records = pd.read_parquet(tmp_path / "records")  # one line, the campaign from the folder name
    assert set(records["campaign"].astype(str)) == {"c1"} and len(records) == 2
    row = store.read_records(tmp_path, ["c1"]).set_index("record").loc["p@1"]
    assert (row["date"], row["git_commit"], row["device"], row["status"]) == (PROV["date"], "abc1234567", "cpu", "ok")
    back = store.record_dict(row.to_dict() | {"record": "p@1"}, store.read_history(tmp_path, wide=False))
    assert back["nested"] == {"a": [1, 2]} and back["tgs"] == 1234.5
    assert [h["loss"] for h in back["history"]] == [10.0, 9.0, 8.0]
    wide = store.read_history(tmp_path, ["c1"])
    assert list(wide["step"]) == [0, 1, 2] and "eval_loss" not in wide  # missing values stay missing
    flat = store.read_records(tmp_path, expand=True).set_index("record")
    assert flat.loc["k#0", "tflops"] == 7.0 and flat.loc["p@1", "moe_path"] == "turbo"


def test_upsert_replaces_a_record_and_keeps_the_others(tmp_path):
    store.write_campaign(tmp_path, "c", [Record("a", "benchmark", "t", "t.csv", summary={"ms": 1.0}),
                                         Record("b", "run", "t", "t.csv", history=[{"step": 0, "loss": 5.0}])])
    store.write_campaign(tmp_path, "c", [Record("b", "run", "t", "t.csv", history=[{"step": 0, "loss": 4.0}])])
    records = store.read_records(tmp_path)
    assert sorted(records["record"]) == ["a", "b"]
    assert store.read_history(tmp_path)["loss"].tolist() == [4.0]
    with pytest.raises(StoreError, match="given twice"):
        store.write_campaign(tmp_path, "c", [Record("x", "run", "t", "s"), Record("x", "run", "t", "s")])
    with pytest.raises(StoreError, match="kind must be one of"):
        store.write_campaign(tmp_path, "c", [Record("y", "table", "t", "s")])


def test_damaged_store_file_is_reported_by_name(tmp_path):
    store.write_campaign(tmp_path, "good", [Record("a", "benchmark", "t", "t.csv")])
    store.write_campaign(tmp_path, "bad", [Record("b", "benchmark", "t", "t.csv")])
    damaged = tmp_path / "records" / "campaign=bad" / "part-0.parquet"
    damaged.write_bytes(damaged.read_bytes()[:40])  # a truncated copy
    with pytest.raises(StoreError, match=r"campaign=bad/part-0.parquet: damaged"):
        store.read_records(tmp_path)
    assert store.read_records(tmp_path, ["good"])["record"].tolist() == ["a"]
    problems = store.verify(tmp_path)
    assert len(problems) == 1 and "campaign=bad" in problems[0]


def test_compact_rewrites_a_store_with_the_same_values(tmp_path):
    records = [Record(record=f"r{i}", kind="run", table="t", source="t.csv", config={"seed": i, "note": "x" * 300},
                      summary={"tgs": 1.0 + i}, history=[{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3 * s}
                                                         for s in range(30)]) for i in range(3)]
    store.write_campaign(tmp_path, "c", records)
    history_file = tmp_path / "history" / "campaign=c" / "part-0.parquet"
    records_file = tmp_path / "records" / "campaign=c" / "part-0.parquet"
    # As an earlier version wrote them: history in step order, statistics for every column.
    earlier = {history_file: pq.read_table(history_file).sort_by("step"), records_file: pq.read_table(records_file)}
    for path, table in earlier.items():
        pq.write_table(table, path, compression="zstd", compression_level=15, write_page_checksum=True)
    store.rehash(tmp_path)
    wide, long = store.read_history(tmp_path), store.read_history(tmp_path, wide=False)
    rows = store.read_records(tmp_path)
    assert list(wide.columns) == ["campaign", "record", "step", "loss", "lr"]  # whatever order the file holds

    before, after = store.compact(tmp_path)
    assert after < before and store.verify(tmp_path) == []
    pd.testing.assert_frame_equal(store.read_history(tmp_path), wide)
    pd.testing.assert_frame_equal(store.read_records(tmp_path), rows)
    again = store.read_history(tmp_path, wide=False)
    key = ["record", "metric", "step"]
    assert list(again[key].itertuples(index=False)) == sorted(again[key].itertuples(index=False))  # one metric together
    pd.testing.assert_frame_equal(again, long.sort_values(key, ignore_index=True))
    footer = pq.ParquetFile(records_file).metadata
    columns = range(footer.num_columns)
    stats = {footer.schema.column(i).name: footer.row_group(0).column(i).is_stats_set for i in columns}
    assert stats["record"] and not stats["config"]  # no JSON document copied into the footer
    assert footer.metadata is None or b"pandas" not in footer.metadata


def _small_tree(root: Path) -> Path:
    """A results tree in today's formats: a sweep table with records, a benchmark table, a per-step table,
    a gzipped JSON with a per-layer trace, JSONL, a PROVENANCE.md, a log and a damaged row."""
    results = root / "results"
    shutil.copytree(FIXTURE, results)
    steps = pd.DataFrame({"run": ["a"] * 3 + ["b"] * 3, "path": "turbo", "cf": 1.25, "step": [0, 1, 2] * 2,
                          "loss": [3.0, 2.5, 2.0, 3.1, 2.6, 2.2], "tokens": [10, 20, 30] * 2})
    (results / "balance").mkdir()
    steps.to_csv(results / "balance" / "steps.csv", index=False)
    (results / "balance" / "PROVENANCE.md").write_text("# Balance runs\nH200, commit abc.\n")
    (results / "balance" / "call7").mkdir()
    (results / "balance" / "call7" / "log").write_text("step 0 loss 3.0\n")
    probe = {"name": "p", "args": {"lr": 1e-3}, "device_kind": "cpu",
             "history": [{"step": s, "ce": 5.0 - s, "layers": [{"load": [1, 2]}]} for s in range(2)]}
    (results / "probe").mkdir()
    (results / "probe" / "p.json.gz").write_bytes(gzip.compress(json.dumps(probe).encode()))
    (results / "probe" / "lines.jsonl").write_text('{"x": 1}\n{"x": 2}\n')
    with open(results / "kernels_h100.csv", "a") as table:
        table.write("a,b\n")  # a row with the wrong number of fields
    return results


def test_migration_of_a_small_tree_rebuilds_every_file(tmp_path, capsys):
    results = _small_tree(tmp_path)
    written = migrate.ingest(results, tmp_path / "store")
    assert set(written) == {"cpu_loss", "kernels_h100", "paths_x_batch", "synthetic_vs_real", "balance", "probe"}
    assert "kernels_h100.csv: 2 fields where the header has" in capsys.readouterr().err  # reported by name
    assert migration_check.check(results, tmp_path / "store") == []

    sources = store.read_sources(tmp_path / "store").set_index("path")
    assert sources.loc["kernels_h100.csv", "text"].startswith("# ")  # the damaged row kept as text
    assert sources.loc["balance/call7/log", "stored"] == "inline"
    assert sources.loc["probe/p.json.gz", "stored"].startswith("records (per-step detail in git")
    assert store.read_campaigns(tmp_path / "store").set_index("campaign").loc["balance", "title"] == "Balance runs"
    runs = store.read_records(tmp_path / "store", ["balance"])
    assert sorted(runs["record"]) == ["balance/steps.csv:a", "balance/steps.csv:b"]
    assert store.read_history(tmp_path / "store", ["balance"])["loss"].tolist() == [3.0, 2.5, 2.0, 3.1, 2.6, 2.2]
    sweep = store.read_records(tmp_path / "store", ["cpu_loss"], expand=True)
    assert set(sweep["kind"]) == {"run"} and sweep["tgs"].notna().all()

    assert migrate.ingest(results, tmp_path / "store") == {}  # nothing changed: nothing written
    append_row(results / "cpu_loss.csv", {"sweep": "cpu_loss", "point": "new", "status": "ok", "moe_path": "turbo",
                                          "date": "2026-11-30T00:00:00+00:00"})
    assert migrate.ingest(results, tmp_path / "store") == {"cpu_loss": 5}


def test_figures_drawn_from_files_and_from_the_store_are_identical(tmp_path):
    results = _small_tree(tmp_path)
    migrate.ingest(results, tmp_path / "store")
    compared = compare.compare_report(results, tmp_path / "store", tmp_path / "figures")
    assert compared and set(compared.values()) == {"same"}, compared
    assert "results.md" in compared and "loss_curves.png" in compared


def test_superseded_campaigns_stay_in_the_store_but_out_of_the_report(tmp_path):
    from turbo_moe.experiments.report import report

    migrate.ingest(FIXTURE, tmp_path / "store")
    migrate.mark_superseded(tmp_path / "store", {"paths_x_batch": ("", "old defaults")})
    assert "paths_x_batch" not in store.current_campaigns(tmp_path / "store")
    data = report.load_report_data(tmp_path / "store")
    assert "paths_x_batch" not in set(data.results["sweep"]) and "cpu_loss" in set(data.results["sweep"])
    assert "paths_x_batch" in set(store.read_records(tmp_path / "store")["campaign"])
