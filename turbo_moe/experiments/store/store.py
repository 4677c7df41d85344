"""The results store: every run and benchmark record in one schema, Parquet files partitioned by campaign.

Layout (committed)::

    experiments/store/records/campaign=<name>/part-0.parquet   one row per record (RECORD_SCHEMA)
    experiments/store/history/campaign=<name>/part-0.parquet   per-step values, long (HISTORY_SCHEMA)
    experiments/store/sources/campaign=<name>/part-0.parquet   every file a campaign was read from
    experiments/store/campaigns.parquet                        one row per campaign: title, status, note
    experiments/store/SHA256SUMS                               every file's sha256, checked on every read

The same layout serves this machine's git-ignored store, ``experiments/runs/store/`` (see ``report``). One file
per campaign and table, not one per table: a damaged file leaves one campaign out of the report, not all, and a
publish rewrites only the campaigns it touches. How a file is encoded (zstd, statistics, row order): ``files``;
``compact`` (``migrate --compact``) rewrites a store written before that encoding, whose files read as they are.

pandas reads any of them in one line, e.g. ``pd.read_parquet("experiments/store/records")`` (the
``campaign`` column comes from the folder names). A record's ``config``, ``provenance``, ``summary`` and
``extra`` are JSON objects kept as text, since a training run has ~90 config fields and a kernel row ten:
``read_records(..., expand=True)`` flattens them into columns. A campaign is one round of work that
belongs together (a sweep, one benchmark's tables); ``status`` says whether the report draws it
(``current``) or keeps it for history (``superseded``, ``history``).

Writes replace a campaign's files atomically (temporary file, then rename); an upsert keeps the records
it does not name. A file that cannot be read raises ``StoreError`` naming it: nothing is dropped silently.

Damage is detected, not drawn: every file's sha256 is listed in ``<store>/SHA256SUMS`` (the format of
``sha256sum``, so ``cd experiments/store && sha256sum -c SHA256SUMS`` checks it too) and checked on every
read; Parquet page checksums are written and verified as well. Writers take turns (``flock`` on the store
folder); while a file is replaced the manifest lists both its old and its new hash, so a kill at any
moment leaves a store that reads. ``rehash`` lists the files of a store that has no manifest yet.

A summary value that cannot be a measurement (inf, -inf, NaN in a run that ended ok, a negative time or
throughput) is flagged where it enters the store: the record's ``extra["_invalid"]`` maps the metric to
its value as text, and the report shows it as invalid instead of drawing it (``invalid_metrics``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from turbo_moe.experiments.store.files import (MANIFEST, StoreError, check_file, compact,  # noqa: F401
                                               read_manifest, rehash, remove, store_files, store_lock, write_parquet)

DEFAULT_STORE = Path("experiments") / "store"
CAMPAIGN_STATUSES = ("current", "superseded", "history")
RECORD_KINDS = ("run", "benchmark")

RECORD_SCHEMA = pa.schema([
    ("record", pa.string()),      # id, unique within the campaign
    ("kind", pa.string()),        # RECORD_KINDS
    ("table", pa.string()),       # the table or sweep the record belongs to (a campaign may hold several)
    ("source", pa.string()),      # the file it was read from, relative to the results folder
    ("status", pa.string()),      # ok / oom / nan / error / skipped; null for benchmark rows without one
    ("error", pa.string()),
    ("date", pa.string()),        # ISO date of the measurement (from its provenance)
    ("git_commit", pa.string()),
    ("device", pa.string()),
    ("config", pa.string()),      # JSON: every setting of the run or benchmark case
    ("provenance", pa.string()),  # JSON: device, versions, commit, date, host, flags
    ("summary", pa.string()),     # JSON: the measured numbers
    ("extra", pa.string()),       # JSON: anything else the source held (arrays, bookkeeping columns)
])
HISTORY_SCHEMA = pa.schema([
    ("record", pa.string()), ("step", pa.int64()), ("metric", pa.string()), ("value", pa.float64()),
])
SOURCE_SCHEMA = pa.schema([
    ("path", pa.string()),        # relative to the results folder
    ("format", pa.string()),      # csv / json / jsonl / text / binary
    ("bytes", pa.int64()),
    ("sha256", pa.string()),
    ("stored", pa.string()),      # where its content lives now: records, inline, or the git commit holding it
    ("columns", pa.string()),     # JSON list: a table's column order (to rebuild it)
    ("text", pa.string()),        # small text files (logs, notes) kept inline
])
CAMPAIGN_SCHEMA = pa.schema([
    ("campaign", pa.string()), ("title", pa.string()), ("status", pa.string()),
    ("superseded_by", pa.string()), ("note", pa.string()),
])
_DATASETS = {"records": RECORD_SCHEMA, "history": HISTORY_SCHEMA, "sources": SOURCE_SCHEMA}
_JSON_COLUMNS = ("config", "provenance", "summary", "extra")


@dataclasses.dataclass
class Record:
    """One run or benchmark case. ``history``: one mapping per logged step (``step`` plus numbers)."""

    record: str
    kind: str
    table: str
    source: str
    status: str | None = None
    error: str | None = None
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)
    summary: dict[str, Any] = dataclasses.field(default_factory=dict)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def row(self) -> dict[str, Any]:
        if self.kind not in RECORD_KINDS:
            raise StoreError(f"record {self.record!r}: kind must be one of {RECORD_KINDS}, got {self.kind!r}")
        prov = self.provenance
        invalid = invalid_metrics(self.summary, self.status)
        extra = {**self.extra, "_invalid": invalid} if invalid else self.extra
        return {"record": self.record, "kind": self.kind, "table": self.table, "source": self.source,
                "status": _text(self.status), "error": _text(self.error),
                "date": _text(prov.get("date")), "git_commit": _text(prov.get("git_commit", prov.get("commit"))),
                "device": _text(prov.get("device_kind", prov.get("device"))),
                **{name: to_json(getattr(self, name)) for name in ("config", "provenance", "summary")},
                "extra": to_json(extra)}

    def history_rows(self) -> list[dict[str, Any]]:
        rows = []
        for i, entry in enumerate(self.history):
            step = entry.get("step", i)
            for metric, value in entry.items():
                if metric != "step" and _number(value):
                    rows.append({"record": self.record, "step": int(step), "metric": metric, "value": float(value)})
        return rows


# Summary metrics that are never negative (words of the name, as migrate splits them); a name that also holds
# one of the _SIGNED words is a difference and may be.
_NON_NEGATIVE = {"tgs", "mfu", "tflops", "gflops", "gbps", "ms", "s", "bytes", "gib", "flops", "tokens", "time",
                 "seconds", "memory", "loss", "ce", "dropped", "load"}
_SIGNED = {"diff", "delta", "gap", "penalty", "change", "log", "margin", "rel", "error", "over", "vs"}


# Measured in every run that ends ok: NaN there is a broken measurement (elsewhere NaN means "not
# measured", e.g. MFU on a CPU without a known peak, the eval loss of a run without evaluations).
_REQUIRED_WHEN_OK = {"tgs", "final_loss"}


def invalid_metrics(summary: Mapping[str, Any], status: str | None = None) -> dict[str, str]:
    """{metric: value as text} for the summary numbers that cannot be measurements: inf or -inf; NaN where an
    ok run must have a value (``_REQUIRED_WHEN_OK``; a run whose loss went NaN has status "nan"); a negative
    throughput, time, size, fraction or loss (``_NON_NEGATIVE``)."""
    flagged = {}
    for name, value in summary.items():
        if not _number(value):
            continue
        words = set(str(name).lower().replace("-", "_").replace(".", "_").split("_"))
        nan_here = math.isnan(value) and status in (None, "ok") and name in _REQUIRED_WHEN_OK
        if math.isinf(value) or nan_here or (value < 0 and words & _NON_NEGATIVE and not words & _SIGNED):
            flagged[str(name)] = "NaN" if math.isnan(value) else f"{value:g}"
    return flagged


def _text(value: Any) -> str | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return str(value)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def to_json(value: Mapping[str, Any]) -> str:
    return json.dumps(value, default=_plain, allow_nan=True)


def _plain(value: Any) -> Any:
    """numpy scalars and arrays as Python values (anything else as text)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


