"""The recipe's data: a token store (or a blend of stores) through `meshkit.data`, or synthetic tokens.

`build` returns one object the training loop reads the same way whatever the source: `step_batches()`
(the step's micro-batches as `(input_ids, labels, position_ids)`), `held_out(index)` and
`held_out_batches(requested)`, `loader` (what checkpoints save; None for synthetic data),
`reference` (the loss to compare with: the Markov chain's floor, or the unigram entropy of the
tokens the loss counts), `notes` (what rank 0 says once about the data's size) and `tokenizer` (the
directory the export writes beside the model, or None). Every check runs at start-up, on every rank
alike, and every problem of the data is reported in one error (`data_problems`, which
`train_llama.py --check` lists too), so a bad store or config fails before the first step, once.

A small fine-tuning set is trained as it is: train data smaller than one global batch repeats
within the batch (the loader epochs), and a held-out split smaller than the evaluation's batches is
evaluated once over what it holds, the last batch padded with rows that have no target.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from train_config import DataConfig, TrainConfig
from transformers import GenerationConfig

import meshkit
from meshkit.data import BlendedRows, PackedLoader, PackedRows, TokenStore
from meshkit.data.loader import fits_model_problems
from meshkit.data.tokenizer import load_tokenizer, tokenizer_hash

__all__ = ["MarkovTokens", "StoreData", "SyntheticData", "build", "check_data_config", "data_problems",
           "use_data_tokens"]

HELD_OUT_STEP = -1  # training steps count from 1


def check_data_config(data: DataConfig) -> None:
    """The [data] table's own consistency (no file is opened)."""
    if data.synthetic and (data.path or data.weights):
        raise ValueError(f"[data] synthetic = true with path = {data.path!r} / weights = {data.weights}: choose one "
                         "(synthetic Markov tokens, or a token store); fix: add --no-synthetic to train on the store "
                         "(the preset sets synthetic = true), or drop --path/--weights")
    if data.path and data.weights:
        raise ValueError("[data] path and weights both given; fix: path = one store, or weights = {\"<store dir>\" = "
                         "weight, ...} to blend several")


def uses_store(data: DataConfig) -> bool:
    """Whether the run reads token stores (else the synthetic Markov chain)."""
    return not data.synthetic and bool(data.path or data.weights)


