"""Rows of one split of a token store, as a pure function of (seed, epoch, global sample index).

Why a global sample index (Megatron's idea, done plainly): a per-rank iterator's position means
nothing under another dp size, but "global sample g" does. Sample g lies in epoch g // R (R rows per
epoch) and is row `row_order(epoch)[g % R]` of that epoch; step s of a loader reads samples
[s * global_batch, (s + 1) * global_batch) and dp rank r takes its contiguous share. So the global rows
of a step never depend on the dp size, and a loader resumes anywhere from one integer.

Packing (`pack=True`): each epoch concatenates the split's documents in an order drawn from
(seed, epoch) and cuts the stream into rows of `seq_len` tokens; rows are then visited in a second
order drawn from (seed, epoch), so neighbouring rows of the stream land in different batches. Every
token of the split is in exactly one row per epoch: the last row of an epoch is padded, not dropped,
and rows do not overlap (the first token of a row is never a target: `forward_backward` predicts
token t + 1 from position t within the row). `pack=False` gives one document per row: a document
longer than `seq_len` continues in further rows, each padded to `seq_len`.

In every row, `position_ids` restart at 0 at each document start and at the row start (HF's packed
convention, which meshkit's attention and every CP kind read as block-diagonal masks), a document's
first token has label -100 so no target is predicted across a document boundary, padding is EOS with
label -100 (positions continuing the last document, so they are never a document of their own), and
a store's loss mask 0 becomes -100.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshkit.data.store import TokenStore

__all__ = ["IGNORE", "PackedRows", "Row"]

IGNORE = -100
_DOC_ORDER, _ROW_ORDER = 0, 1


@dataclass(frozen=True)
class Row:
    """One sample as numpy arrays, so packing stays free of torch and the loader converts once per batch."""

    input_ids: np.ndarray  # int64 [seq_len]
    labels: np.ndarray  # int64 [seq_len], -100 where no target
    position_ids: np.ndarray  # int64 [seq_len]


class PackedRows:
    """The rows of `split` of `store` for one (seq_len, pack, seed); `sample(g)` is global sample g."""

    def __init__(self, store: TokenStore, *, seq_len: int, pack: bool = True, seed: int = 0, split: str = "train"):
        if seq_len < 2:
            raise ValueError(f"seq_len={seq_len}: a row needs at least 2 tokens (one target)")
        self.store, self.seq_len, self.pack, self.seed, self.split = store, seq_len, pack, seed, split
        docs = store.split_documents(split)
        if not len(docs):
            fix = "prepare it with --val-fraction or --val" if split == "val" else "prepare it with more input"
            raise ValueError(f"token store {str(store.path)!r} has no {split!r} documents; fix: {fix}")
        offsets = np.asarray(store.offsets)
        self._starts = offsets[docs]
        self._lengths = offsets[docs + 1] - self._starts
        self.tokens = int(self._lengths.sum())
        if pack:
            self.rows_per_epoch = -(-self.tokens // seq_len)
        else:
            chunks = -(-self._lengths // seq_len)
            self._chunk_doc = np.repeat(np.arange(len(docs)), chunks)
            first = np.repeat(np.cumsum(chunks) - chunks, chunks)
            self._chunk_offset = (np.arange(len(self._chunk_doc)) - first) * seq_len
            self.rows_per_epoch = len(self._chunk_doc)
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def in_first_epoch(self, g: int) -> bool:
        """Whether global sample g is a row of epoch 0 (a one-pass loader pads the others)."""
        return 0 <= g < self.rows_per_epoch

    def padding(self) -> Row:
        """A row with no target (EOS tokens, labels -100): what pads the last batch of a single pass."""
        S = self.seq_len
        return Row(np.full(S, self.store.eos_id, dtype=np.int64), np.full(S, IGNORE, dtype=np.int64),
                   np.arange(S, dtype=np.int64))

    def identity(self) -> dict[str, str]:
        """What a loader's state records to refuse resuming on other data."""
        return {"store": self.store.fingerprint}

    def _rng(self, epoch: int, kind: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, epoch, kind])

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(document order, stream offsets of the ordered documents, row order) of one epoch, cached."""
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:  # a batch spans at most two epochs
                self._epochs.pop(min(self._epochs))
            if self.pack:
                order = self._rng(epoch, _DOC_ORDER).permutation(len(self._lengths))
                stream = np.zeros(len(order) + 1, dtype=np.int64)
                np.cumsum(self._lengths[order], out=stream[1:])
            else:
                order = stream = np.zeros(0, dtype=np.int64)
            self._epochs[epoch] = (order, stream, self._rng(epoch, _ROW_ORDER).permutation(self.rows_per_epoch))
        return self._epochs[epoch]

    def locate(self, g: int) -> tuple[int, int]:
        """(epoch, row of that epoch's stream) of global sample g."""
        if g < 0:
            raise ValueError(f"sample index {g} < 0")
        epoch, j = divmod(g, self.rows_per_epoch)
        return epoch, int(self._epoch(epoch)[2][j])

    def segments(self, epoch: int, row: int) -> list[tuple[int, int, bool]]:
        """The row's pieces of documents as (flat token start, length, starts its document?)."""
        S = self.seq_len
        if not self.pack:
            d = self._chunk_doc[row]
            off = int(self._chunk_offset[row])
            return [(int(self._starts[d]) + off, min(S, int(self._lengths[d]) - off), off == 0)]
        order, stream, _ = self._epoch(epoch)
        lo, hi = row * S, min((row + 1) * S, self.tokens)
        k = int(np.searchsorted(stream, lo, side="right")) - 1
        pieces = []
        while lo < hi:
            doc_end = int(stream[k + 1])
            take = min(hi, doc_end) - lo
            within = lo - int(stream[k])
            pieces.append((int(self._starts[order[k]]) + within, take, within == 0))
            lo += take
            k += 1
        return pieces

    def flat_indices(self, g: int) -> np.ndarray:
        """Flat store index of every token of sample g (-1 for padding): the provenance tests check."""
        out = np.full(self.seq_len, -1, dtype=np.int64)
        t = 0
        for start, length, _ in self.segments(*self.locate(g)):
            out[t:t + length] = np.arange(start, start + length)
            t += length
        return out

    def sample(self, g: int) -> Row:
        """Global sample g: tokens, labels (unshifted, -100 where no target) and position ids."""
        S = self.seq_len
        ids = np.full(S, self.store.eos_id, dtype=np.int64)
        labels = np.full(S, IGNORE, dtype=np.int64)
        positions = np.empty(S, dtype=np.int64)
        mask = self.store.loss_mask
        t = 0
        for start, length, doc_start in self.segments(*self.locate(g)):
            piece = np.asarray(self.store.tokens[start:start + length], dtype=np.int64)
            ids[t:t + length] = piece
            labels[t:t + length] = piece
            if mask is not None:
                labels[t:t + length][np.asarray(mask[start:start + length]) == 0] = IGNORE
            if doc_start:
                labels[t] = IGNORE
            positions[t:t + length] = np.arange(length)
            t += length
        if t < S:  # padding continues the last piece's positions: never a document of its own
            positions[t:] = positions[t - 1] + 1 + np.arange(S - t)
        return Row(ids, labels, positions)
