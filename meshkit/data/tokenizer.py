"""Tokenizers for `prepare`: load a local Hugging Face tokenizer directory, or train a byte-level BPE.

Why a hash: a token store is only meaningful with the tokenizer that wrote it. The hash of the
tokenizer's canonical JSON (vocabulary, merges, normalizer, special tokens) travels in the manifest,
so a recipe can refuse a store written by another model's tokenizer before the first step.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

__all__ = ["EOS_TOKEN", "load_tokenizer", "tokenizer_hash", "train_bpe"]

EOS_TOKEN = "<|endoftext|>"


def load_tokenizer(directory: str | os.PathLike, what: str = "--tokenizer") -> PreTrainedTokenizerFast:
    """A fast HF tokenizer from a local directory, with an EOS token; ValueError naming `what` otherwise."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ValueError(f"{what} {str(path)!r}: not a directory; fix: a local directory holding a Hugging Face "
                         "tokenizer (tokenizer.json or the model's own files)")
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - any loading failure is the user's directory, reported as such
        raise ValueError(f"{what} {str(path)!r}: does not load as a Hugging Face tokenizer "
                         f"({type(err).__name__}: {err})") from err
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"{what} {str(path)!r}: a slow (Python) tokenizer; meshkit needs a fast one "
                         "(tokenizer.json); fix: save it with `AutoTokenizer.from_pretrained(..., use_fast=True)`")
    if tok.eos_token_id is None:
        raise ValueError(f"{what} {str(path)!r}: the tokenizer has no EOS token, and every document of a store "
                         "ends with one; fix: set eos_token in tokenizer_config.json")
    return tok


def tokenizer_hash(tok: PreTrainedTokenizerFast) -> str:
    """sha256 of the tokenizer's canonical JSON: equal for the same tokenizer however it was loaded."""
    return hashlib.sha256(tok.backend_tokenizer.to_str().encode()).hexdigest()


def train_bpe(texts: Iterable[str], vocab_size: int, output: str | os.PathLike, *,
              show_progress: bool = False, length: int | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of `vocab_size` tokens (EOS included) on `texts`, saved as an HF tokenizer.

    Byte-level with the full 256-byte initial alphabet, so every input, seen or not, encodes without an
    unknown token. Deterministic for the same texts in the same order. On a large corpus training takes
    minutes: `show_progress` draws the trainer's own bars (on a terminal; `length` = sequences in
    `texts`, for its first bar).
    """
    if vocab_size < 257 + 1:
        raise ValueError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 258 tokens (256 bytes, "
                         "EOS and one merge); fix: --vocab-size 258 or more")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer=trainer, length=length)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS_TOKEN)
    tok.save_pretrained(str(output))
    return load_tokenizer(output, "trained tokenizer")
