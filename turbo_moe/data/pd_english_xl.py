"""``pd_english_xl``: ``pd_english`` plus the GNU Collaborative International Dictionary of English.

Enough distinct text for 50 M training tokens in under 4 epochs at vocab 8192 (``pd_english`` alone
holds 6.8 M training tokens, so 50 M is 7 epochs of it). The added source:

| source | registry | version | what | licence of the text |
|---|---|---|---|---|
| ``dict-gcide`` | Debian | 0.48.5+nmu2 | GCIDE: Webster's Revised Unabridged Dictionary (1913) with later additions: definitions, etymologies and some 100,000 quotations from English literature | public domain (1913 Webster) / GPL-2+ (additions) |

The dictionary's typesetting is reduced to its text: the indentation of every line and the lines that
only name a source (``[1913 Webster]``, ``[PJC]``, ...) are dropped; the rest is kept as it is. It is
cut into parts at blank lines and mixed with ``pd_english``'s parts by the same name hash
(`pd_english.assemble`), so the held-out tail of the corpus (``split_documents``) holds parts of every
source, none of which is in the training split. ``pd_english`` itself is unchanged: runs recorded on
it stay comparable.

The ``.deb`` is fetched with ``apt-get download dict-gcide=<version>`` (Debian's client; any Debian or
Ubuntu machine can fetch it) and verified by its sha256; without apt, put the file in
``<data dir>/pd_english_xl/downloads/`` by hand.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import re
import shutil
import tarfile
from pathlib import Path

from turbo_moe.data import corpus, pd_english

NAME = "pd_english_xl"


@dataclasses.dataclass(frozen=True)
class DebSource:
    """One pinned Debian package and the dictd database inside it."""

    package: str
    version: str
    sha256: str  # of the .deb as served by the archive (recorded 2026-11-26)
    member: str  # the dictzip (gzip-compatible) database inside data.tar

    @property
    def deb_name(self) -> str:  # what `apt-get download` writes (':' of an epoch becomes %3a)
        return f"{self.package}_{self.version.replace(':', '%3a')}_all.deb"


GCIDE = DebSource("dict-gcide", "0.48.5+nmu2", "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
                  "./usr/share/dictd/gcide.dict.dz")
# A line that only names the source of the entry above it, e.g. "[1913 Webster]", "[PJC]".
_SOURCE_TAG = re.compile(r"^\[[^\]\n]{1,40}\]$")


def source_key() -> str:
    """``pd_english``'s pins plus GCIDE's: names the prepared caches."""
    pins = [pd_english.source_key(), dataclasses.astuple(GCIDE), "dedent+tags"]
    return hashlib.sha256(json.dumps(pins).encode()).hexdigest()[:12]


def fetch_pd_english_xl(data_dir: str | Path | None = None) -> Path:
    """Download (once), verify and assemble the corpus; return the path of its ``corpus.jsonl.gz``."""
    root = Path(data_dir).expanduser() if data_dir is not None else corpus.default_data_dir()
    home = root / NAME
    target = home / "corpus.jsonl.gz"
    marker = home / f".complete_{source_key()}"
    if marker.exists() and target.exists():
        return target
    downloads = home / "downloads"
    documents = pd_english.documents(root, downloads)
    documents.append((f"{GCIDE.package}/gcide", dictionary_text(read_deb_member(_fetch_deb(GCIDE, downloads),
                                                                               GCIDE.member))))
    parts = pd_english.assemble(documents)
    pd_english.write_corpus(target, parts)
    marker.write_text(json.dumps({"pd_english": pd_english.source_key(), "gcide": dataclasses.asdict(GCIDE),
                                  "parts": len(parts)}) + "\n")
    shutil.rmtree(downloads, ignore_errors=True)
    return target


def dictionary_text(raw: bytes) -> str:
    """The dictd database as plain text: lines dedented, source-tag lines dropped, blank lines kept."""
    lines = []
    for line in raw.decode("utf-8", errors="replace").replace("\r\n", "\n").split("\n"):
        line = line.strip()
        if not _SOURCE_TAG.match(line):
            lines.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines))


def read_deb_member(deb: Path, member: str) -> bytes:
    """One file of a .deb (an ar archive holding data.tar.{xz,gz}), gunzipped if it is a .gz/.dz."""
    data = deb.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise ValueError(f"{deb}: not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(data):
        name = data[pos:pos + 16].decode().strip().rstrip("/")
        size = int(data[pos + 48:pos + 58].decode().strip())
        body = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)  # members are 2-byte aligned
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
                try:
                    content = tar.extractfile(member).read()
                except KeyError:
                    raise ValueError(f"{deb}: no {member} in {name}") from None
            return gzip.decompress(content) if member.endswith((".gz", ".dz")) else content
    raise ValueError(f"{deb}: no data.tar member")


def _fetch_deb(source: DebSource, downloads: Path) -> Path:
    deb = downloads / source.deb_name
    spec = f"{source.package}={source.version}"
    pd_english.fetch_pinned(deb, ["apt-get", "download", spec], source.sha256,
                            what=f"dataset {NAME!r} needs the Debian package {spec}",
                            hint=f"Fetch {source.deb_name} on a Debian/Ubuntu machine (`apt-get download {spec}`) and "
                                 f"put it in {downloads}; or use the dataset {pd_english.NAME!r}, or pass a path to "
                                 "your own corpus.",
                            pinned=f"{source.package}={source.version} (dataset {NAME!r})")
    return deb
