"""`TokenStore`: a prepared corpus on disk, memory-mapped, checked against its manifest before use.

A store is a directory written by `python -m meshkit.data prepare` (see `meshkit.data.prepare`):

    manifest.json      sizes, dtype, EOS id, vocabulary size, tokenizer hash, one checksum per file
    tokens.bin         every document's tokens back to back (uint16 when the vocabulary fits, else uint32),
                       each document ending with EOS
    offsets.npy        int64 [documents + 1]: document d is tokens[offsets[d]:offsets[d + 1]]
    splits.npy         uint8 [documents]: 0 = train, 1 = val (the held-out split is by document)
    loss_mask.bin      optional uint8 [tokens]: 0 where a token must never be a target (chat prompts);
                       written only by document sources that produce a mask
    tokenizer/         the tokenizer as a Hugging Face tokenizer directory

Why memory-mapped: a step reads a few rows, so the store never has to fit in memory (a 1 GB store
costs the pages a run touches, not 1 GB per rank). Why checksums: a truncated copy or a store written
by an interrupted tool must fail before training with a message naming the file, on every rank, not
train on garbage; every rank checks the same files without talking to the others.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshkit.state.digest import file_digest

__all__ = ["FORMAT_VERSION", "SPLITS", "TokenStore", "file_entries", "finish_store", "token_dtype", "write_store"]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENS = "tokens.bin"
OFFSETS = "offsets.npy"
SPLIT_IDS = "splits.npy"
LOSS_MASK = "loss_mask.bin"
TOKENIZER = "tokenizer"
SPLITS = {"train": 0, "val": 1}
_CHUNK = 1 << 22


def _map_readonly(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    """The file as a read-only array backed by a memory map advised for random access.

    Why the advice: a loader reads short rows at random offsets, and the kernel's default readahead
    (up to read_ahead_kb, 8 MiB on some machines) would map megabytes around every row, so a 1 GB
    store would end up resident after a few hundred steps. MADV_RANDOM maps what is read.
    """
    if count == 0:
        return np.zeros(0, dtype)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapped, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype, count=count)


def file_entries(directory: Path, names: list[str]) -> dict[str, dict[str, object]]:
    """The manifest's `files` table: size and sha256 of each named file of a store being written."""
    return {name: {"bytes": (directory / name).stat().st_size, "sha256": file_digest(directory / name)}
            for name in names}


def finish_store(path: Path, lengths: np.ndarray, split_ids: np.ndarray, *, dtype: np.dtype, eos_id: int,
                 vocab_size: int, tokenizer_sha256: str, has_mask: bool, **extra: object) -> dict:
    """Write offsets, split ids and the manifest of a store whose `tokens.bin` (and loss mask) exist.

    The one place that knows the manifest's fields: `prepare`, `write_store` and the benchmarks'
    generated stores all end here. Returns the manifest.
    """
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    split_ids = np.asarray(split_ids, dtype=np.uint8)
    np.save(path / OFFSETS, offsets)
    np.save(path / SPLIT_IDS, split_ids)
    names = [TOKENS, OFFSETS, SPLIT_IDS] + ([LOSS_MASK] if has_mask else [])
    manifest = {
        "format": FORMAT_VERSION, "dtype": np.dtype(dtype).name, "num_tokens": int(offsets[-1]),
        "num_documents": len(lengths), "eos_id": int(eos_id), "vocab_size": int(vocab_size),
        "tokenizer_sha256": tokenizer_sha256,
        "splits": {k: {"documents": int((split_ids == c).sum()), "tokens": int(lengths[split_ids == c].sum())}
                   for k, c in SPLITS.items()},
        "files": file_entries(path, names), **extra,
    }
    (path / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32: half the bytes for vocabularies up to 65536."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def write_store(path: str | os.PathLike, documents: list[np.ndarray], *, eos_id: int, vocab_size: int,
                tokenizer_sha256: str = "none", split_ids: np.ndarray | None = None,
                loss_masks: list[np.ndarray] | None = None) -> TokenStore:
    """A store from documents already in memory (tests, generated corpora); files go through `prepare`.

    Each document must end with `eos_id`; no tokenizer directory is written.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if any(len(d) == 0 or int(d[-1]) != eos_id for d in documents):
        raise ValueError(f"write_store: every document must be non-empty and end with eos_id={eos_id}")
    dtype = token_dtype(vocab_size)
    (np.concatenate(documents) if documents else np.zeros(0)).astype(dtype).tofile(path / TOKENS)
    if loss_masks is not None:
        np.concatenate(loss_masks).astype(np.uint8).tofile(path / LOSS_MASK)
    lengths = np.array([len(d) for d in documents], dtype=np.int64)
    split_ids = np.zeros(len(documents), np.uint8) if split_ids is None else split_ids
    finish_store(path, lengths, split_ids, dtype=dtype, eos_id=eos_id, vocab_size=vocab_size,
                 tokenizer_sha256=tokenizer_sha256, has_mask=loss_masks is not None)
    return TokenStore(path)


@dataclass(frozen=True)
class SplitInfo:
    """A split's size, what `python -m meshkit.data info` prints without reading any token."""

    documents: int
    tokens: int


