"""Data: formats, tokenizer, packing/split, resumable shuffled batches, synthetic data, clear errors."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from turbo_moe.data import (
    BatchIterator,
    SyntheticSequences,
    eval_batches,
    load_dataset,
    read_documents,
    split_documents,
    train_tokenizer,
)
from turbo_moe.data.tokenizer import EOS_TOKEN

WORDS = "the quick brown fox jumps over lazy dog to be or not that is question whether nobler mind".split()


def make_docs(n_docs=12, words_per_doc=300, seed=0):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=words_per_doc)) + "\n" for _ in range(n_docs)]


def write_corpus(tmp_path, fmt, docs):
    if fmt == "txt_dir":
        root = tmp_path / "txts"
        root.mkdir()
        for i, d in enumerate(docs):
            (root / f"doc{i:02d}.txt").write_text(d)
        return root
    if fmt == "jsonl":
        path = tmp_path / "c.jsonl"
        path.write_text("".join(json.dumps({"text": d, "url": "x"}) + "\n" for d in docs))
        return path
    if fmt == "json.gz":  # C4 shard layout
        path = tmp_path / "c4-train.00000-of-01024.json.gz"
        with gzip.open(path, "wt") as f:
            f.writelines(json.dumps({"text": d, "timestamp": "t"}) + "\n" for d in docs)
        return path
    if fmt == "parquet":
        path = tmp_path / "c.parquet"
        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path)
        return path
    raise AssertionError(fmt)


@pytest.mark.parametrize("fmt", ["txt_dir", "jsonl", "json.gz", "parquet"])
def test_each_format_loads_same_documents(tmp_path, fmt):
    docs = make_docs()
    assert read_documents(write_corpus(tmp_path, fmt, docs)) == docs


def test_dataset_from_path_packs_and_splits(tmp_path):
    path = write_corpus(tmp_path, "jsonl", make_docs())
    ds = load_dataset(path, seq_len=16, vocab_size=300, data_dir=tmp_path / "cache", val_fraction=0.1)
    assert ds.train.windows.shape[1] == 17 and len(ds.train) > 5 and len(ds.val) >= 1
    assert ds.train.windows.max() < 300
    assert 0.05 < ds.info["val_tokens"] / (ds.info["train_tokens"] + ds.info["val_tokens"]) < 0.2
    batch = BatchIterator(ds.train, 4, seed=0).batch_at(0)
    assert batch["inputs"].shape == (4, 16) and batch["inputs"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])  # shifted by one
    # Second load hits the cache and gives identical tokens.
    again = load_dataset(path, seq_len=16, vocab_size=300, data_dir=tmp_path / "cache", val_fraction=0.1)
    np.testing.assert_array_equal(again.train.windows, ds.train.windows)


def test_split_single_document_at_newline():
    doc = "".join(f"line {i}\n" for i in range(100))
    train, val = split_documents([doc], 0.1)
    assert train[0] + val[0] == doc and val[0].startswith("line ")
    assert 0.05 < len(val[0]) / len(doc) < 0.15


def test_tokenizer_deterministic_and_roundtrips():
    docs = make_docs(n_docs=4)
    a, b = train_tokenizer(docs, 300), train_tokenizer(docs, 300)
    assert a.to_str() == b.to_str()
    assert a.token_to_id(EOS_TOKEN) == 0
    text = "the lazy fox, über alles"  # 'ü' is unseen in training but bytes are all in the vocab
    assert a.decode(a.encode(text).ids) == text


def test_small_vocab_tokenizer_fits():
    tokenizer = train_tokenizer(make_docs(n_docs=4), 64)
    ids = tokenizer.encode("the quick brown fox ~~ unseen").ids
    assert tokenizer.get_vocab_size() <= 64 and max(ids) < 64


def test_iterator_resumes_at_any_step_and_shuffles_by_seed(tmp_path):
    ds = load_dataset(write_corpus(tmp_path, "txt_dir", make_docs()), seq_len=8, vocab_size=300,
                      data_dir=tmp_path / "cache")
    n = len(ds.train)
    full = [b["inputs"] for _, b in zip(range(10), BatchIterator(ds.train, 3, seed=1))]
    resumed = [b["inputs"] for _, b in zip(range(4), BatchIterator(ds.train, 3, seed=1, start_step=6))]
    for x, y in zip(full[6:], resumed):
        np.testing.assert_array_equal(x, y)
    other_seed = BatchIterator(ds.train, 3, seed=2).batch_at(0)["inputs"]
    assert not np.array_equal(other_seed, full[0])
    # One epoch visits every window exactly once.
    steps = n // 3
    seen = np.concatenate([BatchIterator(ds.train, 3, seed=1)._rows(s) for s in range(steps)])
    assert len(np.unique(seen)) == len(seen) == steps * 3


def test_process_shards_cover_global_batch(tmp_path):
    ds = load_dataset(write_corpus(tmp_path, "jsonl", make_docs()), seq_len=8, vocab_size=300,
                      data_dir=tmp_path / "cache")
    whole = BatchIterator(ds.train, 4, seed=0).batch_at(3)["inputs"]
    parts = [BatchIterator(ds.train, 4, seed=0, process_index=i, process_count=2).batch_at(3)["inputs"]
             for i in range(2)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_synthetic_uniform_and_deterministic():
    src = SyntheticSequences(vocab_size=50, seq_len=64)
    it = BatchIterator(src, 8, seed=0)
    a, b = it.batch_at(5), BatchIterator(src, 8, seed=0).batch_at(5)
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert not np.array_equal(a["inputs"], it.batch_at(6)["inputs"])
    counts = np.bincount(np.concatenate([it.batch_at(s)["inputs"].ravel() for s in range(20)]), minlength=50)
    assert counts.min() > 0.7 * counts.mean() and counts.max() < 1.3 * counts.mean()
    ev = eval_batches(src, 8, 2)
    assert len(ev) == 2 and not np.array_equal(ev[0]["inputs"], a["inputs"])


def test_synthetic_dataset_needs_no_files(tmp_path):
    ds = load_dataset("synthetic", seq_len=8, vocab_size=100, data_dir=tmp_path / "nothing")
    assert ds.name == "synthetic" and not (tmp_path / "nothing").exists()


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "no_such_corpus"
    with pytest.raises(FileNotFoundError, match="no_such_corpus"):
        load_dataset(missing, seq_len=8, vocab_size=300, data_dir=tmp_path)


@pytest.mark.parametrize("name,content,match", [
    ("empty.txt", "", "no non-empty text"),
    ("bad.jsonl", '{"text": "ok"}\n{not json\n', r"bad.jsonl:2: not valid JSON"),
    ("nofield.jsonl", '{"body": "hello"}\n', "string field 'text'"),
    ("trunc.json.gz", b"\x1f\x8b\x08\x00garbage", "cannot read as gzip"),
    ("bad.parquet", b"PAR1 not really", "cannot read as Parquet"),
    ("notes.csv", "a,b\n", "unsupported extension"),
])
def test_bad_files_fail_clearly(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=match):
        read_documents(path)


def test_empty_dir_and_missing_parquet_column(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="contains no"):
        read_documents(tmp_path / "empty")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match="no column 'text'"):
        read_documents(tmp_path / "t.parquet")


def test_corpus_too_small_for_seq_len(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("the fox\n" * 40)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        load_dataset(path, seq_len=4096, vocab_size=300, data_dir=tmp_path / "cache")


def test_bad_arguments():
    with pytest.raises(ValueError, match="val_fraction"):
        split_documents(["a\nb"], 1.5)
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], 8)
    with pytest.raises(ValueError, match="batch_size"):
        BatchIterator(SyntheticSequences(10, 4), 0)
