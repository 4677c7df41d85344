"""Check a migration: every table and JSON record rebuilt from the store equals the file it came from.

``check(results_dir, store_dir)`` returns one line per mismatch (an empty list: nothing lost). Tables are
compared as ``results.read_table`` parses them (values and dtypes); JSON records after ``flatten_step``
(per-step detail that ``sources.stored`` says stays in git history is left out of both sides).
``report.compare`` draws the report both ways (files vs store) and compares the figures.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from turbo_moe.experiments.store import results, store
from turbo_moe.experiments.store.result_records import json_record, load_json


def rebuild_table(store_dir: str | Path, campaign: str, source: str) -> pd.DataFrame:
    """The table ``source`` of ``campaign`` as it was, from the store."""
    sources = store.read_sources(store_dir, [campaign])
    row = sources[sources["path"] == source]
    if row.empty:
        raise KeyError(f"{source} is not a source of campaign {campaign!r}")
    columns = json.loads(row.iloc[0]["columns"])
    records = store.read_records(store_dir, [campaign])
    records = records[records["source"] == source]
    history = store.read_history(store_dir, [campaign], records=records["record"], wide=False)
    return store.table_frame(records, columns, history)


def _normal(document: Any, record: str, table: str, source: str) -> dict[str, Any]:
    rec, _ = json_record(document, record=record, table=table, source=source)
    out = {"config": rec.config, "provenance": rec.provenance, "summary": rec.summary,
           "extra": {k: v for k, v in rec.extra.items() if not k.startswith("_")},
           "history": {h["step"]: {k: v for k, v in h.items() if v is not None} for h in rec.history}}
    return json.loads(json.dumps(out, default=str))


def _stored_document(row: pd.Series, history: pd.DataFrame) -> dict[str, Any]:
    steps = history[history["record"] == row["record"]]
    out = {column: json.loads(row[column]) for column in ("config", "provenance", "summary")}
    extra = json.loads(row["extra"])
    plain = {k: v for k, v in extra.items() if not k.startswith("_")}
    out["extra"] = extra["document"] if "document" in extra else plain
    out["history"] = {int(s): {"step": int(s), **dict(zip(p["metric"], p["value"]))} for s, p in steps.groupby("step")}
    return json.loads(json.dumps(out, default=str))


def _same(a: Any, b: Any, where: str, out: list[str], subset: bool = False) -> None:
    """Append a line per difference; ``subset``: the store may hold more keys than the file (a sweep row's)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | (set() if subset else set(b)), key=str):
            if key not in a or key not in b:
                out.append(f"{where}.{key}: only in {'the file' if key in a else 'the store'}")
            else:
                _same(a[key], b[key], f"{where}.{key}", out, subset)
    elif isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        if not (a == b or (math.isnan(a) and math.isnan(b))):
            out.append(f"{where}: {a!r} in the file, {b!r} in the store")
    elif a != b:
        out.append(f"{where}: {str(a)[:80]!r} in the file, {str(b)[:80]!r} in the store")


def check(results_dir: str | Path, store_dir: str | Path, campaigns: Iterable[str] | None = None) -> list[str]:
    """Rebuild every migrated table and JSON file of ``campaigns`` and compare it with the file."""
    results_dir, problems = Path(results_dir), []
    names = list(campaigns) if campaigns else store.campaign_names(store_dir, "sources")
    for campaign in names:
        sources = store.read_sources(store_dir, [campaign])
        records = store.read_records(store_dir, [campaign])
        history = store.read_history(store_dir, [campaign], wide=False)
        for _, source in sources.iterrows():
            path = results_dir / source["path"]
            if not path.exists():
                continue
            where = f"{campaign}: {source['path']}"
            if source["format"] == "csv":
                original, _ = results.scan_table(path)
                rebuilt = rebuild_table(store_dir, campaign, source["path"])
                try:
                    pd.testing.assert_frame_equal(original.reset_index(drop=True), rebuilt, check_exact=True)
                except AssertionError as exc:
                    problems.append(f"{where}: {' '.join(str(exc).split())[:300]}")
            elif source["format"] == "json" and source["stored"].startswith("records"):
                merged = source["stored"].startswith("records (with")  # a sweep row's JSON record
                rows = records[records["extra"].map(lambda e: json.loads(e).get("_record_file")) == source["path"]] \
                    if merged else records[records["record"] == source["path"]]
                if rows.empty:
                    problems.append(f"{where}: no record")
                    continue
                row = rows.iloc[0]
                original = _normal(load_json(path.read_bytes(), path.name), row["record"], row["table"], row["source"])
                stored = _stored_document(row, history)
                if "detail in git" in source["stored"]:  # per-step traces left in git history: compare the rest
                    original["history"] = {s: {k: v for k, v in h.items() if k in stored["history"].get(s, {})}
                                           for s, h in original["history"].items()}
                original["history"] = {str(k): v for k, v in original["history"].items()}
                stored["history"] = {str(k): v for k, v in stored["history"].items()}
                _same(original, stored, where, problems, subset=merged)
            elif source["format"] == "text" and source["stored"] == "inline":
                if path.read_text() != source["text"]:
                    problems.append(f"{where}: inline text differs")
    return problems
