"""Packing and the loader: every token once per epoch, right boundaries and labels, an order that does
not depend on the dp size, and resumption from `state_dict` at any point.

Stores are written in memory (`write_store`) with random documents; the checks use each row's
provenance (`PackedRows.flat_indices`: the flat store index of every token) against the store's
document offsets, an independent description of where documents start and end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from meshkit.context_parallel.sharding import document_ids
from meshkit.data import PackedLoader, PackedRows
from meshkit.data.packing import IGNORE
from meshkit.data.store import write_store

EOS = 0
VOCAB = 500


def _store(path, lengths, seed=0, val_every=0, masked=False):
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, VOCAB, n - 1), EOS) for n in lengths]
    split = np.array([1 if val_every and i % val_every == val_every - 1 else 0 for i in range(len(docs))])
    masks = [rng.integers(0, 2, len(d)) for d in docs] if masked else None
    return write_store(path, docs, eos_id=EOS, vocab_size=VOCAB, split_ids=split, loss_masks=masks)


def _check_row(store, rows: PackedRows, g: int, seen: list[np.ndarray]) -> None:
    idx = rows.flat_indices(g)
    row = rows.sample(g)
    offsets = np.asarray(store.offsets)
    starts = set(offsets[:-1].tolist())
    real = idx >= 0
    assert real[0] and (np.flatnonzero(~real).size == 0 or real[:np.flatnonzero(~real)[0]].all()), "padding only at the end"
    seen.append(idx[real])
    tokens = np.asarray(store.tokens)
    assert np.array_equal(row.input_ids[real], tokens[idx[real]])
    assert (row.input_ids[~real] == EOS).all() and (row.labels[~real] == IGNORE).all()
    doc_of = np.searchsorted(offsets, idx, side="right") - 1
    for t in range(rows.seq_len):
        if not real[t]:
            assert row.position_ids[t] == row.position_ids[t - 1] + 1  # pads continue, never a new document
            continue
        new_piece = t == 0 or idx[t] in starts or doc_of[t] != doc_of[t - 1]
        if not new_piece:
            assert idx[t] == idx[t - 1] + 1, "a document's tokens stay contiguous inside a row"
        assert row.position_ids[t] == (0 if new_piece else row.position_ids[t - 1] + 1)
        expected = IGNORE if idx[t] in starts else int(tokens[idx[t]])
        if store.loss_mask is not None and store.loss_mask[idx[t]] == 0:
            expected = IGNORE
        assert row.labels[t] == expected
        if t and row.labels[t] != IGNORE:  # the target's context token is of the same document
            assert doc_of[t - 1] == doc_of[t]
    if not rows.pack:
        assert len(set(doc_of[real].tolist())) == 1, "pack=False: one document per row"
    # meshkit's block-diagonal attention reads the same boundaries from the positions
    ids = document_ids(torch.from_numpy(row.position_ids)[None])[0].numpy()
    for t in range(1, rows.seq_len):
        if real[t]:
            assert (ids[t] == ids[t - 1]) == (doc_of[t] == doc_of[t - 1] and t > 0 and idx[t] not in starts)


@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=25), seq_len=st.integers(2, 17),
       pack=st.booleans(), seed=st.integers(0, 3), masked=st.booleans())
def test_every_token_once_per_epoch_with_right_boundaries_and_labels(tmp_path_factory, lengths, seq_len, pack, seed,
                                                                      masked):
    store = _store(tmp_path_factory.mktemp("s"), lengths, seed=seed, masked=masked)
    rows = PackedRows(store, seq_len=seq_len, pack=pack, seed=seed)
    expected_rows = -(-sum(lengths) // seq_len) if pack else sum(-(-n // seq_len) for n in lengths)
    assert rows.rows_per_epoch == expected_rows
    for epoch in (0, 1):
        seen: list[np.ndarray] = []
        for g in range(epoch * rows.rows_per_epoch, (epoch + 1) * rows.rows_per_epoch):
            _check_row(store, rows, g, seen)
        flat = np.concatenate(seen)
        assert np.array_equal(np.sort(flat), np.arange(store.num_tokens)), "each token exactly once per epoch"


def test_epochs_reshuffle_and_the_order_is_a_function_of_the_seed(tmp_path):
    store = _store(tmp_path, [7, 12, 3, 9, 30, 5, 11, 2] * 3)
    a, b = PackedRows(store, seq_len=8, seed=1), PackedRows(store, seq_len=8, seed=1)
    R = a.rows_per_epoch
    epoch0 = [a.flat_indices(g).tolist() for g in range(R)]
    assert epoch0 == [b.flat_indices(g).tolist() for g in range(R)]
    assert epoch0 != [a.flat_indices(g).tolist() for g in range(R, 2 * R)]
    assert epoch0 != [PackedRows(store, seq_len=8, seed=2).flat_indices(g).tolist() for g in range(R)]


def _global(loader_args, dp_size, step):
    parts = [PackedLoader(dp_rank=r, dp_size=dp_size, prefetch=0, **loader_args).batch(step) for r in range(dp_size)]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))


@given(global_batch=st.sampled_from([4, 8, 12]), seq_len=st.integers(2, 12), pack=st.booleans(), seed=st.integers(0, 5))
def test_global_rows_do_not_depend_on_dp_size(tmp_path_factory, global_batch, seq_len, pack, seed):
    store = _store(tmp_path_factory.mktemp("s"), [5, 17, 3, 40, 9, 2, 11, 26, 8, 13, 4, 30], seed=seed)
    args = dict(store=store, seq_len=seq_len, global_batch=global_batch, seed=seed, pack=pack)
    steps = range(PackedRows(store, seq_len=seq_len, pack=pack).rows_per_epoch // global_batch + 2)  # past an epoch
    for step in steps:
        whole = _global(args, 1, step)
        for dp in (2, 4):
            assert all(torch.equal(x, y) for x, y in zip(whole, _global(args, dp, step))), f"dp={dp} step={step}"


def test_iteration_prefetch_and_resume_across_dp_sizes(tmp_path):
    store = _store(tmp_path, [5, 17, 3, 40, 9, 2, 11, 26, 8, 13, 4, 30] * 2)
    args = dict(seq_len=8, global_batch=8, seed=3)
    straight = PackedLoader(store, **args)  # dp=1 prefetching: the reference order
    expected = [next(straight) for _ in range(12)]
    for step, batch in enumerate(expected):
        assert all(torch.equal(x, y) for x, y in zip(batch, straight.batch(step)))
    straight.close()
    # dp=4 runs 5 steps and saves; dp=2 resumes from that state and must see steps 5.. exactly
    ranks = [PackedLoader(store, dp_rank=r, dp_size=4, **args) for r in range(4)]
    for _ in range(5):
        for loader in ranks:
            next(loader)
    states = [loader.state_dict() for loader in ranks]
    assert all(s == states[0] for s in states) and states[0]["sample"] == 5 * 8
    resumed = [PackedLoader(store, dp_rank=r, dp_size=2, **args) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(states[0])
    for step in range(5, 12):
        got = [next(loader) for loader in resumed]
        assert all(torch.equal(torch.cat([g[i] for g in got]), expected[step][i]) for i in range(3)), step
    assert resumed[0].epoch > 1  # the run crossed epoch boundaries
    for loader in ranks + resumed:
        loader.close()


def test_state_from_other_data_or_order_is_refused(tmp_path):
    store = _store(tmp_path / "a", [5, 17, 3, 40, 9, 2, 11, 26])
    other = _store(tmp_path / "b", [5, 17, 3, 40, 9, 2, 11, 26], seed=9)
    state = PackedLoader(store, seq_len=8, global_batch=4, seed=1).state_dict()
    for loader, what in [(PackedLoader(store, seq_len=8, global_batch=4, seed=2), "seed"),
                         (PackedLoader(store, seq_len=4, global_batch=4, seed=1), "seq_len"),
                         (PackedLoader(store, seq_len=8, global_batch=4, seed=1, pack=False), "pack"),
                         (PackedLoader(other, seq_len=8, global_batch=4, seed=1), "data")]:
        with pytest.raises(ValueError, match=f"data loader {what}: saved"):
            loader.load_state_dict(state)
    PackedLoader(store, seq_len=8, global_batch=8, seed=1).load_state_dict(state)  # another global batch is fine


def test_the_store_fingerprint_names_its_tokenizer(tmp_path):
    """The same token ids written by two tokenizers are different data: a loader state from one store
    must not resume on the other."""
    docs = [np.array([5, 9, 3, EOS]), np.array([7, 2, EOS])]
    a = write_store(tmp_path / "a", docs, eos_id=EOS, vocab_size=VOCAB, tokenizer_sha256="1" * 64)
    b = write_store(tmp_path / "b", docs, eos_id=EOS, vocab_size=VOCAB, tokenizer_sha256="2" * 64)
    assert a.manifest["files"]["tokens.bin"] == b.manifest["files"]["tokens.bin"]
    assert a.fingerprint != b.fingerprint
    state = PackedLoader(a, seq_len=4, global_batch=2).state_dict()
    with pytest.raises(ValueError, match="data loader data: saved"):
        PackedLoader(b, seq_len=4, global_batch=2).load_state_dict(state)


def test_bad_loader_arguments(tmp_path):
    store = _store(tmp_path, [10, 10, 10], val_every=0)
    with pytest.raises(ValueError, match="global_batch=6 rows do not split over dp_size=4"):
        PackedLoader(store, seq_len=2, global_batch=6, dp_size=4)
    with pytest.raises(ValueError, match="no 'val' documents; fix: prepare it with --val-fraction"):
        PackedLoader(store, seq_len=2, global_batch=2, split="val")
    with pytest.raises(ValueError, match="seq_len=1"):
        PackedLoader(store, seq_len=1, global_batch=2)
    with pytest.raises(ValueError, match="dp_rank=2"):
        PackedLoader(store, seq_len=2, global_batch=2, dp_rank=2, dp_size=2)


def test_data_smaller_than_one_batch_epochs_within_it(tmp_path):
    """A small fine-tuning set (4 rows) under a global batch of 10: every batch holds whole epochs
    (each token once per epoch, each epoch in its own order)."""
    store = _store(tmp_path, [10, 10, 10])
    loaders = [PackedLoader(store, seq_len=8, global_batch=10, dp_rank=r, dp_size=2, seed=3, prefetch=0)
               for r in range(2)]
    rows = loaders[0].rows
    assert rows.rows_per_epoch == 4 and loaders[0].epochs_per_batch == 2.5
    for step in range(2):
        ids = torch.cat([next(loader)[0] for loader in loaders])
        for k in range(10):
            g = step * 10 + k
            real = rows.flat_indices(g)
            assert torch.equal(ids[k][real >= 0], torch.from_numpy(np.asarray(store.tokens)[real[real >= 0]]).long())
    for epoch in range(5):  # samples 0..19 are epochs 0..4: each covers every token exactly once
        seen = np.concatenate([rows.flat_indices(g)[rows.flat_indices(g) >= 0] for g in range(4 * epoch, 4 * epoch + 4)])
        assert np.array_equal(np.sort(seen), np.arange(30)), epoch
    assert not np.array_equal(rows.flat_indices(0), rows.flat_indices(4))  # another order next epoch


def test_one_pass_pads_the_last_batch_and_stops(tmp_path):
    """`repeat=False` (held-out evaluation): each row once, the batch filled with rows without a target,
    then StopIteration; a split smaller than one batch is evaluated on what it has."""
    store = _store(tmp_path, [9, 12, 5, 30, 7, 11], val_every=2)  # val: documents 1, 3, 5 (53 tokens)
    loaders = [PackedLoader(store, seq_len=8, global_batch=6, dp_rank=r, dp_size=2, split="val", repeat=False,
                            prefetch=p) for r, p in ((0, 0), (1, 2))]
    rows = loaders[0].rows
    assert rows.rows_per_epoch == 7 and loaders[0].num_batches == 2
    batches = [list(loader) for loader in loaders]
    assert [len(b) for b in batches] == [2, 2]
    labels = torch.cat([torch.cat([b[step][1] for b in batches]) for step in range(2)])  # 12 global rows
    for g in range(12):
        if g < 7:
            assert torch.equal(labels[g], torch.from_numpy(rows.sample(g).labels)), g
        else:
            assert (labels[g] == IGNORE).all(), f"row {g} past the split must hold no target"
    targets = sum(int((torch.from_numpy(rows.sample(g).labels) != IGNORE).sum()) for g in range(7))
    assert int((labels != IGNORE).sum()) == targets == 53 - 3  # every token but each document's first
