"""`PackedLoader`: one dp rank's share of each global batch, resumable from one integer, prefetched.

Step s reads global samples [s * global_batch, (s + 1) * global_batch) (see `packing`); dp rank r of
dp_size takes the contiguous `global_batch / dp_size` rows starting at r times that. A global batch
may span two epochs (the last rows of epoch e, then the first rows of e + 1), or several when the
data holds fewer rows than one batch (a small fine-tuning set): nothing is dropped, and the epoch
boundary falls wherever the rows per epoch put it. Held-out evaluation wants each row once instead:
`repeat=False` makes one pass and pads the last batch with rows that have no target.

The state is the next global sample index plus what fixes the order (seed, seq_len, pack, split, the
data's fingerprint): the same on every rank, independent of dp size and global batch, so a
checkpoint saved under dp=4 resumes under dp=2 (or another tp/cp/pp plan) at exactly the next rows.

Prefetch: a background thread builds the next `prefetch` batches from the memory map while the
model steps; `wait_s` accumulates the time `next()` spent waiting for it (the data stall).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from meshkit.data.blend import BlendedRows
from meshkit.data.packing import PackedRows
from meshkit.data.store import TokenStore

__all__ = ["PackedLoader", "check_fits_model", "fits_model_problems"]

STATE_FORMAT = 1
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def check_fits_model(store: TokenStore | Mapping[str, TokenStore], seq_len: int, config: Any) -> None:
    """ValueError naming both sides when rows of `seq_len` from `store` cannot feed a model of `config`.

    A token id past the embedding's rows would fail deep inside the first forward (or, on a GPU,
    corrupt memory), and positions past `max_position_embeddings` extrapolate the rotary embedding
    silently; both are known before the first step.
    """
    problems = fits_model_problems(store, seq_len, config)
    if problems:
        raise ValueError("; ".join(problems))


def fits_model_problems(store: TokenStore | Mapping[str, TokenStore], seq_len: int, config: Any) -> list[str]:
    """Each reason `check_fits_model` would give, one line each (a caller may list them with others)."""
    stores = {"store": store} if isinstance(store, TokenStore) else dict(store)
    problems = []
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and seq_len > limit:
        problems.append(f"seq_len={seq_len} is above the model's max_position_embeddings={limit}; fix: seq_len <= {limit}")
    for s in stores.values():
        if s.vocab_size > config.vocab_size:
            problems.append(f"token store {str(s.path)!r} has a vocabulary of {s.vocab_size} tokens, the model's "
                            f"embedding {config.vocab_size} rows; fix: a store made with the model's own tokenizer "
                            f"(prepare --tokenizer <model dir>), or, for a model trained from scratch, a config with "
                            f"vocab_size >= {s.vocab_size} (the recipe: --model-set vocab_size={s.vocab_size})")
    return problems


# Loaders whose prefetch thread may be running. A daemon thread still inside a torch op (which
# releases the GIL) when the interpreter finalizes is killed by CPython mid C++ frame, and the
# process aborts ("terminate called without an active exception"): the thread is stopped at exit.
_PREFETCHING: weakref.WeakSet[PackedLoader] = weakref.WeakSet()


@atexit.register
def _stop_prefetching() -> None:
    for loader in list(_PREFETCHING):
        loader.close()


class PackedLoader:
    """Batches `(input_ids, labels, position_ids)` of `global_batch / dp_size` rows for one dp rank.

    `store` is a `TokenStore`, or a mapping of names to stores blended by `weights` (see `blend`).
    Labels are unshifted with -100 where there is no target, as `ParallelModel.forward_backward`
    takes them. Iterating never ends (epochs follow each other; data smaller than one global batch
    is repeated within a batch: `epochs_per_batch` > 1); `batch(step)` is the pure form. `repeat=False` is
    one pass over the split, for held-out evaluation: `num_batches` batches, the rows past the
    split's end padded with no target, so a split smaller than a batch is evaluated on what it has.
    Every bad argument raises ValueError at construction, identically on every rank.
    """

    def __init__(self, store: TokenStore | Mapping[str, TokenStore], *, seq_len: int, global_batch: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0, split: str = "train", pack: bool = True,
                 weights: Mapping[str, float] | None = None, prefetch: int = 2, repeat: bool = True):
        for name, value, low in (("global_batch", global_batch, 1), ("dp_size", dp_size, 1), ("prefetch", prefetch, 0)):
            if value < low:
                raise ValueError(f"{name}={value}: must be >= {low}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank}: must be in [0, dp_size={dp_size})")
        if global_batch % dp_size:
            raise ValueError(f"global_batch={global_batch} rows do not split over dp_size={dp_size}; fix: a multiple "
                             f"of {dp_size} (e.g. {dp_size * max(global_batch // dp_size, 1)})")
        if isinstance(store, TokenStore):
            if weights is not None:
                raise ValueError("weights given for a single token store; fix: pass a mapping of names to stores")
            self.rows: PackedRows | BlendedRows = PackedRows(store, seq_len=seq_len, pack=pack, seed=seed, split=split)
        else:
            self.rows = BlendedRows(store, weights, seq_len=seq_len, pack=pack, seed=seed, split=split)
        self.seq_len, self.global_batch, self.seed, self.split, self.pack = seq_len, global_batch, seed, split, pack
        self.repeat = repeat
        # repeat=False: one pass; the last batch is padded with rows that hold no target
        self.num_batches = None if repeat else -(-self.rows.rows_per_epoch // global_batch)
        self.dp_rank, self.dp_size, self.prefetch = dp_rank, dp_size, prefetch
        self.local_batch = global_batch // dp_size
        self.wait_s = 0.0  # total time next() waited for data
        self._sample = 0  # the next global sample index
        self._thread: threading.Thread | None = None
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------------------------ pure form
    def rows_at(self, first_sample: int) -> Batch:
        """This rank's rows of the global batch starting at global sample `first_sample`."""
        start = first_sample + self.dp_rank * self.local_batch
        rows = [self.rows.sample(g) if self.repeat or self.rows.in_first_epoch(g) else self.rows.padding()
                for g in range(start, start + self.local_batch)]
        return tuple(torch.from_numpy(np.stack([getattr(r, f) for r in rows]))
                     for f in ("input_ids", "labels", "position_ids"))  # type: ignore[return-value]

    def batch(self, step: int) -> Batch:
        """This rank's rows of global batch `step` (0-based), whatever was iterated before."""
        return self.rows_at(step * self.global_batch)

    @property
    def epochs_per_batch(self) -> float:
        """Epochs of the data one global batch holds: above 1 for data smaller than a batch."""
        return self.global_batch / self.rows.rows_per_epoch

    @property
    def epoch(self) -> float:
        """Epochs consumed so far, fractional (a blend counts its rows against the sum of its sources')."""
        return self._sample / self.rows.rows_per_epoch

    # ------------------------------------------------------------------------------------ iteration
    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> Batch:
        if self.num_batches is not None and self._sample >= self.num_batches * self.global_batch:
            self.close()
            raise StopIteration
        if self.prefetch == 0:
            out = self.rows_at(self._sample)
        else:
            if self._thread is None:
                self._start()
            begin = time.perf_counter()
            first, out = self._queue.get()
            self.wait_s += time.perf_counter() - begin
            if isinstance(out, BaseException):
                self.close()
                raise out
            assert first == self._sample, "prefetch out of step"  # internal invariant, not user input
        self._sample += self.global_batch
        return out

    def _start(self) -> None:
        _PREFETCHING.add(self)
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._produce, args=(self._sample, self._stop, self._queue),
                                        name="meshkit-data-prefetch", daemon=True)
        self._thread.start()

    def _produce(self, sample: int, stop: threading.Event, out: queue.Queue) -> None:
        while not stop.is_set():
            try:
                item: Any = (sample, self.rows_at(sample))
            except BaseException as err:  # noqa: BLE001 - handed to the consumer, raised there
                item = (sample, err)
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item[1], BaseException):
                return
            sample += self.global_batch

    def close(self) -> None:
        """Stop the prefetch thread (a later `next()` starts a new one at the current position)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = self._queue = None

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)  # absent when __init__ refused its arguments
        if stop is not None:
            stop.set()

    # ---------------------------------------------------------------------------------------- state
    def _identity(self) -> dict[str, Any]:
        return {"seed": self.seed, "seq_len": self.seq_len, "pack": self.pack, "split": self.split,
                "data": self.rows.identity()}

    def state_dict(self) -> dict[str, Any]:
        """The position (next global sample) and what fixes the order; identical on every rank."""
        return {"format": STATE_FORMAT, "sample": self._sample, "global_batch": self.global_batch,
                **self._identity()}

    def state_problems(self, state: Any) -> list[str]:
        """Why `state` cannot resume this loader (empty: it can); pure, so every rank agrees."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            return [f"data loader state {state!r:.80} is not a PackedLoader state (format {STATE_FORMAT})"]
        mine = self._identity()
        return [f"data loader {key}: saved {state.get(key)!r}, this loader {value!r}; fix: the same {key} as the "
                "saving run (the order of the rows depends on it)" for key, value in mine.items() if state.get(key) != value]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position; ValueError if the saved loader read other data or another order."""
        problems = self.state_problems(state)
        if problems:
            raise ValueError("; ".join(problems))
        self.close()
        self._sample = int(state["sample"])
