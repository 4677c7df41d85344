"""The user's own tokens: a tokenizer.json of their choice on a text corpus, or pre-tokenised ids (.npy / .bin)."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from turbo_moe.data import load_dataset, split_documents
from turbo_moe.train import TrainConfig

WORDS = "the quick brown fox jumps over lazy dog to be or not that is question".split()


def word_tokenizer(path, eos="</s>", extra_words=()):
    """A word-level tokenizer.json as a user would bring one: ids 0.. for its tokens, its own end-of-document token."""
    vocab = {token: i for i, token in enumerate(["[UNK]", eos, *WORDS, *extra_words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return vocab


def write_corpus(tmp_path, n_docs=12, words=60):
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, size=words)) for _ in range(n_docs)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path, docs


def test_text_with_a_users_tokenizer_json(tmp_path):
    vocab = word_tokenizer(tmp_path / "tokenizer.json")
    corpus, docs = write_corpus(tmp_path)
    ds = load_dataset(corpus, seq_len=8, vocab_size=64, data_dir=tmp_path / "cache", val_fraction=0.1,
                      tokenizer=tmp_path / "tokenizer.json")
    # The stream is each document's words in the user's ids, then its end-of-document token: nothing of a BPE.
    train_docs, _ = split_documents(docs, 0.1)
    expected = np.concatenate([[vocab[w] for w in d.split()] + [vocab["</s>"]] for d in train_docs])
    seen = ds.train.windows.reshape(-1)
    np.testing.assert_array_equal(seen, expected[:len(seen)])
    assert ds.info["tokenizer"] == f"{tmp_path / 'tokenizer.json'}, vocab {len(vocab)}"
    # A folder holding a tokenizer.json names it too; the cached tokens are the same.
    again = load_dataset(corpus, seq_len=8, vocab_size=64, data_dir=tmp_path / "cache", val_fraction=0.1,
                         tokenizer=tmp_path)
    np.testing.assert_array_equal(again.train.windows, ds.train.windows)


def test_tokenizer_larger_than_the_model_names_both_sizes(tmp_path):
    word_tokenizer(tmp_path / "big.json", extra_words=[f"w{i}" for i in range(300)])  # 317 entries
    corpus, _ = write_corpus(tmp_path)
    with pytest.raises(ValueError, match=r"has 317 entries but the model's vocab_size is 256.*at least 317 "
                                         r"\(e\.g\. 384"):
        load_dataset(corpus, seq_len=8, vocab_size=256, data_dir=tmp_path / "cache", tokenizer=tmp_path / "big.json")


def test_tokenizer_problems_are_named(tmp_path):
    corpus, _ = write_corpus(tmp_path)
    word_tokenizer(tmp_path / "no_eos.json", eos="<|im_end|>")
    with pytest.raises(ValueError, match="none of the end-of-document tokens"):
        load_dataset(corpus, seq_len=8, vocab_size=64, data_dir=tmp_path, tokenizer=tmp_path / "no_eos.json")
    with pytest.raises(ValueError, match="tokenizer: no such file .*missing.json"):
        load_dataset(corpus, seq_len=8, vocab_size=64, data_dir=tmp_path, tokenizer=tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(ValueError, match="broken.json is not a tokenizers tokenizer.json"):
        load_dataset(corpus, seq_len=8, vocab_size=64, data_dir=tmp_path, tokenizer=tmp_path / "broken.json")
    with pytest.raises(ValueError, match="tokenizer: .* is not text"):
        load_dataset("synthetic", seq_len=8, vocab_size=64, tokenizer=tmp_path / "no_eos.json")


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_pre_tokenised_ids(tmp_path, suffix):
    ids = np.random.default_rng(0).integers(0, 500, size=1000).astype(np.uint16)
    path = tmp_path / f"tokens{suffix}"
    np.save(path, ids) if suffix == ".npy" else ids.tofile(path)
    ds = load_dataset(path, seq_len=9, vocab_size=512, val_fraction=0.1, data_dir=tmp_path / "unused")
    # 900 training ids -> 90 windows of 10, in order; the last 100 ids are the validation split.
    np.testing.assert_array_equal(ds.train.windows.reshape(-1), ids[:900])
    np.testing.assert_array_equal(ds.val.windows.reshape(-1), ids[900:])
    assert ds.info["max_id"] == int(ids.max()) and ds.info["tokens"] == 1000
    with pytest.raises(ValueError, match=rf"tokens{suffix} holds token id {ids.max()} but the model's vocab_size is "
                                         rf"256 .*at least {ids.max() + 1}"):
        load_dataset(path, seq_len=9, vocab_size=256)


def test_bad_token_files(tmp_path):
    np.save(tmp_path / "floats.npy", np.ones(100, np.float32))
    with pytest.raises(ValueError, match="floats.npy must hold a 1-D integer array"):
        load_dataset(tmp_path / "floats.npy", seq_len=4, vocab_size=64)
    np.save(tmp_path / "negative.npy", np.array([1, -3, 2] * 20, np.int32))
    with pytest.raises(ValueError, match="holds token id -3"):
        load_dataset(tmp_path / "negative.npy", seq_len=4, vocab_size=64)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="odd number of bytes"):
        load_dataset(tmp_path / "odd.bin", seq_len=4, vocab_size=64)
    with pytest.raises(ValueError, match="no such token file .*absent.npy"):
        load_dataset(tmp_path / "absent.npy", seq_len=4, vocab_size=64)


def test_train_config_tokenizer_field():
    assert TrainConfig(dataset="corpus.jsonl", tokenizer="gpt2").to_dict()["tokenizer"] == "gpt2"
    for dataset in ("synthetic", "tokens.bin"):
        with pytest.raises(ValueError, match="TrainConfig.tokenizer"):
            TrainConfig(dataset=dataset, tokenizer="gpt2")


def test_hub_name_that_does_not_load_is_named(monkeypatch):
    from turbo_moe.data import tokenizer as tok

    class Offline:  # what the library raises without the network, without waiting for its retries
        @staticmethod
        def from_pretrained(name):
            raise RuntimeError(f"cannot reach the Hub for {name}")

    monkeypatch.setattr(tok, "Tokenizer", Offline)
    with pytest.raises(ValueError, match=r"'org/some-model' is neither a tokenizer.json file nor a Hugging Face Hub "
                                         r"name that could be loaded \(cannot reach"):
        tok.load_tokenizer("org/some-model")


def test_named_corpus_with_a_users_tokenizer_is_prepared_apart(fake_sources, tmp_path, monkeypatch):
    """pd_english with the user's tokenizer: its own prepared tokens, loaded again without the text; the default BPE
    never reads them."""
    from fake_packages import PARAGRAPH

    from turbo_moe.data import pd_english, train_tokenizer

    train_tokenizer([PARAGRAPH * 20, "other words entirely\n"], 280).save(str(tmp_path / "mine.json"))
    mine = load_dataset("pd_english", seq_len=32, vocab_size=300, data_dir=fake_sources, val_fraction=0.1,
                        tokenizer=tmp_path / "mine.json")
    assert mine.info["tokenizer"].startswith(str(tmp_path / "mine.json"))
    default = load_dataset("pd_english", seq_len=32, vocab_size=300, data_dir=fake_sources, val_fraction=0.1)
    assert default.info["tokenizer"].startswith("byte-level BPE")
    monkeypatch.setattr(pd_english, "fetch_pd_english", lambda root=None: pytest.fail("fetched again"))
    again = load_dataset("pd_english", seq_len=32, vocab_size=300, data_dir=fake_sources, val_fraction=0.1,
                         tokenizer=tmp_path / "mine.json")
    np.testing.assert_array_equal(again.train.windows, mine.train.windows)
    assert again.info["prepared"].endswith(".json")
