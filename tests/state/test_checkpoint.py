"""Training checkpoints resume exactly, and move between plans and world sizes.

Each saving run trains a tiny model two AdamW steps (warmup scheduler, gradient clipping) under plan
A, saves, then takes a third step: that step is the uninterrupted run. A resuming run builds the
model on the meta device under plan B (any world size), loads, and takes the third step. Under the
same plan the loss and every parameter must be bit-identical; under another plan they must agree
within fp32 tolerance (the plans differ in reduction order only).
"""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

import meshkit
from meshkit.state import checkpoint
from meshkit.testing.reference import BatchSpec, ModelSpec

TOL = 1e-5
SAVED_STEPS = 2
DENSE = ModelSpec()
MOE = ModelSpec(experts=4, bias_update_rate=0.01)  # DeepSeek-V3 balancing: expert_bias buffers travel too
TIED = ModelSpec(tied=True)  # under pp the head holds a copy saved under the embedding's name
MOE_2 = ModelSpec(experts=2)  # under dp_shard=4,ep=2 FSDP splits each expert's rows (Shard(1))
BATCH = BatchSpec(batch=4, seq=8)


def _setup(plan: str, spec: ModelSpec, init_seed: int, materialise_first: bool = False):
    model = spec.build(device="meta")
    pm = meshkit.parallelize(model, meshkit.Plan.from_string(plan))
    if materialise_first:  # the recipe's order on resume: real tensors before the optimizer is built
        pm.materialise()
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    if init_seed >= 0:
        pm.init_weights(init_seed)
    return pm, optimizer, scheduler


def _step(pm, optimizer, scheduler, spec: ModelSpec, step: int) -> float:
    ids, labels = BATCH.make(spec.vocab, step)
    rows = BATCH.batch // pm.dp_size
    mine = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
    loss = pm.forward_backward(ids[mine], labels[mine])
    pm.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()
    pm.update_expert_biases()
    scheduler.step()
    return loss.item()


def _rng_digest() -> str:
    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()


def _train_save_continue(plan: str, spec: ModelSpec, path: str):
    """Plan A: two steps, save, a third step (the uninterrupted run). Rank 0 returns the full state."""
    pm, optimizer, scheduler = _setup(plan, spec, init_seed=0)
    for step in range(SAVED_STEPS):
        _step(pm, optimizer, scheduler, spec, step)
    torch.manual_seed(1234 + torch.distributed.get_rank())  # a per-rank generator state worth restoring
    checkpoint.save(path, pm, optimizer, scheduler=scheduler, step=SAVED_STEPS, extra={"next": SAVED_STEPS})
    digest = _rng_digest()
    loss = _step(pm, optimizer, scheduler, spec, SAVED_STEPS)
    state = pm.full_state_dict()
    return {"loss": loss, "digest": digest, "state": state if torch.distributed.get_rank() == 0 else None}


def _resume_and_step(plan: str, spec: ModelSpec, path: str, materialise_first: bool = False):
    """Plan B: meta model, load (optimizer built on the meta parameters unless `materialise_first`), one step."""
    pm, optimizer, scheduler = _setup(plan, spec, init_seed=-1, materialise_first=materialise_first)
    torch.manual_seed(99)
    info = checkpoint.load(path, pm, optimizer, scheduler=scheduler)
    digest = _rng_digest()
    lr = optimizer.param_groups[0]["lr"]
    loss = _step(pm, optimizer, scheduler, spec, info["step"])
    state = pm.full_state_dict()
    return {"info": info, "digest": digest, "lr": lr, "loss": loss,
            "state": state if torch.distributed.get_rank() == 0 else None}


def _load_only(plan: str, spec: ModelSpec, path: str) -> None:
    pm, optimizer, scheduler = _setup(plan, spec, init_seed=-1)
    checkpoint.load(path, pm, optimizer, scheduler=scheduler)


@pytest.fixture(scope="module")
def saved(dist, tmp_path_factory):
    """`saved(plan, world, spec)`: the saving run's checkpoint path and results, computed once."""
    cache: dict = {}

    def get(plan: str, world: int, spec: ModelSpec):
        key = (plan, world, repr(spec))
        if key not in cache:
            path = str(tmp_path_factory.mktemp("ckpt"))
            results = dist(world).run(_train_save_continue, plan, spec, path)
            cache[key] = path, results
        return cache[key]

    return get


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize(
    ("plan", "world", "spec", "materialise_first"),
    [("tp=2,dp_shard=2", 4, DENSE, False), ("pp=2,dp_shard=2", 4, DENSE, False), ("dp_shard=4,ep=2", 4, MOE, False),
     ("pp=2,tp=2", 4, TIED, False),
     # Without FSDP the plain (non-DTensor) parameters the optimizer was built on must survive materialisation.
     ("pp=2", 2, DENSE, False), ("pp=2", 2, TIED, True), ("pp=2,tp=2,sequence_parallel=false", 4, DENSE, False),
     ("pp=2,dp_shard=2,zero=1", 4, DENSE, False), ("pp=2,dp_shard=2,zero=2", 4, DENSE, True)],
    ids=["tp2dp2", "pp2dp2", "moe-dp4ep2", "tied-pp2tp2", "pp2-on-2-ranks", "tied-pp2-materialised-first",
         "pp2tp2-no-sp", "pp2dp2-zero1", "pp2dp2-zero2-materialised-first"],
)
def test_resume_same_plan_is_bit_identical(dist, saved, plan, world, spec, materialise_first):
    path, before = saved(plan, world, spec)
    after = dist(world).run(_resume_and_step, plan, spec, path, materialise_first)
    for rank in range(world):
        assert after[rank]["info"] == {"step": SAVED_STEPS, "extra": {"next": SAVED_STEPS}, "rng_restored": True}
        assert after[rank]["digest"] == before[rank]["digest"], f"rank {rank}: RNG state not restored"
        assert after[rank]["loss"] == before[rank]["loss"], f"rank {rank}: next-step loss differs"
    uninterrupted, resumed = before[0]["state"], after[0]["state"]
    assert uninterrupted.keys() == resumed.keys()
    for name in uninterrupted:
        assert torch.equal(uninterrupted[name], resumed[name]), f"{name} differs after the resumed step"


