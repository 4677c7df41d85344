"""Tokenizers, all through the `tokenizers` library: a byte-level BPE trained on the training split (the default), or
the user's own (`load_tokenizer`: a tokenizer.json file or a Hugging Face Hub name)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
_N_BYTES = 256
_SPECIAL_TOKENS = [EOS_TOKEN, UNK_TOKEN]  # ids 0 and 1
_MIN_VOCAB = 32
# End-of-document tokens of common tokenizers, looked up in this order to separate packed documents: ours and GPT-2's /
# Qwen's, Llama 3's, Llama 2's / Mistral's / T5's, Gemma's, BERT's.
SEPARATOR_TOKENS = (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "[SEP]")


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with at most ``vocab_size`` entries; deterministic for the same texts.

    ``EOS_TOKEN`` (id 0) separates packed documents. With ``vocab_size >= 258`` all 256 bytes are in
    the vocabulary, so any text encodes losslessly. Smaller vocabularies (the ``tiny`` model has 256)
    keep only the ``vocab_size - 2`` most frequent byte symbols of the corpus and map the rest to
    ``UNK_TOKEN`` (id 1). The tokenizer may end up smaller than ``vocab_size`` on a tiny corpus.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size must be an int >= {_MIN_VOCAB}, got {vocab_size!r}")
    if not texts:
        raise ValueError("train_tokenizer needs at least one text, got none")
    full_bytes = vocab_size >= _N_BYTES + len(_SPECIAL_TOKENS)
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = (dict(initial_alphabet=pre_tokenizers.ByteLevel.alphabet()) if full_bytes
                else dict(limit_alphabet=vocab_size - len(_SPECIAL_TOKENS)))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=_SPECIAL_TOKENS,
                                  show_progress=False, **alphabet)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() > vocab_size:  # guard the invariant ids < vocab_size
        raise ValueError(f"trained tokenizer has {tokenizer.get_vocab_size()} entries > vocab_size={vocab_size}")
    return tokenizer


def texts_fingerprint(texts: Sequence[str]) -> str:
    """A short content hash, used to key caches on what the tokenizer/data were built from."""
    digest = hashlib.sha256()
    for text in texts:
        encoded = text.encode("utf-8")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return digest.hexdigest()[:16]


def load_or_train_tokenizer(texts: Sequence[str], vocab_size: int, cache_dir: str | Path) -> Tokenizer:
    """Load the tokenizer cached for exactly these texts and vocab size, or train and cache it."""
    cache_dir = Path(cache_dir)
    path = cache_dir / f"bpe_v{vocab_size}_{texts_fingerprint(texts)}.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    tokenizer = train_tokenizer(texts, vocab_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tokenizer.save(str(tmp))
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return tokenizer


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """The user's tokenizer: a tokenizer.json file (or a folder holding one) when ``spec`` is an existing path, else a
    Hugging Face Hub name such as ``"gpt2"`` (downloaded once into the Hub's cache; needs the network)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"tokenizer: folder {spec} holds no tokenizer.json")
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception as error:  # the library raises its own Exception type for a malformed file
            raise ValueError(f"tokenizer: {path} is not a tokenizers tokenizer.json ({error})") from None
    if str(spec).endswith(".json"):
        raise ValueError(f"tokenizer: no such file {spec}")
    try:
        return Tokenizer.from_pretrained(str(spec))
    except Exception as error:  # no network, no such repository, or no tokenizer.json in it
        raise ValueError(f"tokenizer: {spec!r} is neither a tokenizer.json file nor a Hugging Face Hub name that "
                         f"could be loaded ({error})") from None


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """A short hash of the tokenizer's whole definition (vocabulary, merges, normalisation): keys its token caches."""
    return hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()[:16]


def eos_id(tokenizer: Tokenizer) -> int:
    """The id that ends each packed document: the first of `SEPARATOR_TOKENS` the tokenizer has."""
    for token in SEPARATOR_TOKENS:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise ValueError(f"tokenizer has none of the end-of-document tokens {SEPARATOR_TOKENS}, which separate the packed "
                     f"documents; add one to its vocabulary")
