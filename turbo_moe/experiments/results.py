"""Results tables: one CSV row per sweep point, appended atomically.

Layout (committed)::

    experiments/results/<sweep>.csv            one row per point run (the latest row of a point wins)
    experiments/results/<sweep>/<point>.json   the point's RunResult record (history, expert load, ...)

The ``record`` column holds the JSON path relative to the CSV's folder, so the tree can be moved.
Appending rewrites the table into a temporary file and ``os.replace``-s it over the old one: a kill at any
moment leaves either the old or the new table, never a half-written row. Writers in one folder take turns
(``flock`` on the folder), and new tables get the user's umask.

A table damaged by something else (a truncated copy, another tool killed mid-write) is read row by row:
a row with the wrong number of fields, no line end, or no valid status is left out with a warning
naming the file and line, so its point counts as not run and runs again; the next append keeps the
damaged text in ``<table>.damaged`` rather than dropping it.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import fcntl
import io
import json
import math
import os
import secrets
import time
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from turbo_moe import provenance
# Statuses a point can end with ("error" and "skipped" points are retried on re-run; FINAL ones are not).
from turbo_moe.status import FINAL_STATUSES, STATUSES  # noqa: F401

# Columns that lead every table, in this order; parameters follow, then summary and provenance fields.
LEAD_COLUMNS = ("sweep", "point", "point_key", "status", "error")
PROVENANCE_COLUMNS = provenance.TABLE_COLUMNS
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
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    with _folder_lock(csv_path.parent):  # read-modify-write: another writer must not slip in between
        old, damaged = scan_table(csv_path) if csv_path.exists() else (None, [])
        if damaged:  # rewriting drops them from the table: keep their text for whoever investigates
            with open(csv_path.with_name(csv_path.name + ".damaged"), "a") as keep:
                keep.writelines(f"# {d}\n{d.text}{'' if d.text.endswith(chr(10)) else chr(10)}" for d in damaged)
        table = new if old is None or old.empty else pd.concat([old, new], ignore_index=True)
        table = table[_ordered_columns(list(table.columns))]
        write_atomic(csv_path, lambda f: table.to_csv(f, index=False))


def write_atomic(path: str | Path, write) -> None:
    """``write(text_file)`` into a temporary file next to ``path``, then rename it over ``path``.

    The temporary file is created with mode 0666 minus the umask, like any new file (``mkstemp``
    would make it 0600, and the rename would carry that onto the table).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def _folder_lock(folder: Path, timeout_s: float = 120.0) -> Iterator[None]:
    """Exclusive ``flock`` on the folder itself (no lock file to leave behind); waits up to ``timeout_s``."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been writing a results table in {folder} for "
                                       f"over {timeout_s:.0f} s; try again") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _ordered_columns(columns: list[str]) -> list[str]:
    lead = [c for c in LEAD_COLUMNS if c in columns]
    tail = [c for c in (*PROVENANCE_COLUMNS, *TAIL_COLUMNS) if c in columns]
    middle = [c for c in columns if c not in lead and c not in tail]
    return lead + middle + tail


@dataclasses.dataclass(frozen=True)
class DamagedRow:
    """A row of a results table that cannot be trusted, where it is and why."""

    path: Path
    line: int  # 1-based line where the row starts
    reason: str
    point: str | None  # the point it seems to belong to, if that field survived
    text: str  # the raw text of the row

    def __str__(self) -> str:
        who = f" (point {self.point!r} will run again)" if self.point else ""
        return f"{self.path} line {self.line}: damaged row, {self.reason}; left out{who}"


def scan_table(csv_path: str | Path) -> tuple[pd.DataFrame, list[DamagedRow]]:
    """(the table's sound rows, its damaged rows). Raises ValueError naming the file if it is unreadable."""
    csv_path = Path(csv_path)
    try:
        text = csv_path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"results table {csv_path}: cannot read it ({exc})") from None
    # Split on "\n" only (str.splitlines would also split on characters that JSON text may hold).
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    consumed: list[str] = []

    def feed():
        for line in lines:
            consumed.append(line)
            yield line

    reader = csv.reader(feed())
    try:
        header = next(reader, None)
        if header is None or not any(header):
            return pd.DataFrame(), []
        sound, damaged, line = ["".join(consumed)], [], len(consumed) + 1
        consumed.clear()
        for fields in reader:
            raw, start = "".join(consumed), line
            line += len(consumed)
            consumed.clear()
            if not raw.strip():
                continue
            reason = _row_problem(header, fields, raw)
            if reason is None:
                sound.append(raw)
            else:
                point = fields[header.index("point")] if "point" in header and len(fields) > header.index("point") \
                    else None
                damaged.append(DamagedRow(csv_path, start, reason, point or None, raw))
        # Only empty cells are missing: the status "nan" and the text "None" must survive a round trip.
        table = pd.read_csv(io.StringIO("".join(sound)), keep_default_na=False, na_values=[""])
    except (csv.Error, pd.errors.ParserError, ValueError) as exc:
        raise ValueError(f"results table {csv_path}: cannot parse it ({exc})") from None
    return table, damaged


def _row_problem(header: list[str], fields: list[str], raw: str) -> str | None:
    if len(fields) != len(header):
        return f"{len(fields)} fields where the header has {len(header)} (truncated or garbled)"
    if not raw.endswith("\n"):
        return "no line end (the file was cut inside this row)"
    row = dict(zip(header, fields))
    if not {"sweep", "point", "status"} <= set(row):  # not a sweep table (a kernel benchmark, say)
        return None
    if row["status"] not in STATUSES:
        return f"status {row['status'][:40]!r} is not one of {STATUSES}"
    if not row["point"]:
        return "empty point name"
    return None


def read_table(csv_path: str | Path) -> pd.DataFrame:
    """Every sound row of one results table, in append order (an empty frame if the file is empty).

    Damaged rows are left out with a warning naming the file and line (see ``scan_table``).
    """
    table, damaged = scan_table(csv_path)
    for row in damaged:
        warnings.warn(str(row), DamagedTableWarning, stacklevel=2)
    return table


class DamagedTableWarning(UserWarning):
    """A results table has rows that were left out (see ``DamagedRow``)."""


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
    frames = [_schema_columns(read_table(p)).assign(table=p.stem)
              for p in sorted(Path(results_dir).glob("kernels_*.csv"))]
    frames = [f for f in frames if not f.empty]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _schema_columns(table: pd.DataFrame) -> pd.DataFrame:
    """Old benchmark tables spelled provenance ``device``/``jax``/``commit``: rename to the schema's names."""
    renames = {old: new for old, new in provenance.LEGACY_NAMES.items() if old in table and new not in table}
    return table.rename(columns=renames)
