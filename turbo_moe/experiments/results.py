"""Results tables: one CSV row per sweep point, appended atomically.

Layout (committed)::

    experiments/results/<sweep>.csv            one row per point run (the latest row of a point wins)
    experiments/results/<sweep>/<point>.json   the point's RunResult record (history, expert load, ...)

The ``record`` column holds the JSON path relative to the CSV's folder, so the tree can be moved.
Appending rewrites the table into a temporary file and ``os.replace``-s it over the old one: a kill at any
moment leaves either the old or the new table, never a half-written row.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

# Statuses a point can end with. "error" points are retried on re-run; so are "skipped" ones (not run
# because a smaller point of the spec's oom_frontier ran out of memory). The others are final.
STATUSES = ("ok", "oom", "nan", "error", "skipped")
FINAL_STATUSES = ("ok", "oom", "nan")
# Columns that lead every table, in this order; parameters follow, then summary and provenance fields.
LEAD_COLUMNS = ("sweep", "point", "point_key", "status", "error")
PROVENANCE_COLUMNS = ("device_kind", "device_count", "platform", "jax_version", "git_commit", "date")
TAIL_COLUMNS = ("elapsed_s", "record", "notebook_out")


def _cell(value: Any) -> Any:
    """A CSV-friendly cell: nested values become JSON text."""
    if isinstance(value, (list, dict, tuple)):
        return json.dumps(value, default=str)
    return value


def append_row(csv_path: str | Path, row: Mapping[str, Any]) -> None:
    """Append ``row`` to the table at ``csv_path`` atomically (union of columns, stable order)."""
    csv_path = Path(csv_path)
    for col in ("sweep", "point", "status"):
        if col not in row:
            raise ValueError(f"append_row: row is missing the required column {col!r}")
    if row["status"] not in STATUSES:
        raise ValueError(f"append_row: status must be one of {STATUSES}, got {row['status']!r}")
    new = pd.DataFrame([{k: _cell(v) for k, v in row.items()}])
    old = read_table(csv_path) if csv_path.exists() else None
    table = new if old is None or old.empty else pd.concat([old, new], ignore_index=True)
    table = table[_ordered_columns(list(table.columns))]
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=csv_path.parent, prefix=f".{csv_path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            table.to_csv(f, index=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, csv_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _ordered_columns(columns: list[str]) -> list[str]:
    lead = [c for c in LEAD_COLUMNS if c in columns]
    tail = [c for c in (*PROVENANCE_COLUMNS, *TAIL_COLUMNS) if c in columns]
    middle = [c for c in columns if c not in lead and c not in tail]
    return lead + middle + tail


def read_table(csv_path: str | Path) -> pd.DataFrame:
    """Every row of one results table, in append order (an empty frame if the file is empty)."""
    try:
        # Only empty cells are missing: the status "nan" and the text "None" must survive a round trip.
        return pd.read_csv(csv_path, keep_default_na=False, na_values=[""])
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


def latest_rows(table: pd.DataFrame) -> pd.DataFrame:
    """Keep the last row of each (sweep, point): a re-run point replaces its earlier row."""
    if table.empty:
        return table
    return table.drop_duplicates(subset=["sweep", "point"], keep="last").reset_index(drop=True)


def finished_points(csv_path: str | Path) -> dict[str, str]:
    """``{point name: point_key}`` of points whose latest row has a final status (ok/oom/nan)."""
    return {name: key for name, (key, status) in latest_status(csv_path).items() if status in FINAL_STATUSES}


def latest_status(csv_path: str | Path) -> dict[str, tuple[str, str]]:
    """``{point name: (point_key, status)}`` of every point's latest row."""
    csv_path = Path(csv_path)
    if not csv_path.exists():
        return {}
    table = latest_rows(read_table(csv_path))
    if table.empty or "point_key" not in table:
        return {}
    return {str(p): (str(k), str(s)) for p, k, s in zip(table["point"], table["point_key"], table["status"])}


def load_results(results_dir: str | Path) -> pd.DataFrame:
    """All tables ``<results_dir>/*.csv`` except kernel benchmarks, latest row per point.

    Adds ``record_path``: the absolute path of each point's JSON record (or None).
    """
    results_dir = Path(results_dir)
    frames = []
    for csv_path in sorted(results_dir.glob("*.csv")):
        if csv_path.name.startswith("kernels_"):
            continue
        table = read_table(csv_path)
        if table.empty or "point" not in table:
            continue
        if "sweep" not in table:
            table["sweep"] = csv_path.stem
        table["record_path"] = [_record_path(results_dir, r) for r in table.get("record", [None] * len(table))]
        frames.append(table)
    if not frames:
        return pd.DataFrame(columns=[*LEAD_COLUMNS, "record_path"])
    return latest_rows(pd.concat(frames, ignore_index=True))


def _record_path(results_dir: Path, record: Any) -> str | None:
    if not isinstance(record, str) or not record:
        return None
    path = Path(record) if Path(record).is_absolute() else results_dir / record
    return str(path) if path.exists() else None


def load_record(path: str | Path | None) -> dict[str, Any] | None:
    """A point's JSON record (RunResult.to_dict layout), or None when absent/unreadable."""
    if path is None or (isinstance(path, float) and math.isnan(path)):
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def load_kernel_tables(results_dir: str | Path) -> pd.DataFrame:
    """Concatenate ``kernels_<device>.csv`` benchmark tables (empty frame if there are none)."""
    frames = [read_table(p).assign(table=p.stem) for p in sorted(Path(results_dir).glob("kernels_*.csv"))]
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