class TokenStore:
    """A prepared token store, opened read-only by memory map.

    `verify=True` (the default) recomputes every file's checksum: seconds for a gigabyte, paid once per
    process at start-up. Sizes are always checked. Raises ValueError naming the directory, the file and
    the fix for anything missing, truncated or altered.
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True):
        self.path = Path(path).expanduser()
        manifest = self.path / MANIFEST
        if not manifest.is_file():
            raise ValueError(f"token store {str(self.path)!r}: no {MANIFEST} there; fix: write one with "
                             f"`python -m meshkit.data prepare INPUT... --output {self.path}`")
        try:
            self.manifest = json.loads(manifest.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"token store {str(self.path)!r}: {MANIFEST} does not parse ({err}); "
                             "fix: prepare the store again") from err
        if self.manifest.get("format") != FORMAT_VERSION:
            raise ValueError(f"token store {str(self.path)!r}: format {self.manifest.get('format')!r}, this "
                             f"meshkit reads format {FORMAT_VERSION}; fix: prepare the store again")
        self._check_files(verify)
        m = self.manifest
        self.dtype = np.dtype(m["dtype"])
        self.eos_id = int(m["eos_id"])
        self.vocab_size = int(m["vocab_size"])
        self.tokenizer_hash = str(m["tokenizer_sha256"])
        self.num_tokens = int(m["num_tokens"])
        self.tokens = _map_readonly(self.path / TOKENS, self.dtype, self.num_tokens)
        self.offsets = np.load(self.path / OFFSETS, mmap_mode="r")
        self.split_ids = np.load(self.path / SPLIT_IDS)
        self.loss_mask = _map_readonly(self.path / LOSS_MASK, np.uint8, self.num_tokens) if LOSS_MASK in m["files"] else None
        if len(self.offsets) != m["num_documents"] + 1 or len(self.split_ids) != m["num_documents"] \
                or int(self.offsets[-1]) != self.num_tokens:
            raise ValueError(f"token store {str(self.path)!r}: offsets/splits disagree with the manifest "
                             f"({len(self.offsets) - 1} documents, manifest {m['num_documents']}); fix: prepare "
                             "the store again")

    def _check_files(self, verify: bool) -> None:
        problems = self.file_problems(verify)
        if problems:
            raise ValueError(f"token store {str(self.path)!r}: " + "; ".join(problems)
                             + "; fix: prepare the store again (or copy it whole)")

    def file_problems(self, verify: bool = True) -> list[str]:
        """Each manifest file that is missing, of the wrong size or (`verify`) of the wrong sha256."""
        problems = []
        for name, info in self.manifest.get("files", {}).items():
            file = self.path / name
            if not file.is_file():
                problems.append(f"{name} is missing")
                continue
            size = file.stat().st_size
            if size != info["bytes"]:
                problems.append(f"{name} has {size} bytes, the manifest says {info['bytes']} (truncated or altered)")
            elif verify and file_digest(file) != info["sha256"]:
                problems.append(f"{name}'s sha256 does not match the manifest (altered or corrupt)")
        return problems

    # ----------------------------------------------------------------------------------- reading
    @property
    def num_documents(self) -> int:
        """Documents in the store, train and val together (`split_info` gives one split's)."""
        return len(self.split_ids)

    @property
    def fingerprint(self) -> str:
        """Identifies the store's content (tokens and tokenizer), for a loader's state to name its data."""
        return hashlib.sha256((self.manifest["files"][TOKENS]["sha256"] + self.tokenizer_hash).encode()).hexdigest()[:16]

    def split_documents(self, split: str) -> np.ndarray:
        """Indices (int64) of the documents in `split` ("train" or "val"), in store order."""
        if split not in SPLITS:
            raise ValueError(f"split={split!r}: a token store has splits {sorted(SPLITS)}")
        return np.flatnonzero(self.split_ids == SPLITS[split]).astype(np.int64)

    def split_info(self, split: str) -> SplitInfo:
        """Documents and tokens of one split, computed from the offsets (no token is read)."""
        docs = self.split_documents(split)
        lengths = np.asarray(self.offsets[docs + 1]) - np.asarray(self.offsets[docs])
        return SplitInfo(len(docs), int(lengths.sum()))

    def document(self, index: int) -> np.ndarray:
        """Tokens of document `index` (ending with EOS), as a read-only view of the memory map."""
        return self.tokens[int(self.offsets[index]):int(self.offsets[index + 1])]

    def unigram_distribution(self, split: str = "train", *, targets_only: bool = False) -> np.ndarray:
        """Frequency of each token id in the split (float64 [vocab_size], sums to 1).

        `targets_only`: count only the tokens a loss is computed on: the loss mask's 1s (a chat
        store's assistant tokens), never a document's first token (packing makes it context only).
        """
        counts = np.zeros(self.vocab_size, dtype=np.int64)
        masked = targets_only and self.loss_mask is not None
        for start, stop in self._token_ranges(split):
            for lo in range(start, stop, _CHUNK):
                hi = min(lo + _CHUNK, stop)
                tokens = self.tokens[lo:hi]
                if masked:
                    tokens = tokens[np.asarray(self.loss_mask[lo:hi]) != 0]
                counts += np.bincount(tokens, minlength=self.vocab_size)
        if targets_only:
            firsts = np.asarray(self.offsets)[self.split_documents(split)]
            if masked:
                firsts = firsts[np.asarray(self.loss_mask)[firsts] != 0]
            counts -= np.bincount(self.tokens[firsts], minlength=self.vocab_size)
        return counts / max(counts.sum(), 1)

    def unigram_entropy(self, split: str = "train", *, targets_only: bool = False) -> float:
        """Entropy in nats of the split's token frequencies: the loss of the best context-free predictor.

        A language model that learned anything beyond token frequencies sits below it; the demo prints
        both so a user sees the model used the context. Compare a masked (fine-tuning) loss with
        `targets_only=True`: the loss never counts prompt tokens, so neither may its reference.
        """
        p = self.unigram_distribution(split, targets_only=targets_only)
        p = p[p > 0]
        return float(-(p * np.log(p)).sum())

    def _token_ranges(self, split: str) -> list[tuple[int, int]]:
        """The split's tokens as maximal contiguous [start, stop) ranges of the flat array."""
        docs = self.split_documents(split)
        ranges: list[tuple[int, int]] = []
        for d in docs:
            start, stop = int(self.offsets[d]), int(self.offsets[d + 1])
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], stop)
            else:
                ranges.append((start, stop))
        return ranges

    def tokenizer_dir(self) -> Path:
        """The tokenizer saved with the store: decoding and generation use the tokens' own vocabulary."""
        return self.path / TOKENIZER

    def has_tokenizer(self) -> bool:
        """Whether the store carries its tokenizer (`prepare` saves it; `write_store` does not)."""
        return any((self.tokenizer_dir() / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))

    def __repr__(self) -> str:
        return (f"TokenStore({str(self.path)!r}: {self.num_documents} documents, {self.num_tokens} tokens, "
                f"{self.dtype.name}, vocab {self.vocab_size})")
