"""The results store's files on disk: atomic Parquet writes, the ``SHA256SUMS`` manifest checked on every read,
and the writers' lock (``flock`` on the store folder). ``store`` builds on these.

A file is replaced in three steps under the lock: the manifest first accepts the file's old and new sha256,
then the new file is renamed into place, then only the new hash stays; a kill at any moment leaves a store
whose every file matches its manifest.

How a file is written (``write_parquet``; ``compact`` rewrites a store written otherwise): zstd at level 19, Parquet
page checksums, no pandas metadata (a copy of the schema in every file), min/max statistics only for the short
columns (a JSON text column's would copy two whole documents into the footer), and history rows sorted by record,
metric and step, so one metric's values sit together, its floats byte-split. Of the committed store's bytes before
this layout, 2.9 MB of 14.8 MB were footers.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Iterator, Mapping
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from turbo_moe.writer_lock import folder_lock

MANIFEST = "SHA256SUMS"  # one line per file: "<sha256>  <path relative to the store>"
# Per table (the folder under the store; ``campaigns`` for campaigns.parquet): statistics, encodings, row order.
_WRITE_OPTIONS = {
    "records": {"write_statistics": ["record", "kind", "table", "status", "date", "git_commit", "device"]},
    "history": {"write_statistics": ["record", "step", "metric"], "use_dictionary": ["record", "metric"],
                "column_encoding": {"value": "BYTE_STREAM_SPLIT", "step": "DELTA_BINARY_PACKED"}},
    "sources": {"write_statistics": ["path", "format", "bytes", "stored"]},
    "campaigns": {"write_statistics": ["campaign", "status"]},
}
_ROW_ORDER = {"history": [("record", "ascending"), ("metric", "ascending"), ("step", "ascending")]}


class StoreError(ValueError):
    """A store file that cannot be read or a record that breaks the schema; the message names it, ``short``
    says the same in a few words without machine paths (for the report's manifest)."""

    def __init__(self, message: str, short: str | None = None):
        super().__init__(message)
        self.short = short or message


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@contextlib.contextmanager
def store_lock(store: Path, timeout_s: float = 120.0) -> Iterator[None]:
    """Exclusive ``flock`` on the store folder itself (no lock file to leave behind or commit)."""
    store.mkdir(parents=True, exist_ok=True)
    with folder_lock(store, timeout_s=timeout_s, busy=StoreError, busy_message=f"results store {store}: another "
                     f"process has been writing it for over {timeout_s:.0f} s; try again"):
        yield


def read_manifest(store: str | Path) -> dict[str, set[str]] | None:
    """path (relative to the store) -> the sha256 values it may have; None when the store has no manifest."""
    path = Path(store) / MANIFEST
    if not path.exists():
        return None
    out: dict[str, set[str]] = {}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(f"results store manifest {path}: cannot read it ({exc}); restore it from git") from None
    for number, line in enumerate(lines, 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name:
            raise StoreError(f"results store manifest {path} line {number}: expected '<sha256>  <path>', got "
                             f"{line[:80]!r}; restore it from git")
        out.setdefault(name, set()).add(digest)
    return out


def _write_manifest(store: Path, entries: Mapping[str, set[str]]) -> None:
    lines = [f"{digest}  {name}\n" for name in sorted(entries) for digest in sorted(entries[name])]
    tmp = store / f".{MANIFEST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, store / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def relative(store: Path, path: Path) -> str:
    return path.relative_to(store).as_posix()


def write_parquet(store: Path, table: pa.Table, path: Path) -> None:
    """Replace ``path`` with ``table`` (the caller holds the store lock): the manifest first accepts the old
    and the new hash, then the file is renamed into place, then only the new hash stays."""
    dataset = table_of(path)
    if dataset in _ROW_ORDER:
        table = table.sort_by(_ROW_ORDER[dataset])  # a stable sort
    table = table.replace_schema_metadata(None)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        pq.write_table(table, tmp, compression="zstd", compression_level=19, write_page_checksum=True,
                       **_WRITE_OPTIONS.get(dataset, {}))
        digest = sha256_file(tmp)
        entries = read_manifest(store) or {}
        name = relative(store, path)
        _write_manifest(store, {**entries, name: entries.get(name, set()) | {digest}})
        os.replace(tmp, path)
        _write_manifest(store, {**entries, name: {digest}})
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove(store: Path, path: Path) -> None:
    path.unlink(missing_ok=True)
    entries = read_manifest(store) or {}
    if relative(store, path) in entries:
        del entries[relative(store, path)]
        _write_manifest(store, entries)


def store_files(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*.parquet") if not p.name.startswith("."))


def rehash(store: str | Path) -> int:
    """List every Parquet file of ``store`` in its manifest as it is now (for a store written before the
    manifest existed: check its files first, e.g. against git); returns the number of files listed."""
    store = Path(store)
    with store_lock(store):
        entries = {relative(store, p): {sha256_file(p)} for p in store_files(store)}
        _write_manifest(store, entries)
    return len(entries)


def compact(store: str | Path) -> tuple[int, int]:
    """Rewrite every file of ``store`` as ``write_parquet`` writes files now (each checked first; the same rows and
    values, history in its row order); returns the Parquet bytes before and after."""
    store = Path(store)
    before = after = 0
    with store_lock(store):
        for path in store_files(store):
            check_file(path)
            before += path.stat().st_size
            write_parquet(store, pq.ParquetFile(path).read(), path)
            after += path.stat().st_size
    return before, after


def table_of(path: Path) -> str:
    """The table a store file holds: ``records`` for ``<store>/records/campaign=<name>/part-0.parquet``, ``campaigns``
    for ``<store>/campaigns.parquet``."""
    return path.parents[1].name if path.parent.name.startswith("campaign=") else path.stem


def store_of(path: Path) -> Path:
    """The store a file belongs to: ``<store>/<dataset>/campaign=<name>/part-0.parquet`` or ``<store>/<file>``."""
    return path.parents[2] if path.parent.name.startswith("campaign=") else path.parent


def check_file(path: str | Path) -> None:
    """StoreError naming ``path`` unless its sha256 is one its store's manifest lists."""
    path = Path(path)
    store = store_of(path)
    entries = read_manifest(store)
    if entries is None:
        raise StoreError(f"results store {store} has no {MANIFEST} (written before files were checksummed); "
                         f"check its files (e.g. git status), then: python -m turbo_moe.experiments.store.migrate "
                         f"--rehash --store {store}", f"the store has no {MANIFEST}")
    name = relative(store, path)
    known = entries.get(name)
    if known is None:
        raise StoreError(f"results store file {path}: not listed in {store / MANIFEST}, so it cannot be checked; "
                         "write it through turbo_moe.experiments.store.store (or migrate --rehash)",
                         f"{name} is not listed in {MANIFEST}")
    try:
        digest = sha256_file(path)
    except OSError as exc:
        raise StoreError(f"results store file {path}: cannot read it ({exc.strerror or exc})",
                         f"{name} cannot be read") from None
    if digest not in known:
        raise StoreError(f"results store file {path}: damaged (its sha256 is not the one {MANIFEST} lists); "
                         f"restore it from git (git checkout -- {path}) or run the ingest again",
                         f"{name} is damaged (its sha256 differs from {MANIFEST})")


