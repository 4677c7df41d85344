"""Bring result files (sweep tables, benchmark tables, JSON records, logs) into the results store.

    python -m turbo_moe.experiments.store.migrate [--results experiments/results] [--store experiments/store]
                                                 [--campaign NAME] [--all] [--check] [--rehash] [--compact]

It writes into the store it is given (default: the committed ``experiments/store``); ``turbo-moe report``
ingests into this machine's git-ignored store instead, and ``turbo-moe report --publish`` into the
committed one. ``--rehash`` lists every file of a store written before files were checksummed in its
``SHA256SUMS`` (check the files first, e.g. with ``git status``). ``--compact`` rewrites every file of a store
as the store writes files now (``store.files``: the same values in about 60% of the bytes).

Every file under the results folder belongs to a campaign: its top-level entry (``kernels_h200.csv`` ->
``kernels_h200``; ``gpu_paths_x_batch.csv`` and the folder ``gpu_paths_x_batch/`` -> ``gpu_paths_x_batch``).

- A sweep table (columns sweep, point, status): one ``run`` record per row, its JSON record merged in.
- A table with a ``step`` column and a run key (``run``, or ``label`` and ``seed``): one ``run`` record per
  run, the varying columns as its history.
- Any other table: one ``benchmark`` record per row. A JSON file (``.json``, ``.json.gz``) or JSONL line:
  one record; lists of per-step mappings become history, anything nested per step (per-layer traces)
  stays in git history only, and its source row says which commit holds it.
- ``PROVENANCE.md``: the campaign's note. Small text files (logs, summaries) are kept inline; larger or
  binary files stay in git history (``sources.stored`` names the commit).

A damaged table row or unreadable file is reported by name and kept as text in the sources, never
dropped silently. ``ingest`` is incremental: files whose sha256 is already in the store are skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from turbo_moe.experiments.store import migration_check, results, store
from turbo_moe.experiments.store.result_records import campaign_of, is_summary, json_record, load_json, plain, split_row
from turbo_moe.experiments.store.store import Record

INLINE_TEXT_BYTES = 64 * 1024
SWEEP_LEAD = ("sweep", "point", "point_key")
SWEEP_TAIL = ("elapsed_s", "record", "notebook_out")
SKIPPED_SUFFIXES = (".tmp", ".partial", ".lock")


def result_files(results_dir: str | Path) -> dict[str, list[str]]:
    """campaign -> files (relative paths, sorted) under ``results_dir``, temporary files left out."""
    results_dir = Path(results_dir)
    out: dict[str, list[str]] = {}
    for path in sorted(p for p in results_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(results_dir).as_posix()
        if path.name.endswith(SKIPPED_SUFFIXES) or path.name.startswith(".") or rel == "README.md":
            continue
        out.setdefault(campaign_of(rel), []).append(rel)
    return out


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _table_text(path: Path, relative: str) -> tuple[pd.DataFrame, list[results.DamagedRow]]:
    table, damaged = results.scan_table(path)
    for row in damaged:
        print(f"warning: {relative}: {row.reason} (line {row.line}); kept as text in the store's sources",
              file=sys.stderr)
    return table, damaged


class CampaignImport:
    """The records and source rows of one campaign, built file by file."""

    def __init__(self, results_dir: Path, campaign: str, commit: str):
        self.results_dir, self.campaign, self.commit = results_dir, campaign, commit
        self.records: dict[str, Record] = {}
        self.sources: list[dict[str, Any]] = []
        self.note: str | None = None
        self.consumed: set[str] = set()  # JSON files merged into a sweep row

    def add(self, rec: Record) -> None:
        base, n = rec.record, 1
        while rec.record in self.records:  # identical rows in one table stay distinct
            n += 1
            rec.record = f"{base}.{n}"
        self.records[rec.record] = rec

    def source(self, relative: str, data: bytes, fmt: str, stored: str, *, columns=None, text=None) -> None:
        self.sources.append({"path": relative, "format": fmt, "bytes": len(data), "sha256": _sha256(data),
                             "stored": stored, "columns": json.dumps(columns) if columns is not None else None,
                             "text": text})

    def import_files(self, files: Iterable[str]) -> None:
        files = list(files)
        # Sweep tables first: their rows name the JSON records they absorb.
        for relative in sorted(files, key=lambda f: (not f.endswith(".csv"), f)):
            if relative in self.consumed:
                continue
            path = self.results_dir / relative
            data = path.read_bytes()
            try:
                self._import_file(relative, path, data)
            except (ValueError, UnicodeDecodeError) as exc:  # unreadable: say so, keep it in git history
                print(f"warning: {relative}: cannot read it ({exc}); left in git history", file=sys.stderr)
                self.source(relative, data, "unreadable", f"git {self.commit} (unreadable: {exc})")

    def _import_file(self, relative: str, path: Path, data: bytes) -> None:
        name = path.name
        table = relative.rsplit(".", 1)[0] if "/" not in relative else Path(relative).parent.as_posix()
        if name.endswith(".csv"):
            self._import_table(relative, path, data)
        elif name.endswith((".json", ".json.gz")):
            rec, lost = json_record(load_json(data, name), record=relative, table=table, source=relative)
            self.add(rec)
            self.source(relative, data, "json", f"records (per-step detail in git {self.commit})" if lost else
                        "records")
        elif name.endswith(".jsonl"):
            lines = [line for line in data.decode().splitlines() if line.strip()]
            for i, line in enumerate(lines):
                rec, _ = json_record(json.loads(line), record=f"{relative}#{i}", table=table, source=relative)
                rec.extra["_row"] = i
                self.add(rec)
            self.source(relative, data, "jsonl", "records")
        elif name == "PROVENANCE.md":
            text = data.decode()
            self.note = text if self.note is None else f"{self.note}\n\n{text}"
            self.source(relative, data, "text", "inline", text=text)
        elif len(data) <= INLINE_TEXT_BYTES and _is_text(data):
            self.source(relative, data, "text", "inline", text=data.decode())
        else:
            self.source(relative, data, "binary" if not _is_text(data) else "text", f"git {self.commit}")

    def _import_table(self, relative: str, path: Path, data: bytes) -> None:
        frame, damaged = _table_text(path, relative)
        columns = list(frame.columns)
        text = "".join(f"# {d}\n{d.text}" for d in damaged) or None
        if frame.empty:
            self.source(relative, data, "csv", "records", columns=columns, text=text)
            return
        if {"sweep", "point", "status"} <= set(columns):
            self._sweep_rows(relative, frame)
        elif "step" in columns and ("run" in columns or {"label", "seed"} <= set(columns)):
            self._step_table(relative, frame)
        else:
            table = relative[: -len(".csv")]
            for i, row in enumerate(frame.to_dict("records")):
                status, error = plain(row.pop("status", None)), plain(row.pop("error", None))
                parts = split_row(row)
                digest = _sha256(json.dumps([parts, status, error], sort_keys=True, default=str).encode())[:12]
                self.add(Record(f"{relative}#{digest}", "benchmark", table, relative, status=status, error=error,
                                extra={"_row": i}, **parts))
        self.source(relative, data, "csv", "records", columns=columns, text=text)

    def _sweep_rows(self, relative: str, frame: pd.DataFrame) -> None:
        for i, row in enumerate(frame.to_dict("records")):
            row = {k: plain(v) for k, v in row.items()}
            document, record_file = None, row.get("record")
            if isinstance(record_file, str) and (self.results_dir / record_file).is_file():
                raw = (self.results_dir / record_file).read_bytes()
                document = load_json(raw, record_file)
                if record_file not in self.consumed:
                    self.source(record_file, raw, "json", f"records (with {relative}, point {row['point']})")
                    self.consumed.add(record_file)
            summary_keys = set((document or {}).get("summary", {})) | {
                k for k in row if is_summary(k) and k not in SWEEP_LEAD + SWEEP_TAIL}
            lead = {k: row.pop(k) for k in (*SWEEP_LEAD, *SWEEP_TAIL) if k in row}
            status, error = row.pop("status", None), row.pop("error", None)
            parts = split_row(row, summary_keys)
            rec = Record(f"{lead['point']}@{parts['provenance'].get('date') or i}", "run", str(lead["sweep"]), relative,
                         status=status, error=error, extra={**lead, "_row": i}, **parts)
            if document is not None and record_file == lead.get("record") and self._latest(frame, i):
                # The JSON record's numbers are the exact ones (the row holds copies, nested ones as text);
                # the row's cells that differ from them are kept so that the table rebuilds exactly.
                doc, _ = json_record(document, record=rec.record, table=rec.table, source=record_file)
                cells = {**rec.config, **rec.summary, **rec.provenance}
                rec.summary = {**rec.summary, **doc.summary}
                rec.provenance = {**rec.provenance, **doc.provenance}
                rec.config.update({k: v for k, v in doc.config.items() if k not in rec.config})
                rec.extra.update({"document": doc.extra, "_record_file": record_file})
                merged = {**rec.config, **rec.summary, **rec.provenance}
                rec.extra["_cells"] = {k: v for k, v in cells.items() if merged.get(k) != v}
                rec.history = doc.history
            self.add(rec)

    @staticmethod
    def _latest(frame: pd.DataFrame, i: int) -> bool:
        """Only a point's latest row owns its JSON record (a re-run overwrote the file)."""
        point = frame.iloc[i]["point"]
        return i == max(j for j, p in enumerate(frame["point"]) if p == point)

    def _step_table(self, relative: str, frame: pd.DataFrame) -> None:
        keys = ["run"] if "run" in frame else ["label", "seed"]
        for order, (key, part) in enumerate(frame.groupby(keys, sort=False, dropna=False)):
            key = key if isinstance(key, tuple) else (key,)
            constant = [c for c in part.columns if c != "step" and part[c].nunique(dropna=False) == 1]
            varying = [c for c in part.columns if c not in constant and c != "step"]
            parts = split_row(part.iloc[0][constant].to_dict())
            history = [{"step": int(s), **{c: plain(v) for c, v in zip(varying, values)
                                           if plain(v) is not None and not isinstance(plain(v), str)}}
                       for s, *values in part[["step", *varying]].itertuples(index=False)]
            text_columns = {c: [plain(v) for v in part[c]] for c in varying
                            if any(isinstance(plain(v), str) for v in part[c])}
            extra = {"_row": order, "_rows": part.index.tolist(), "_varying": varying,
                     "_ints": [c for c in varying if pd.api.types.is_integer_dtype(part[c])]}
            if text_columns:
                extra["_varying_text"] = text_columns
            self.add(Record(f"{relative}:{'/'.join(map(str, key))}", "run", relative[: -len(".csv")], relative,
                            extra=extra, history=history, **parts))