@pytest.mark.parametrize(
    ("saved_plan", "saved_world", "resumed_plan", "resumed_world", "spec"),
    [
        ("tp=2,dp_shard=2", 4, "pp=2,cp=2", 4, DENSE),
        ("tp=2,dp_shard=2", 4, "dp_shard=2", 2, DENSE),
        ("pp=2,dp_shard=2", 4, "tp=2,dp_replicate=2", 4, DENSE),
        ("dp_shard=4,ep=2", 4, "dp_shard=2,tp=2,ep=2", 4, MOE),
        ("dp_shard=4,ep=2", 4, "dp_shard=2,ep=2", 2, MOE_2),
        ("pp=2,dp_shard=2", 4, "dp_shard=2", 2, TIED),
        ("tp=2,dp_shard=2", 4, "pp=2,dp_shard=2", 4, TIED),
        # DualPipe's mirror pair saves one copy of each shard (DCP deduplicates) and loads both copies.
        ("pp=2,dp_shard=2,pp_schedule=dualpipe,pp_microbatches=2", 4, "dp_shard=2", 2, TIED),
        ("dp_shard=4,ep=2", 4, "pp=2,dp_shard=2,pp_schedule=dualpipe,pp_microbatches=2", 4, MOE),
        # DDP (a plan that only replicates) saves plain tensors every rank holds whole, and loads shards
        ("dp_replicate=2", 2, "tp=2,dp_shard=2", 4, DENSE),
        ("tp=2,dp_shard=2", 4, "dp_replicate=4", 4, TIED),
    ],
    ids=["tp2dp2-to-pp2cp2", "tp2dp2-to-dp2-on-2-ranks", "pp2dp2-to-tp2hsdp2", "moe-dp4ep2-to-dp2tp2ep2",
         "moe-expert-rows-to-whole-experts", "tied-pp2dp2-to-dp2", "tied-tp2dp2-to-pp2dp2",
         "tied-dualpipe-to-dp2", "moe-dp4ep2-to-dualpipe", "ddp2-to-tp2dp2", "tied-tp2dp2-to-ddp4"],
)
def test_resume_under_another_plan(dist, saved, saved_plan, saved_world, resumed_plan, resumed_world, spec):
    path, before = saved(saved_plan, saved_world, spec)
    after = dist(resumed_world).run(_resume_and_step, resumed_plan, spec, path)
    for rank, result in enumerate(after):
        assert result["info"]["step"] == SAVED_STEPS and result["info"]["extra"] == {"next": SAVED_STEPS}
        assert result["info"]["rng_restored"] is False  # another layout: generator states are not meaningful
        assert result["lr"] == pytest.approx(min(1.0, (SAVED_STEPS + 1) / 4) * 1e-3, rel=1e-12)
        assert abs(result["loss"] - before[0]["loss"]) <= TOL, f"rank {rank}: {result['loss']} vs {before[0]['loss']}"
    assert _max_diff(after[0]["state"], before[0]["state"]) <= TOL


def test_mismatched_checkpoint_raises_on_every_rank(dist, saved):
    path, _ = saved("tp=2,dp_shard=2", 4, DENSE)
    other = ModelSpec(layers=3, intermediate=32)
    outcomes = dist(2).run_raw(_load_only, "dp_shard=2", other, path)
    for outcome in outcomes:
        assert outcome.exc_type == "ValueError", outcome.traceback or outcome.message
        assert "9 model tensor(s) missing from the checkpoint: model.layers.2.input_layernorm.weight" in outcome.message
        assert "model.layers.0.mlp.gate_proj.weight: checkpoint (48, 32), model (32, 32)" in outcome.message


def test_not_a_checkpoint_raises(dist, tmp_path):
    outcomes = dist(2).run_raw(_load_only, "dp_shard=2", DENSE, str(tmp_path / "nothing"))
    assert all(o.exc_type == "ValueError" and "no meshkit checkpoint" in o.message for o in outcomes)


def test_latest_skips_unfinished_checkpoints(saved, tmp_path):
    path, _ = saved("tp=2,dp_shard=2", 4, DENSE)
    assert checkpoint.latest(tmp_path) is None
    shutil.copytree(path, checkpoint.step_dir(tmp_path, 2))
    shutil.copytree(path, checkpoint.step_dir(tmp_path, 4))
    (tmp_path / "step-00000004" / ".metadata").unlink()  # a save interrupted before DCP's last write
    (tmp_path / "step-00000006").mkdir()
    assert checkpoint.latest(tmp_path) == checkpoint.step_dir(tmp_path, 2)
    assert checkpoint.latest(path) == path