class MarkovTokens:
    """Deterministic synthetic batches: rows of the GLOBAL batch, a function of (seed, step, micro-batch).

    Each data rank keeps its rows of a global batch, so tp/cp/pp peers (same dp_rank) agree by
    construction, and a run resumed under another plan with the same global batch sees the same tokens.
    """

    def __init__(self, vocab_size: int, seq_len: int, batch: int, dp_rank: int, config: DataConfig,
                 dp_size: int = 1):
        if config.branching < 1:
            raise ValueError(f"[data] branching={config.branching}: must be >= 1")
        self.vocab_size, self.seq_len, self.batch, self.dp_rank = vocab_size, seq_len, batch, dp_rank
        self.dp_size = dp_size
        self.seed = config.chain_seed
        gen = torch.Generator().manual_seed(config.chain_seed)
        self.successors = torch.randint(0, vocab_size, (vocab_size, config.branching), generator=gen)

    def batch_at(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This data rank's rows of micro-batch `micro` of step `step` (input ids and unshifted labels)."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_033 + step) * 1_009 + micro)
        rows = self.batch * self.dp_size
        tokens = torch.empty(rows, self.seq_len, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, self.vocab_size, (rows,), generator=gen)
        choice = torch.randint(0, self.successors.shape[1], (rows, self.seq_len), generator=gen)
        for t in range(1, self.seq_len):
            tokens[:, t] = self.successors[tokens[:, t - 1], choice[:, t]]
        mine = tokens[self.dp_rank * self.batch:(self.dp_rank + 1) * self.batch]
        return mine, mine.clone()  # labels are unshifted (HF convention); meshkit shifts once

    def held_out(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch `index`: the same chain, from seeds no training step uses."""
        return self.batch_at(HELD_OUT_STEP, index)


class SyntheticData:
    """The Markov chain behind the loop's data interface (the loss floor is ln(branching))."""

    loader = None
    wait_s = 0.0
    notes: list[str] = []

    def __init__(self, markov: MarkovTokens, grad_accum: int, branching: int, tokenizer: Path | None):
        self.markov, self.grad_accum, self.tokenizer = markov, grad_accum, tokenizer
        self.reference = f"floor ln({branching}) = {math.log(branching):.4f}"
        self.reference_loss = (f"floor ln({branching})", math.log(branching))  # (what, value) for the loss plot

    def step_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor, None]]:
        """Step `step`'s micro-batches: the chain's batches are a function of the step number."""
        return [(*self.markov.batch_at(step, micro), None) for micro in range(self.grad_accum)]

    def held_out(self, index: int) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Held-out batch `index` (as many as asked: the chain never runs out)."""
        return (*self.markov.held_out(index), None)

    def held_out_batches(self, requested: int) -> int:
        """How many held-out batches an evaluation reads."""
        return requested


class StoreData:
    """A `PackedLoader` over the store(s) for training, one pass over the held-out split for evaluation."""

    def __init__(self, loader: PackedLoader, val: PackedLoader | None, grad_accum: int, entropy: float,
                 tokenizer: Path | None, eval_batches: int):
        self.loader, self.val, self.grad_accum, self.tokenizer = loader, val, grad_accum, tokenizer
        rows = loader.rows
        self.store = rows.store if isinstance(rows, PackedRows) else rows.sources[0].store
        what = "the target tokens" if self.store.loss_mask is not None else "the corpus"
        self.reference = f"unigram entropy of {what} {entropy:.4f}"
        self.reference_loss = (f"unigram entropy of {what}", entropy)  # (what, value) for the loss plot
        self.entropy = entropy
        self.notes = []
        if loader.epochs_per_batch > 1:
            self.notes.append(f"the train split holds {rows.rows_per_epoch} rows of {loader.seq_len} tokens, fewer "
                              f"than one global batch of {loader.global_batch}: each step sees it "
                              f"{loader.epochs_per_batch:.3g} times (the loader epochs, each epoch in its own order)")
        if val is not None and val.num_batches < eval_batches:
            rows_val = val.rows.rows_per_epoch
            self.notes.append(f"the held-out split holds {rows_val} row{'s' * (rows_val != 1)}, fewer than "
                              f"eval_batches={eval_batches} batches of {val.global_batch}: each evaluation reads "
                              f"them once in {val.num_batches} batch{'es' * (val.num_batches != 1)}, padded")

    @property
    def wait_s(self) -> float:
        """Seconds the loop waited for the loader so far."""
        return self.loader.wait_s

    def step_batches(self, step: int) -> list[tuple[torch.Tensor, ...]]:
        """The loader's next global batch (its position came from the checkpoint on resume), in micro-batches."""
        input_ids, labels, position_ids = next(self.loader)
        return list(zip(*(t.chunk(self.grad_accum) for t in (input_ids, labels, position_ids))))

    def held_out(self, index: int) -> tuple[torch.Tensor, ...]:
        """Held-out batch `index` of the one pass (rows past the split's end hold no target)."""
        return self.val.batch(index)

    def held_out_batches(self, requested: int) -> int:
        """How many held-out batches an evaluation reads: the asked number, at most one pass."""
        return min(requested, self.val.num_batches) if self.val is not None else 0

    def prompt(self, tokens: int = 16) -> tuple[torch.Tensor, Any]:
        """A held-out prompt [1, P] and the store's tokenizer, for the sample at the end of training.

        A chat store's (one with a loss mask): the first held-out conversation up to its first
        answer, i.e. through the assistant header and no further, so the sample is the model's own
        answer; any other store's: the first `tokens` tokens of the first held-out document.
        """
        store = self.store
        docs = store.split_documents("val")
        d = int(docs[0]) if len(docs) else 0
        doc = np.asarray(store.document(d))
        if store.loss_mask is not None:
            start = int(store.offsets[d])
            answers = np.flatnonzero(np.asarray(store.loss_mask[start:start + len(doc)]))
            doc = doc[:int(answers[0])] if len(answers) else doc[:-1]
        else:
            doc = doc[:tokens]
        tokenizer = load_tokenizer(store.tokenizer_dir(), "the store's tokenizer")
        return torch.from_numpy(doc.astype("int64"))[None], tokenizer


def _open_stores(data: DataConfig) -> tuple[dict[str, TokenStore], list[str]]:
    """Every store the table names that opens (checksums verified), and what is wrong with the others."""
    opened, problems = {}, []
    for name in (data.weights or [data.path]):
        try:
            opened[name] = TokenStore(name)
        except ValueError as err:
            problems.append(str(err))
    return opened, problems


def _tokenizer_problems(stores: dict[str, TokenStore], model_dir: Path | None) -> list[str]:
    """With --model-path: a store written by another tokenizer than the model's own is refused."""
    if not _holds_tokenizer(model_dir):
        return []
    theirs = tokenizer_hash(load_tokenizer(model_dir, "the model's tokenizer"))
    return [f"token store {str(store.path)!r} was written by another tokenizer (sha256 {store.tokenizer_hash[:12]}) "
            f"than the model's own in {str(model_dir)!r} ({theirs[:12]}); fix: python -m meshkit.data prepare ... "
            f"--tokenizer {model_dir}" for store in stores.values() if store.tokenizer_hash != theirs]