def _is_text(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return b"\x00" not in data


def git_head(repo: str | Path = ".") -> str:
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _title(note: str | None) -> str | None:
    for line in (note or "").splitlines():
        if line.strip():
            return line.lstrip("# ").strip()
    return None


def ingest(results_dir: str | Path, store_dir: str | Path = store.DEFAULT_STORE, *,
           campaigns: Iterable[str] | None = None, only_changed: bool = True, replace: bool = False,
           quiet: bool = False) -> dict[str, int]:
    """Import the files under ``results_dir`` into the store; returns campaign -> records written.

    ``only_changed``: a campaign whose files all sit in the store already (same path and sha256) is skipped.
    """
    results_dir, store_dir = Path(results_dir), Path(store_dir)
    if not results_dir.is_dir():
        return {}
    commit = git_head(results_dir)
    written = {}
    for campaign, files in result_files(results_dir).items():
        if campaigns is not None and campaign not in campaigns:
            continue
        if only_changed and _unchanged(results_dir, store_dir, campaign, files):
            continue
        job = CampaignImport(results_dir, campaign, commit)
        job.import_files(files)
        for rec in job.records.values():  # flagged where they enter the store (Record.row keeps the flags)
            for metric, text in store.invalid_metrics(rec.summary, rec.status).items():
                print(f"warning: {campaign}: record {rec.record}: {metric} = {text} is not a valid measurement; "
                      "flagged in the store, shown as invalid in the report", file=sys.stderr)
        written[campaign] = store.write_campaign(store_dir, campaign, job.records.values(), sources=job.sources,
                                                 replace=replace)
        if job.note:
            store.write_campaigns(store_dir, [_campaign_row(store_dir, campaign, job.note)])
        if not quiet:
            print(f"{campaign}: {len(job.records)} records from {len(files)} files")
    return written


def _campaign_row(store_dir: Path, campaign: str, note: str) -> dict[str, Any]:
    known = store.read_campaigns(store_dir)
    row = known[known["campaign"] == campaign]
    old = {k: v for k, v in row.iloc[0].to_dict().items() if isinstance(v, str)} if len(row) else {}
    return {"campaign": campaign, "title": old.get("title") or _title(note), "status": old.get("status") or "current",
            "superseded_by": old.get("superseded_by"), "note": note}


def _unchanged(results_dir: Path, store_dir: Path, campaign: str, files: list[str]) -> bool:
    if campaign not in store.campaign_names(store_dir, "sources"):
        return False
    known = dict(zip(*store.read_sources(store_dir, [campaign])[["path", "sha256"]].T.values))
    return all(known.get(f) == _sha256((results_dir / f).read_bytes()) for f in files)


# Campaigns the report no longer draws (kept in the store for history): campaign -> (superseded_by, why).
SUPERSEDED = {
    "kernels_h200": ("kernels_h200_wgrad_order", "kernels as first delivered (2026-11-21); the only H200 pallas rows"),
    "kernels_reduced_h200": ("kernels_h200_wgrad_order", "same shapes, before the weight-gradient order change"),
    "peers_fp8_h200": ("peers_fp8_wide_tile_h200", "FP8 rows before the wide-tile kernel and the group-column quantiser"),
}


# Titles of the campaigns the report draws (the others carry their PROVENANCE.md's first line).
TITLES = {
    "cpu_default": "`make main`'s sweep: the CPU paths on `small`, Shakespeare",
    "gpu_paths_x_batch": "every path against per-device batch, `reduced`, synthetic tokens (defaults of 2026-11-26)",
    "gpu_paths_x_steps": "every path over 400 steps, `reduced`, Shakespeare (defaults of 2026-11-26)",
    "defaults_vs_best_h200": "each path at its defaults against the best known settings, `reduced` b8 x 2048, H200",
    "gpu_synthetic_vs_real": "synthetic tokens against real text, `reduced` (defaults of 2026-11-26)",
    "kernels_h100_80gb_hbm3": "grouped GEMM against ragged_dot, pallas and the dense ceiling, H100",
    "kernels_h200_wgrad_order": "grouped GEMM against ragged_dot and the dense ceiling, H200",
}


def set_titles(store_dir: str | Path, titles: Mapping[str, str] = TITLES) -> None:
    meta = store.read_campaigns(store_dir).set_index("campaign")
    rows = [{"campaign": c, **{k: v for k, v in meta.loc[c].items() if isinstance(v, str)}, "title": t}
            for c, t in titles.items() if c in meta.index]
    store.write_campaigns(store_dir, rows)


def mark_superseded(store_dir: str | Path, superseded: Mapping[str, tuple[str, str]] = SUPERSEDED) -> None:
    known = set(store.campaign_names(store_dir))
    rows = []
    meta = store.read_campaigns(store_dir).set_index("campaign")
    for campaign, (by, why) in superseded.items():
        if campaign in known:
            old = {k: v for k, v in meta.loc[campaign].items() if isinstance(v, str)} if campaign in meta.index else {}
            note = old.get("note") or ""
            rows.append({"campaign": campaign, "title": old.get("title"), "status": "superseded",
                         "superseded_by": by or None, "note": note if why in note else f"{why}\n\n{note}".strip()})
    store.write_campaigns(store_dir, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=Path, default=Path("experiments/results"))
    p.add_argument("--store", type=Path, default=store.DEFAULT_STORE)
    p.add_argument("--campaign", action="append", help="only these campaigns (repeatable)")
    p.add_argument("--all", action="store_true", help="re-import campaigns whose files are unchanged too")
    p.add_argument("--check", action="store_true",
                   help="after importing, rebuild every table and JSON record from the store and compare it with "
                        "its file, and draw the report both ways (files vs store) and compare the figures")
    p.add_argument("--rehash", action="store_true",
                   help="list every Parquet file of the store in its SHA256SUMS as it is now, and nothing else")
    p.add_argument("--compact", action="store_true",
                   help="rewrite every Parquet file of the store as files are written now (the same values), and "
                        "nothing else")
    args = p.parse_args(argv)
    if args.rehash:
        print(f"{args.store / store.MANIFEST}: {store.rehash(args.store)} files listed")
        return 0
    if args.compact:
        before, after = store.compact(args.store)
        print(f"{args.store}: {before / 1e6:.2f} MB of Parquet files rewritten as {after / 1e6:.2f} MB")
        return 0
    ingest(args.results, args.store, campaigns=args.campaign, only_changed=not args.all, replace=args.all)
    if args.all:
        mark_superseded(args.store)
        set_titles(args.store)
    if args.check:
        problems = migration_check.check(args.results, args.store, campaigns=args.campaign)
        for line in problems:
            print(f"MISMATCH {line}")
        print(f"check: {len(problems)} mismatches")
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
