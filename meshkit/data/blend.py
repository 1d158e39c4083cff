"""Blends: several token stores mixed by weight, sample by sample, deterministic and resumable.

Why a periodic schedule: the source of global sample g and its index inside that source must be a
pure function of g (so a loader resumes from one integer under any dp size), and the realized mix
should follow the weights closely at every prefix, not only on average. Weights are apportioned to
integer counts per block of `BLOCK` samples (largest remainders); inside a block the sources are
interleaved by the error-minimising rule (each next sample goes to the source furthest behind its
share, as Megatron's BlendedDataset does); every block repeats that order. So source i gets exactly
n_i of every `BLOCK` consecutive samples, its k-th sample is its own global sample k (each source
epochs and reshuffles on its own), and after any prefix of g samples each source is within one sample
of its share of that block. A weight below 1 / BLOCK of the total is refused.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

import numpy as np

from meshkit.data.packing import PackedRows, Row
from meshkit.data.store import TokenStore

__all__ = ["BLOCK", "BlendedRows", "block_schedule"]

BLOCK = 1000


def block_schedule(weights: list[float], block: int = BLOCK) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(samples per source per block, source of each block position, index among that source's samples)."""
    total = sum(Fraction(w) for w in weights)
    exact = [Fraction(w) / total * block for w in weights]  # exact quotas: a float tie cannot flip a sample
    counts = [math.floor(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))[:block - sum(counts)]:
        counts[i] += 1
    taken = [0] * len(weights)
    source = np.empty(block, dtype=np.int64)
    rank = np.empty(block, dtype=np.int64)
    for t in range(block):
        i = max(range(len(weights)), key=lambda i: ((t + 1) * counts[i] / block - taken[i], -i))
        source[t], rank[t] = i, taken[i]
        taken[i] += 1
    return np.asarray(counts, dtype=np.int64), source, rank


class BlendedRows:
    """The rows of several stores' `split`, blended by `weights`: `sample(g)` like `PackedRows`."""

    def __init__(self, stores: Mapping[str, TokenStore], weights: Mapping[str, float] | None, *, seq_len: int,
                 pack: bool = True, seed: int = 0, split: str = "train"):
        if not stores:
            raise ValueError("a blend needs at least one token store")
        if weights is None or set(weights) != set(stores):
            raise ValueError(f"blend weights {dict(weights or {})} must name exactly the stores {sorted(stores)}")
        bad = {k: w for k, w in weights.items() if not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0)}
        if bad:
            raise ValueError(f"blend weights {bad}: each must be a finite number > 0")
        self.names = sorted(stores)
        self.weights = {k: float(weights[k]) for k in self.names}
        total = sum(self.weights.values())
        small = [k for k in self.names if self.weights[k] / total < 1 / BLOCK]
        if small:
            raise ValueError(f"blend weights of {small} are below 1/{BLOCK} of the total; fix: larger weights or "
                             "leave those stores out")
        vocab = {k: (stores[k].vocab_size, stores[k].tokenizer_hash) for k in self.names}
        if len(set(vocab.values())) > 1:
            raise ValueError(f"blended stores were written by different tokenizers {vocab}; fix: prepare them "
                             "all with the same --tokenizer")
        self.sources = [PackedRows(stores[k], seq_len=seq_len, pack=pack, seed=seed, split=split) for k in self.names]
        self.counts, self._source, self._rank = block_schedule([self.weights[k] for k in self.names])
        self.rows_per_epoch = sum(s.rows_per_epoch for s in self.sources)
        self.tokens = sum(s.tokens for s in self.sources)

    def source_of(self, g: int) -> tuple[int, int]:
        """(source number in sorted-name order, that source's own sample index) of global sample g."""
        block, p = divmod(g, BLOCK)
        i = int(self._source[p])
        return i, block * int(self.counts[i]) + int(self._rank[p])

    def sample(self, g: int) -> Row:
        """Global sample g of the blend: the k-th sample of the store the weights assign g to."""
        i, k = self.source_of(g)
        return self.sources[i].sample(k)

    def in_first_epoch(self, g: int) -> bool:
        """Whether global sample g is a row of its source's epoch 0."""
        i, k = self.source_of(g)
        return self.sources[i].in_first_epoch(k)

    def padding(self) -> Row:
        """A row with no target, as `PackedRows.padding`."""
        return self.sources[0].padding()

    def identity(self) -> dict[str, Any]:
        """Every store's fingerprint and the weights: a resume on other data or weights is refused."""
        return {"blend": {k: s.store.fingerprint for k, s in zip(self.names, self.sources)}, "weights": self.weights}