# ----------------------------------------------------------------------------------------------------- write

def _partition(store: Path, dataset: str, campaign: str) -> Path:
    if not campaign or "/" in campaign or campaign.startswith("."):
        raise StoreError(f"campaign name {campaign!r}: must be a plain, non-empty folder name")
    return Path(store) / dataset / f"campaign={campaign}" / "part-0.parquet"


def _table(rows: Sequence[Mapping[str, Any]] | pd.DataFrame, schema: pa.Schema) -> pa.Table:
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows), columns=schema.names)
    frame = frame.reindex(columns=schema.names)
    return pa.Table.from_pandas(frame, schema=schema, preserve_index=False)


def write_campaign(store: str | Path, campaign: str, records: Iterable[Record], *,
                   sources: Sequence[Mapping[str, Any]] = (), replace: bool = False) -> int:
    """Write ``records`` (and their history) into ``campaign``; returns the number written.

    ``replace=False`` (an upsert) keeps the campaign's other records and sources; a record or source with
    the same id/path is replaced. ``replace=True`` writes the campaign anew.
    """
    store = Path(store)
    records = list(records)
    ids = [r.record for r in records]
    if len(set(ids)) != len(ids):
        twice = sorted({i for i in ids if ids.count(i) > 1})
        raise StoreError(f"campaign {campaign!r}: record ids given twice: {twice[:5]}")
    new = {"records": pd.DataFrame([r.row() for r in records], columns=RECORD_SCHEMA.names),
           "history": pd.DataFrame([h for r in records for h in r.history_rows()], columns=HISTORY_SCHEMA.names),
           "sources": pd.DataFrame(list(sources), columns=SOURCE_SCHEMA.names)}
    keys = {"records": ("record", set(ids)), "history": ("record", set(ids)),
            "sources": ("path", {s["path"] for s in sources})}
    with store_lock(store):  # read-modify-write: another writer must not slip in between
        for dataset, frame in new.items():
            path = _partition(store, dataset, campaign)
            if not replace and path.exists():
                old = read_partition(path, _DATASETS[dataset])
                column, names = keys[dataset]
                frame = pd.concat([old[~old[column].isin(names)], frame], ignore_index=True)
            if frame.empty and dataset != "records":
                remove(store, path)
                continue
            write_parquet(store, _table(frame, _DATASETS[dataset]), path)
    return len(records)


