"""Results tables: one CSV row per sweep point, appended atomically.

Layout (git-ignored: ``turbo-moe report`` ingests these into this machine's results store,
``experiments/runs/store/``, and ``--publish`` into the committed one, ``experiments/store/``)::

    experiments/results/<sweep>.csv            one row per point run (the latest row of a point wins)
    experiments/results/<sweep>/<point>.json   the point's RunResult record (history, expert load, ...)

The ``record`` column holds the JSON path relative to the CSV's folder, so the tree can be moved.
Appending rewrites the table into a temporary file and ``os.replace``-s it over the old one: a kill at any
moment leaves either the old or the new table, never a half-written row. Writers in one folder take turns
(``flock`` on the folder), and new tables get the user's umask.

A table damaged by something else (a truncated copy, another tool killed mid-write) is read row by row:
a row with the wrong number of fields, no line end, or no valid status is left out with a warning
naming the file and line, so its point counts as not run and runs again; the next append keeps the
damaged text in ``<table>.damaged`` rather than dropping it. A cell of a ``NUMERIC_COLUMNS`` column that
is not a number is read as empty, with a warning naming the file, line and column.

No single value can make a table unreadable: an ``error`` cell is cut at ``ERROR_CHARS`` characters and
any other text cell at ``CELL_CHARS`` (the runner keeps a long error's full text beside the record, see
``keep_full_error``), and reading accepts fields of any length. A record that cannot be read (not
UTF-8, not JSON, not a JSON object, a ``summary`` that is not a mapping) is reported by file and reason
(``check_record``, ``DamagedRecordWarning``), never skipped in silence.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import secrets
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from turbo_moe import provenance
# Statuses a point can end with ("error" and "skipped" points are retried on re-run; FINAL ones are not).
from turbo_moe.status import FINAL_STATUSES, STATUSES  # noqa: F401
from turbo_moe.writer_lock import folder_lock

# Columns that lead every table, in this order; parameters follow, then summary and provenance fields.
LEAD_COLUMNS = ("sweep", "point", "point_key", "status", "error")
PROVENANCE_COLUMNS = provenance.TABLE_COLUMNS
TAIL_COLUMNS = ("elapsed_s", "record", "notebook_out")
# A sweep table must have these to tell which points finished with which parameters.
SWEEP_COLUMNS = ("point", "point_key", "status")
# Longest error text kept in a table cell, and longest other text cell; the rest is cut with a note.
ERROR_CHARS = 2000
CELL_CHARS = 20_000
# Columns read as numbers: a cell there that is not a number is reported and read as empty.
NUMERIC_COLUMNS = (
    "tgs", "mfu", "peak_memory_bytes", "compiled_temp_bytes", "final_loss", "final_eval_loss",
    "dropped_fraction_mean", "params_total", "params_active", "flops_per_token", "steps_done", "compile_time_s",
    "elapsed_s", "per_device_batch", "steps", "seq_len", "learning_rate", "warmup_steps", "capacity_factor",
    "seed", "eval_every", "eval_batches", "device_count", "ms", "tflops", "bound_tflops", "gbps",
)


def _cell(value: Any, limit: int = CELL_CHARS) -> Any:
    """A CSV-friendly cell: nested values become JSON text, text longer than ``limit`` is cut with a note."""
    if isinstance(value, (list, dict, tuple)):
        value = json.dumps(value, default=str)
    return cap_text(value, limit) if isinstance(value, str) else value


def cap_text(text: str, limit: int, where_full: str | None = None) -> str:
    """``text`` cut to at most ``limit`` characters, ending in a note of its full length (and where it is)."""
    if len(text) <= limit:
        return text
    note = f" [... cut: {len(text)} characters in all" + (f"; full text in {where_full}]" if where_full else "]")
    return text[:max(limit - len(note), 0)] + note


def keep_full_error(record_path: str | Path, error: str | None) -> str | None:
    """The error as a table cell: a text over ``ERROR_CHARS`` is written whole to ``<record>.error.txt``
    (beside the point's record) and the cell is cut, naming that file. Never raises: if the file cannot
    be written (a full disk), the cell is cut and says so."""
    if not isinstance(error, str) or len(error) <= ERROR_CHARS:
        return error
    full = Path(record_path).with_name(Path(record_path).name + ".error.txt")
    try:
        full.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(full, lambda f: f.write(error))
    except OSError as exc:
        return cap_text(error, ERROR_CHARS, f"nowhere (could not write {full}: {exc.strerror or exc})")
    return cap_text(error, ERROR_CHARS, full.name)


def append_row(csv_path: str | Path, row: Mapping[str, Any]) -> None:
    """Append ``row`` to the table at ``csv_path`` atomically (union of columns, stable order)."""
    csv_path = Path(csv_path)
    for col in ("sweep", "point", "status"):
        if col not in row:
            raise ValueError(f"append_row: row is missing the required column {col!r}")
    if row["status"] not in STATUSES:
        raise ValueError(f"append_row: status must be one of {STATUSES}, got {row['status']!r}")
    new = pd.DataFrame([{k: _cell(v, ERROR_CHARS if k == "error" else CELL_CHARS) for k, v in row.items()}])
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


def _folder_lock(folder: Path, timeout_s: float = 120.0):
    """Exclusive ``flock`` on the folder itself (no lock file to leave behind); waits up to ``timeout_s``."""
    return folder_lock(folder, timeout_s=timeout_s, busy_message=f"another process has been writing a results table "
                       f"in {folder} for over {timeout_s:.0f} s; try again")


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
    column: str | None = None  # set for one bad cell: the row is kept, that cell read as empty

    def __str__(self) -> str:
        if self.column is not None:
            return (f"{self.path} line {self.line} column {self.column!r}: {self.reason}; read as empty"
                    + (f" (point {self.point!r})" if self.point else ""))
        who = f" (point {self.point!r} will run again)" if self.point else ""
        return f"{self.path} line {self.line}: damaged row, {self.reason}; left out{who}"


@contextlib.contextmanager
def _any_field_size() -> Iterator[None]:
    """Read fields of any length (the csv module refuses fields over 128 KiB by default)."""
    old = csv.field_size_limit()
    csv.field_size_limit(sys.maxsize)
    try:
        yield
    finally:
        csv.field_size_limit(old)


def scan_table(csv_path: str | Path) -> tuple[pd.DataFrame, list[DamagedRow]]:
    """(the table's sound rows, its damaged rows and cells). Raises ValueError naming the file if it is
    unreadable. A damaged row is left out; a damaged cell (``DamagedRow.column`` set) is read as empty."""
    csv_path = Path(csv_path)
    try:
        text = csv_path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"results table {csv_path}: cannot read it ({exc})") from None
    with _any_field_size():
        return _scan_text(csv_path, text)


def _scan_text(csv_path: Path, text: str) -> tuple[pd.DataFrame, list[DamagedRow]]:
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
        sound_lines, sound_raw = [], []
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
                sound_lines.append(start)
                sound_raw.append(raw)
            else:
                point = fields[header.index("point")] if "point" in header and len(fields) > header.index("point") \
                    else None
                damaged.append(DamagedRow(csv_path, start, reason, point or None, raw))
        # Only empty cells are missing: the status "nan" and the text "None" must survive a round trip.
        table = pd.read_csv(io.StringIO("".join(sound)), keep_default_na=False, na_values=[""])
    except (csv.Error, pd.errors.ParserError, ValueError) as exc:
        raise ValueError(f"results table {csv_path}: cannot parse it ({exc})") from None
    damaged += _numeric_cells(csv_path, table, sound_lines, sound_raw)
    return table, damaged


def _numeric_cells(path: Path, table: pd.DataFrame, lines: list[int], raws: list[str]) -> list[DamagedRow]:
    """Read the ``NUMERIC_COLUMNS`` as numbers (in place); each cell that is not one is reported and emptied."""
    bad_cells = []
    for column in (c for c in NUMERIC_COLUMNS if c in table):
        values = table[column]
        if pd.api.types.is_numeric_dtype(values):
            continue
        numbers = pd.to_numeric(values, errors="coerce")
        bad = numbers.isna() & values.notna() & (values.astype(str).str.strip().str.lower() != "nan")
        for i in bad[bad].index:
            point = table.at[i, "point"] if "point" in table else None
            bad_cells.append(DamagedRow(path, lines[i], f"{str(values[i])[:40]!r} is not a number",
                                        str(point) if isinstance(point, str) else None, raws[i], column))
        table[column] = numbers.astype(float)
    return bad_cells


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
    """A results table has rows that were left out, or cells read as empty (see ``DamagedRow``)."""


class DamagedRecordWarning(UserWarning):
    """A point's JSON record exists but cannot be used (see ``read_record``); it is left out."""


def latest_rows(table: pd.DataFrame) -> pd.DataFrame:
    """Keep the last row of each (sweep, point): a re-run point replaces its earlier row."""
    if table.empty:
        return table
    return table.drop_duplicates(subset=[c for c in ("sweep", "point") if c in table], keep="last") \
        .reset_index(drop=True)


def missing_sweep_columns(table: pd.DataFrame) -> list[str]:
    """The ``SWEEP_COLUMNS`` a non-empty sweep table lacks."""
    return [] if table.empty else [c for c in SWEEP_COLUMNS if c not in table]


def _missing_columns_message(csv_path: Path, missing: list[str]) -> str:
    return (f"results table {csv_path} has no column {' or '.join(repr(c) for c in missing)} (a sweep table needs "
            f"{', '.join(SWEEP_COLUMNS)} to tell which points finished with which parameters); restore the table "
            f"(e.g. `git checkout -- {csv_path}`) or move it aside to run every point again")


def finished_points(csv_path: str | Path) -> dict[str, str]:
    """``{point name: point_key}`` of points whose latest row has a final status (ok/oom/nan)."""
    return {name: key for name, (key, status) in latest_status(csv_path).items() if status in FINAL_STATUSES}


def latest_status(csv_path: str | Path) -> dict[str, tuple[str, str]]:
    """``{point name: (point_key, status)}`` of every point's latest row.

    Raises ValueError naming the file when the table lacks a ``SWEEP_COLUMNS`` column: without it every
    finished point would be planned again.
    """
    csv_path = Path(csv_path)
    if not csv_path.exists():
        return {}
    table = latest_rows(read_table(csv_path))
    missing = missing_sweep_columns(table)
    if missing:
        raise ValueError(_missing_columns_message(csv_path, missing))
    if table.empty:
        return {}
    return {str(p): (str(k), str(s)) for p, k, s in zip(table["point"], table["point_key"], table["status"])}


def is_sweep_table(table: pd.DataFrame) -> bool:
    """A table written by sweeps (it names points), as opposed to a benchmark table."""
    return "point" in table or "point_key" in table


def load_results(results_dir: str | Path) -> pd.DataFrame:
    """All tables ``<results_dir>/*.csv`` except kernel benchmarks, latest row per point.

    Adds ``record_path``: the absolute path of each point's JSON record (or None). A sweep table without
    ``point`` or ``status``, and a row whose record file is missing, are left out of nothing silently: a
    ``DamagedTableWarning`` names the file (and line).
    """
    results_dir = Path(results_dir)
    frames = []
    for csv_path in sorted(results_dir.glob("*.csv")):
        if csv_path.name.startswith("kernels_"):
            continue
        table = read_table(csv_path)
        if table.empty or not is_sweep_table(table):
            continue
        missing = [c for c in ("point", "status") if c not in table]
        if missing:
            warnings.warn(_missing_columns_message(csv_path, missing) + "; left out of the report",
                          DamagedTableWarning, stacklevel=2)
            continue
        if "sweep" not in table:
            table["sweep"] = csv_path.stem
        table["record_path"] = [_record_path(results_dir, r, csv_path, point)
                                for r, point in zip(table.get("record", [None] * len(table)), table["point"])]
        frames.append(table)
    if not frames:
        return pd.DataFrame(columns=[*LEAD_COLUMNS, "record_path"])
    return latest_rows(pd.concat(frames, ignore_index=True))


def _record_path(results_dir: Path, record: Any, table: Path | None = None, point: Any = None) -> str | None:
    if not isinstance(record, str) or not record:
        return None
    path = Path(record) if Path(record).is_absolute() else results_dir / record
    if not path.exists():
        if table is not None:
            warnings.warn(f"{table}: the record {path} of point {point!r} does not exist; its curves are left out",
                          DamagedRecordWarning, stacklevel=3)
        return None
    return str(path)


def check_record(record: Any) -> str | None:
    """Why a parsed record cannot be used (None: it can). It must be a JSON object whose ``status`` is a
    string and whose ``summary`` and ``provenance`` are objects (or absent)."""
    if not isinstance(record, dict):
        return f"it is a JSON {type(record).__name__}, not an object"
    if "status" in record and not isinstance(record["status"], str):
        return f"its status is {record['status']!r}, not a string"
    for key in ("summary", "provenance"):
        if record.get(key) is not None and not isinstance(record[key], dict):
            return f"its {key!r} is a {type(record[key]).__name__}, not an object"
    if record.get("history") is not None and not isinstance(record["history"], list):
        return f"its 'history' is a {type(record['history']).__name__}, not a list"
    return None


def read_record(path: str | Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the record, None), or (None, why it cannot be used). An absent file is (None, "it does not exist")."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None, "it does not exist"
    except OSError as exc:
        return None, f"cannot read it ({exc.strerror or exc})"
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return None, f"it is not UTF-8 text (byte {exc.start})"
    except json.JSONDecodeError as exc:
        return None, f"it is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}; cut short?)"
    except RecursionError:
        return None, "it is nested too deeply to read"
    problem = check_record(record)
    return (None, problem) if problem else (record, None)


def load_record(path: str | Path | None) -> dict[str, Any] | None:
    """A point's JSON record (RunResult.to_dict layout), or None when absent or unusable; an existing
    record that cannot be used gives a ``DamagedRecordWarning`` naming the file and the reason."""
    if path is None or (isinstance(path, float) and math.isnan(path)):
        return None
    record, problem = read_record(path)
    if problem is not None and problem != "it does not exist":
        warnings.warn(f"record {path}: {problem}; left out", DamagedRecordWarning, stacklevel=2)
    return record


def scan_results(results_dir: str | Path) -> list[str]:
    """Every problem the report would meet in ``results_dir``, one line each: unreadable tables, damaged
    rows and cells, sweep tables without their columns, missing or damaged records."""
    problems = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for csv_path in sorted(Path(results_dir).glob("*.csv")):
            try:
                table, damaged = scan_table(csv_path)
            except ValueError as exc:
                problems.append(str(exc))
                continue
            problems += [str(d) for d in damaged]
            if table.empty or not is_sweep_table(table) or csv_path.name.startswith("kernels_"):
                continue
            missing = [c for c in ("point", "status") if c not in table]
            if missing:
                problems.append(_missing_columns_message(csv_path, missing) + "; left out of the report")
                continue
            for record, point in zip(table.get("record", [None] * len(table)), table["point"]):
                path = _record_path(Path(results_dir), record, csv_path, point)
                if path is not None:
                    load_record(path)
    problems += [str(w.message) for w in caught if issubclass(w.category, (DamagedRecordWarning,))]
    return list(dict.fromkeys(problems))


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
