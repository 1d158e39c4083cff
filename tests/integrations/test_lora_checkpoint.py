"""LoRA training checkpoints: a DCP checkpoint resumes under another plan, and an adapter-only one (the
trainable tensors and their optimizer state, no base weights) resumes on top of the base model's files.
Either resume's next step equals the uninterrupted run's. Frozen base weights never get optimizer state."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import meshkit
from meshkit.state import checkpoint
from meshkit.testing.reference import BatchSpec, LoraSpec, ModelSpec

TOL = 1e-5
SPEC = ModelSpec(lora=LoraSpec(targets=("q_proj", "k_proj", "o_proj", "gate_proj", "down_proj")))
BASE = ModelSpec()
BATCH = BatchSpec(batch=4, seq=8)


def _setup(plan: str):
    pm = meshkit.parallelize(SPEC.build(device="meta"), meshkit.Plan.from_string(plan))
    optimizer = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2, eps=1e-3)
    return pm, optimizer


def _step(pm, optimizer, step: int) -> float:
    ids, labels = BATCH.make(SPEC.vocab, step)
    per = BATCH.batch // pm.dp_size
    rows = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
    loss = pm.forward_backward(ids[rows], labels[rows])
    pm.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _train_save_continue(plan: str, path: str, adapter_only: bool):
    pm, optimizer = _setup(plan)
    pm.load_full_state_dict(SPEC.build().state_dict())
    for step in range(2):
        _step(pm, optimizer, step)
    checkpoint.save(path, pm, optimizer, step=2, adapter_only=adapter_only)
    frozen_state = [n for n, p in pm.named_parameters() if not p.requires_grad and optimizer.state.get(p)]
    loss = _step(pm, optimizer, 2)
    state = pm.full_state_dict()
    return {"loss": loss, "state": state if torch.distributed.get_rank() == 0 else None, "frozen_state": frozen_state}


def _resume_and_step(plan: str, path: str, base_dir: str | None):
    pm, optimizer = _setup(plan)
    if base_dir is not None:
        pm.load_hf_checkpoint(base_dir)
    info = checkpoint.load(path, pm, optimizer)
    loss = _step(pm, optimizer, info["step"])
    state = pm.full_state_dict()
    return {"loss": loss, "state": state if torch.distributed.get_rank() == 0 else None}


@pytest.mark.parametrize("adapter_only", [False, True], ids=["full", "adapter-only"])
def test_lora_checkpoint_resumes_under_another_plan(dist, tmp_path, adapter_only):
    path = str(tmp_path / "ckpt")
    saved = dist(4).run(_train_save_continue, "tp=2,dp_shard=2", path, adapter_only)
    assert not saved[0]["frozen_state"], "frozen base weights got optimizer state"
    keys = [k for k in FileSystemReader(path).read_metadata().state_dict_metadata if k.startswith("model.")]
    adapters = [k for k in keys if ".lora_" in k]
    assert adapters and (keys == adapters) == adapter_only, keys
    base_dir = None
    if adapter_only:
        base_dir = str(tmp_path / "base")
        BASE.build().save_pretrained(base_dir)
    resumed = dist(4).run(_resume_and_step, "pp=2,dp_shard=2", path, base_dir)
    want = saved[0]["state"]
    for r in resumed:
        assert abs(r["loss"] - saved[0]["loss"]) < TOL
    got = resumed[0]["state"]
    assert got.keys() == want.keys()
    assert max((got[k] - want[k]).abs().max().item() for k in want) < TOL


def _adapter_only_on_meta(path: str) -> None:
    pm, optimizer = _setup("dp_shard=2")
    checkpoint.load(path, pm, optimizer)


def test_adapter_only_checkpoint_needs_the_base_first(dist, tmp_path):
    path = str(tmp_path / "ckpt")
    dist(4).run(_train_save_continue, "tp=2,dp_shard=2", path, True)
    for o in dist(2).run_raw(_adapter_only_on_meta, path):
        assert o.exc_type == "ValueError" and "load_hf_checkpoint(base_dir)" in o.message, o.traceback or o.message
