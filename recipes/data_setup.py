"""The recipe's data: a token store (or a blend of stores) through `meshkit.data`, or synthetic tokens.

`build` returns one object the training loop reads the same way whatever the source: `step_batches()`
(the step's micro-batches as `(input_ids, labels, position_ids)`), `held_out(index)`, `loader` (what
checkpoints save; None for synthetic data) and `reference` (the loss to compare with: the Markov
chain's floor, or the unigram entropy of the corpus). Every check runs here, at start-up, on every
rank alike, so a bad store or config fails before the first step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from train_config import DataConfig, TrainConfig

import meshkit
from meshkit.data import PackedLoader, TokenStore
from meshkit.data.tokenizer import load_tokenizer, tokenizer_hash

__all__ = ["StoreData", "SyntheticData", "build", "check_data_config"]


def check_data_config(data: DataConfig) -> None:
    """The [data] table's own consistency (no file is opened)."""
    if data.synthetic and (data.path or data.weights):
        raise ValueError(f"[data] synthetic = true with path = {data.path!r} / weights = {data.weights}: choose one "
                         "(synthetic Markov tokens, or a token store); fix: add --no-synthetic to train on the store "
                         "(the preset sets synthetic = true), or drop --path/--weights")
    if data.path and data.weights:
        raise ValueError("[data] path and weights both given; fix: path = one store, or weights = {\"<store dir>\" = "
                         "weight, ...} to blend several")


class SyntheticData:
    """Today's Markov chain behind the loop's data interface (the loss floor is ln(branching))."""

    loader = None
    wait_s = 0.0

    def __init__(self, markov: Any, grad_accum: int, branching: int):
        self.markov, self.grad_accum = markov, grad_accum
        self.reference = f"floor ln({branching}) = {math.log(branching):.4f}"
        self.reference_loss = (f"floor ln({branching})", math.log(branching))  # (what, value) for the loss plot

    def step_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor, None]]:
        """Step `step`'s micro-batches: the chain's batches are a function of the step number."""
        return [(*self.markov.batch_at(step, micro), None) for micro in range(self.grad_accum)]

    def held_out(self, index: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        return (*self.markov.held_out(index), None)


class StoreData:
    """A `PackedLoader` over the store(s) for training, the held-out split for evaluation."""

    def __init__(self, loader: PackedLoader, val: PackedLoader | None, grad_accum: int, entropy: float):
        self.loader, self.val, self.grad_accum = loader, val, grad_accum
        self.reference = f"unigram entropy of the corpus {entropy:.4f}"
        self.reference_loss = ("unigram entropy of the corpus", entropy)  # (what, value) for the loss plot
        self.entropy = entropy

    @property
    def wait_s(self) -> float:
        return self.loader.wait_s

    def step_batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        """The loader's next global batch (its position came from the checkpoint on resume), in micro-batches."""
        input_ids, labels, position_ids = next(self.loader)
        return list(zip(*(t.chunk(self.grad_accum) for t in (input_ids, labels, position_ids))))

    def held_out(self, index: int) -> tuple[torch.Tensor, ...]:
        return self.val.batch(index)

    def prompt(self, tokens: int = 16) -> tuple[torch.Tensor, Any]:
        """The first `tokens` tokens of the first held-out document [1, tokens], and the store's tokenizer.

        The hook for a generated sample at the end of training (issue #14 adds `pm.generate`):
        `ids, tok = data.prompt(); print(tok.decode(pm.generate(ids, ...)[0]))`.
        """
        rows = self.loader.rows
        store = rows.store if hasattr(rows, "store") else rows.sources[0].store
        docs = store.split_documents("val")
        first = store.document(int(docs[0]) if len(docs) else 0)[:tokens]
        return torch.from_numpy(first.astype("int64"))[None], load_tokenizer(store.tokenizer_dir(), "the store's tokenizer")


def _stores(data: DataConfig) -> TokenStore | dict[str, TokenStore]:
    if data.weights:
        return {name: TokenStore(name) for name in data.weights}
    return TokenStore(data.path)


def _check_tokenizer(stores: TokenStore | dict[str, TokenStore], model_dir: Path | None) -> None:
    """With --model-path: a store written by another tokenizer than the model's own is refused."""
    if model_dir is None or not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return
    theirs = tokenizer_hash(load_tokenizer(model_dir, "the model's tokenizer"))
    for store in ([stores] if isinstance(stores, TokenStore) else stores.values()):
        if store.tokenizer_hash != theirs:
            raise ValueError(f"token store {str(store.path)!r} was written by another tokenizer (sha256 "
                             f"{store.tokenizer_hash[:12]}) than the model's own in {str(model_dir)!r} ({theirs[:12]}); "
                             f"fix: python -m meshkit.data prepare ... --tokenizer {model_dir}")


def build(data: DataConfig, train: TrainConfig, pm: meshkit.ParallelModel, model_dir: Path | None,
          synthetic: Any) -> SyntheticData | StoreData:
    """The run's data. `synthetic()` makes the Markov chain when the [data] table asks for no store."""
    check_data_config(data)
    if data.synthetic or not (data.path or data.weights):
        return SyntheticData(synthetic(), train.grad_accum, data.branching)
    stores = _stores(data)
    _check_tokenizer(stores, model_dir)
    global_batch = pm.dp_size * train.local_batch * train.grad_accum
    common = dict(seq_len=train.seq_len, seed=train.seed, pack=data.pack,
                  weights=dict(data.weights) if data.weights else None)
    loader = pm.dataloader(stores, global_batch=global_batch, **common)
    val = None
    if train.eval_every and train.eval_batches:
        val = pm.dataloader(stores, global_batch=pm.dp_size * train.local_batch, split="val", prefetch=0, **common)
    return StoreData(loader, val, train.grad_accum, _unigram_entropy(stores, data.weights))


def _unigram_entropy(stores: TokenStore | dict[str, TokenStore], weights: dict[str, float]) -> float:
    """Entropy (nats) of the training tokens' frequencies; of the weighted mixture for a blend."""
    if isinstance(stores, TokenStore):
        p = stores.unigram_distribution("train")
    else:
        total = sum(weights.values())
        p = sum(stores[k].unigram_distribution("train") * (w / total) for k, w in weights.items())
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())
