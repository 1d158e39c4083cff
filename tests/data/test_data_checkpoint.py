"""The loader inside real meshkit checkpoints: a run saved under one plan resumes under another dp size
(and tp / pp) on exactly the rows it would have seen, so the loss and the parameters continue as in
the uninterrupted run. And `pm.dataloader` refuses a store or seq_len the model cannot take.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meshkit
from meshkit.data import TokenStore
from meshkit.data.store import write_store
from meshkit.testing.reference import ModelSpec

SPEC = ModelSpec()  # vocab 64, max_position_embeddings 256
TOL = 1e-5
SEQ, GLOBAL_BATCH, SAVED, AFTER = 8, 8, 3, 2


def _setup(plan: str, store_path: str, init: bool, seed: int = 1):
    pm = meshkit.parallelize(SPEC.build(device="meta"), meshkit.Plan.from_string(plan))
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    if init:
        pm.init_weights(0)
    loader = pm.dataloader(TokenStore(store_path), seq_len=SEQ, global_batch=GLOBAL_BATCH, seed=seed)
    return pm, optimizer, loader


def _step(pm, optimizer, loader) -> float:
    input_ids, labels, position_ids = next(loader)
    loss = pm.forward_backward(input_ids, labels, position_ids=position_ids)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _save_and_continue(plan: str, store_path: str, ckpt: str) -> dict:
    pm, optimizer, loader = _setup(plan, store_path, init=True)
    for _ in range(SAVED):
        _step(pm, optimizer, loader)
    pm.save_checkpoint(ckpt, optimizer, step=SAVED, data=loader)
    losses = [_step(pm, optimizer, loader) for _ in range(AFTER)]
    state = pm.full_state_dict()
    loader.close()
    return {"losses": losses, "state": state if torch.distributed.get_rank() == 0 else None}


def _resume(plan: str, store_path: str, ckpt: str) -> dict:
    pm, optimizer, loader = _setup(plan, store_path, init=False)
    info = pm.load_checkpoint(ckpt, optimizer, data=loader)
    loader_state = loader.state_dict()
    losses = [_step(pm, optimizer, loader) for _ in range(AFTER)]
    state = pm.full_state_dict()
    loader.close()
    return {"step": info["step"], "loader": loader_state, "losses": losses,
            "state": state if torch.distributed.get_rank() == 0 else None}


def _resume_with_other_seed(plan: str, store_path: str, ckpt: str) -> None:
    pm, optimizer, loader = _setup(plan, store_path, init=False, seed=2)
    pm.load_checkpoint(ckpt, optimizer, data=loader)


def _loader_for(plan: str, store_path: str, seq_len: int) -> None:
    pm = meshkit.parallelize(SPEC.build(device="meta"), meshkit.Plan.from_string(plan))
    pm.dataloader(TokenStore(store_path), seq_len=seq_len, global_batch=4)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, SPEC.vocab, n - 1), 0) for n in rng.integers(3, 30, 14)]
    path = tmp_path_factory.mktemp("store")
    write_store(path, docs, eos_id=0, vocab_size=SPEC.vocab)
    return str(path)


@pytest.fixture(scope="module")
def saved(dist, store_path, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt") / "step-3")
    return ckpt, dist(4).run(_save_and_continue, "dp_shard=4", store_path, ckpt)


@pytest.mark.parametrize(("plan", "world"), [("tp=2,dp_shard=2", 4), ("pp=2,dp_shard=2", 4)], ids=["dp4-to-tp2dp2", "dp4-to-pp2dp2"])
def test_resume_across_dp_sizes_sees_the_same_rows(dist, store_path, saved, plan, world):
    ckpt, before = saved
    after = dist(world).run(_resume, plan, store_path, ckpt)
    rows = TokenStore(store_path).split_info("train").tokens / SEQ
    assert (SAVED + AFTER) * GLOBAL_BATCH > rows, "the run should cross an epoch boundary"
    for rank, result in enumerate(after):
        assert result["step"] == SAVED and result["loader"]["sample"] == SAVED * GLOBAL_BATCH
        assert result["losses"] == pytest.approx(before[0]["losses"], abs=TOL), f"rank {rank}"
    uninterrupted, resumed = before[0]["state"], after[0]["state"]
    assert max((uninterrupted[k] - resumed[k]).abs().max().item() for k in uninterrupted) <= TOL


def test_a_loader_with_another_order_is_refused_on_every_rank(dist, store_path, saved):
    ckpt, _ = saved
    outcomes = dist(2).run_raw(_resume_with_other_seed, "dp_shard=2", store_path, ckpt)
    for outcome in outcomes:
        assert outcome.exc_type == "ValueError", outcome.traceback or outcome.message
        assert "data loader seed: saved 1, this loader 2" in outcome.message


def test_dataloader_refuses_what_the_model_cannot_take(dist, store_path, tmp_path):
    big = tmp_path / "big"
    write_store(big, [np.array([5, 100, 0])], eos_id=0, vocab_size=128)
    cases = [(store_path, 300, "seq_len=300 is above the model's max_position_embeddings=256"),
             (str(big), 8, "has a vocabulary of 128 tokens, the model's embedding 64 rows; fix: a store made with "
                          "the model's own tokenizer (prepare --tokenizer <model dir>), or, for a model trained from "
                          "scratch, a config with vocab_size >= 128")]
    for path, seq_len, message in cases:
        outcomes = dist(2).run_raw(_loader_for, "dp_shard=2", path, seq_len)
        assert all(o.exc_type == "ValueError" and message in o.message for o in outcomes), outcomes[0].message