def _holds_tokenizer(directory: Path | None) -> bool:
    return directory is not None and any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def _rows(stores: dict[str, TokenStore], data: DataConfig, train: TrainConfig, split: str) -> PackedRows | BlendedRows:
    common = dict(seq_len=train.seq_len, pack=data.pack, seed=train.seed, split=split)
    if data.weights:
        return BlendedRows(stores, dict(data.weights), **common)
    return PackedRows(stores[data.path], **common)


def data_problems(data: DataConfig, train: TrainConfig, model_config: Any,
                  model_dir: Path | None) -> tuple[dict[str, TokenStore], list[str]]:
    """(the stores that opened, every problem of the run's data, one line each); pure, the same on every rank.

    Stores that do not open or verify, a store written by another tokenizer than the model's, a
    vocabulary the embedding cannot hold, seq_len above max_position_embeddings, a split without
    documents (val only when evaluating), blend weights that do not fit: all of them, not the first.
    """
    if not uses_store(data):
        return {}, []
    stores, problems = _open_stores(data)
    problems += _tokenizer_problems(stores, model_dir)
    # seq_len against max_position_embeddings is a config problem, named once by the config check
    problems += [p for p in fits_model_problems(stores, train.seq_len, model_config) if not p.startswith("seq_len=")]
    if len(stores) < len(data.weights or [data.path]):
        return stores, problems  # the rows of a blend need every store
    splits = ["train"] + (["val"] if train.eval_every and train.eval_batches else [])
    for split in splits:
        try:
            _rows(stores, data, train, split)
        except ValueError as err:
            problems.append(f"[data] {err}" + ("; or --eval-every 0 to train without evaluation" if split == "val" else ""))
    return stores, problems


def export_tokenizer(stores: dict[str, TokenStore], model_dir: Path | None) -> Path | None:
    """The tokenizer an export writes beside the model: the one the data was made with, else the model's."""
    for store in stores.values():
        if store.has_tokenizer():
            return store.tokenizer_dir()
    return model_dir if _holds_tokenizer(model_dir) else None


def build(data: DataConfig, train: TrainConfig, pm: meshkit.ParallelModel, model_dir: Path | None,
          synthetic: Any) -> SyntheticData | StoreData:
    """The run's data. `synthetic()` makes the Markov chain when the [data] table asks for no store."""
    check_data_config(data)
    if not uses_store(data):
        return SyntheticData(synthetic(), train.grad_accum, data.branching, export_tokenizer({}, model_dir))
    stores, problems = data_problems(data, train, pm.model.config, model_dir)
    if problems:
        raise ValueError("the data has problems:\n  - " + "\n  - ".join(problems))
    chosen = stores if data.weights else stores[data.path]
    global_batch = pm.dp_size * train.local_batch * train.grad_accum
    common = dict(seq_len=train.seq_len, seed=train.seed, pack=data.pack,
                  weights=dict(data.weights) if data.weights else None)
    loader = pm.dataloader(chosen, global_batch=global_batch, **common)
    val = None
    if train.eval_every and train.eval_batches:
        val = pm.dataloader(chosen, global_batch=pm.dp_size * train.local_batch, split="val", prefetch=0,
                            repeat=False, **common)
    return StoreData(loader, val, train.grad_accum, _unigram_entropy(stores, data.weights),
                     export_tokenizer(stores, model_dir), train.eval_batches)


def use_data_tokens(model: Any, data: SyntheticData | StoreData, model_dir: Path | None) -> None:
    """The special tokens generation (and the export) stop at: the model directory's generation config,
    or, for a model trained from scratch on a store, the store tokenizer's eos/bos/pad, so the model
    stops where its training documents ended (a random-init config's own ids mean nothing there)."""
    if model_dir is not None:
        if (model_dir / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(str(model_dir))
        return
    if not isinstance(data, StoreData):
        return
    tok = load_tokenizer(data.store.tokenizer_dir(), "the store's tokenizer") if data.store.has_tokenizer() else None
    ids = {"eos_token_id": tok.eos_token_id if tok else data.store.eos_id,
           "bos_token_id": tok.bos_token_id if tok else None, "pad_token_id": tok.pad_token_id if tok else None}
    for target in (model.config, model.generation_config):
        for key, value in ids.items():
            setattr(target, key, value)


def _unigram_entropy(stores: dict[str, TokenStore], weights: dict[str, float]) -> float:
    """Entropy (nats) of the training targets' frequencies; of the weighted mixture for a blend."""
    if not weights:
        (store,) = stores.values()
        p = store.unigram_distribution("train", targets_only=True)
    else:
        total = sum(weights.values())
        p = sum(stores[k].unigram_distribution("train", targets_only=True) * (w / total) for k, w in weights.items())
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())