def write_campaigns(store: str | Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Upsert rows of ``campaigns.parquet`` (title, status, superseded_by, note per campaign)."""
    rows = list(rows)
    for row in rows:
        if row.get("status", "current") not in CAMPAIGN_STATUSES:
            raise StoreError(f"campaign {row.get('campaign')!r}: status must be one of {CAMPAIGN_STATUSES}, "
                             f"got {row.get('status')!r}")
    store = Path(store)
    path = store / "campaigns.parquet"
    frame = pd.DataFrame(rows, columns=CAMPAIGN_SCHEMA.names)
    frame["status"] = frame["status"].fillna("current")
    with store_lock(store):
        if path.exists():
            old = read_partition(path, CAMPAIGN_SCHEMA)
            frame = pd.concat([old[~old["campaign"].isin(frame["campaign"])], frame], ignore_index=True)
        write_parquet(store, _table(frame.sort_values("campaign"), CAMPAIGN_SCHEMA), path)


# ------------------------------------------------------------------------------------------------------ read

def read_partition(path: str | Path, schema: pa.Schema) -> pd.DataFrame:
    """One Parquet file as a frame with ``schema``'s columns, after its sha256 and page checksums are checked;
    StoreError naming the file if it is damaged or unreadable."""
    check_file(path)
    try:
        table = pq.read_table(path, page_checksum_verification=True)
        missing = [c for c in schema.names if c not in table.column_names]
        if missing:
            raise StoreError(f"results store file {path}: columns {missing} missing (expected {schema.names})")
        return table.select(schema.names).to_pandas()
    except (OSError, pa.ArrowException, KeyError, ValueError, TypeError) as exc:
        if isinstance(exc, StoreError):
            raise
        raise StoreError(f"results store file {path}: cannot read it ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:200]}); restore it from git (git checkout -- {path}) or run "
                         "the ingest again") from None


def campaign_names(store: str | Path, dataset: str = "records") -> list[str]:
    root = Path(store) / dataset
    return sorted(p.name.split("=", 1)[1] for p in root.glob("campaign=*") if p.is_dir()) if root.is_dir() else []


def _read(store: str | Path, dataset: str, campaigns: Iterable[str] | None) -> pd.DataFrame:
    names = campaign_names(store, dataset) if campaigns is None else list(campaigns)
    frames = []
    for name in names:
        path = _partition(Path(store), dataset, name)
        if path.exists():
            frames.append(read_partition(path, _DATASETS[dataset]).assign(campaign=name))
    if not frames:
        return pd.DataFrame(columns=["campaign", *_DATASETS[dataset].names])
    frame = pd.concat(frames, ignore_index=True)
    return frame[["campaign", *_DATASETS[dataset].names]]


def read_records(store: str | Path = DEFAULT_STORE, campaigns: Iterable[str] | None = None, *,
                 expand: bool = False) -> pd.DataFrame:
    """Every record of ``campaigns`` (all by default). ``expand``: config, summary and provenance
    flattened into columns (a name in several of them: config first, then summary, then provenance)."""
    frame = _read(store, "records", campaigns)
    return expand_records(frame) if expand else frame


def expand_records(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with its JSON columns parsed and their fields as columns (nested values as JSON text)."""
    rows = []
    for _, row in frame.iterrows():
        flat = {}
        for column in ("provenance", "summary", "extra", "config"):  # later ones win a clash
            fields = json.loads(row[column]) if isinstance(row[column], str) else {}
            if column == "extra":  # bookkeeping (_row, ...) and a sweep record's whole document stay out
                fields = {k: v for k, v in fields.items() if not k.startswith("_") and k != "document"}
            flat.update(_scalars(fields))
        base = {c: row[c] for c in frame.columns if c not in _JSON_COLUMNS}
        rows.append({**flat, **{k: v for k, v in base.items() if v is not None or k not in flat}})
    return pd.DataFrame(rows)


def _scalars(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (to_json(v) if isinstance(v, (dict, list)) else v) for k, v in mapping.items()}


def read_history(store: str | Path = DEFAULT_STORE, campaigns: Iterable[str] | None = None, *,
                 records: Iterable[str] | None = None, wide: bool = True) -> pd.DataFrame:
    """Per-step values; ``wide``: one row per (campaign, record, step), one column per metric."""
    frame = _read(store, "history", campaigns)
    if records is not None:
        frame = frame[frame["record"].isin(set(records))]
    if not wide or frame.empty:
        return frame
    wide_frame = frame.pivot_table(index=["campaign", "record", "step"], columns="metric", values="value",
                                   aggfunc="last", sort=False)
    # One order whatever order a file holds its rows in: campaigns as asked, then record and step; metrics by name.
    wide_frame = wide_frame.sort_index(axis=1).reset_index()
    campaign_order = wide_frame.groupby("campaign", sort=False).ngroup()
    wide_frame = wide_frame.assign(_order=campaign_order).sort_values(["_order", "record", "step"], kind="stable")
    wide_frame = wide_frame.drop(columns="_order").reset_index(drop=True)
    wide_frame.columns.name = None
    return wide_frame


def read_sources(store: str | Path = DEFAULT_STORE, campaigns: Iterable[str] | None = None) -> pd.DataFrame:
    return _read(store, "sources", campaigns)


def read_campaigns(store: str | Path = DEFAULT_STORE) -> pd.DataFrame:
    """One row per campaign in the store (title, status, note; status ``current`` where none was set)."""
    path = Path(store) / "campaigns.parquet"
    meta = read_partition(path, CAMPAIGN_SCHEMA) if path.exists() else pd.DataFrame(columns=CAMPAIGN_SCHEMA.names)
    names = pd.DataFrame({"campaign": campaign_names(store)})
    frame = names.merge(meta, on="campaign", how="left")
    frame["status"] = frame["status"].fillna("current")
    return frame


def current_campaigns(store: str | Path = DEFAULT_STORE) -> list[str]:
    frame = read_campaigns(store)
    return list(frame.loc[frame["status"] == "current", "campaign"])


def record_dict(row: Mapping[str, Any], history: pd.DataFrame | None = None) -> dict[str, Any]:
    """A record row (from ``read_records``) back as one mapping: config, summary, provenance and extra
    merged at the top level, plus ``history`` (list of per-step mappings) when ``history`` is given."""
    out: dict[str, Any] = {}
    for column in ("config", "summary", "provenance", "extra"):
        out.update(json.loads(row[column]) if isinstance(row[column], str) else {})
    if history is not None:
        steps = history[history["record"] == row["record"]]
        out["history"] = [{"step": int(step), **dict(zip(part["metric"], part["value"]))}
                          for step, part in steps.groupby("step", sort=True)]
    return out


def check_campaign(store: str | Path, campaign: str) -> None:
    """StoreError naming the first damaged file of ``campaign`` (records, history, sources)."""
    for dataset in _DATASETS:
        path = _partition(Path(store), dataset, campaign)
        if path.exists():
            check_file(path)


def verify(store: str | Path = DEFAULT_STORE) -> list[str]:
    """Read every file of the store; returns one line per problem (an empty list: all readable)."""
    store = Path(store)
    problems = []
    for path in store_files(store):
        try:
            check_file(path)
        except StoreError as exc:
            problems.append(str(exc))
    listed = read_manifest(store) or {}
    problems += [f"results store file {store / name}: listed in {MANIFEST} but missing" for name in sorted(listed)
                 if not (store / name).exists()]
    return problems


# --------------------------------------------------------------------------------------------- rebuild tables

def row_values(row: Mapping[str, Any]) -> dict[str, Any]:
    """A record's fields as one flat mapping, as the table row it was read from held them (for a run read
    from a per-step table, its constant columns; ``table_frame`` adds the per-step ones)."""
    extra = json.loads(row["extra"]) if isinstance(row.get("extra"), str) else {}
    base: dict[str, Any] = {}
    for column in ("config", "summary", "provenance"):
        base.update(json.loads(row[column]) if isinstance(row.get(column), str) else {})
    base.update({k: v for k, v in extra.items() if not k.startswith("_")})
    base.update(extra.get("_cells", {}))
    for column in ("status", "error"):
        if isinstance(row.get(column), str):
            base[column] = row[column]
    return base


def table_frame(records: pd.DataFrame, columns: Sequence[str], history: pd.DataFrame | None = None, *,
                key: str | None = None) -> pd.DataFrame:
    """The table that ``records`` (rows of one source table) were read from, columns in ``columns`` order,
    parsed as ``results.read_table`` parses a results table (same dtypes, so figures draw the same).
    ``key``: also a column of that name holding each line's record id (the key that joins a line to its
    record and history; lines are sorted back into their table's order, so a position means nothing)."""
    lines: list[tuple[Any, dict[str, Any], str]] = []
    for _, row in records.iterrows():
        extra = json.loads(row["extra"]) if isinstance(row["extra"], str) else {}
        base = row_values(row)
        if "_varying" in extra:
            steps = history[history["record"] == row["record"]] if history is not None else history
            by_step = {s: dict(zip(p["metric"], p["value"])) for s, p in steps.groupby("step")} if steps is not None \
                else {}
            text = extra.get("_varying_text", {})
            for i, (order, step) in enumerate(zip(extra["_rows"], sorted(by_step))):
                values = {c: by_step[step].get(c) for c in extra["_varying"]}
                values.update({c: int(values[c]) for c in extra.get("_ints", []) if values.get(c) is not None})
                values.update({c: v[i] for c, v in text.items()})
                lines.append((order, {**base, "step": step, **values}, row["record"]))
        else:
            lines.append((extra.get("_row", len(lines)), base, row["record"]))
    lines.sort(key=lambda item: item[0])
    cells = [{c: _cell(values.get(c)) for c in columns} for _, values, _ in lines]
    text = pd.DataFrame(cells, columns=list(columns)).to_csv(index=False)
    frame = pd.read_csv(io.StringIO(text), keep_default_na=False, na_values=[""])
    if key is not None:
        frame[key] = [record for _, _, record in lines]
    return frame


def _cell(value: Any) -> Any:
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, default=str)
    return value
