"""The optimizer fused into backward against the single-device model with its optimizer unfused (SGD and
AdamW under fsdp, tp, pp and their compositions), no gradient surviving a call, clipping and the
optimizers and inputs it refuses."""

from __future__ import annotations

import functools

import pytest
import torch

import meshkit
from meshkit.data_parallel.fused import FusedOptimizer
from meshkit.testing.reference import ADAM_EPS, BatchSpec, ModelSpec
from tests.tests_support import LOSS_TOL, PARAM_TOL

OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-3, eps=ADAM_EPS),
    "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
}


SPECS = {
    "dense": ModelSpec(),
    # a meshkit MoE in every block: experts are their own FSDP unit, sharded over the ep ranks
    "moe": ModelSpec(layers=2, intermediate=16, experts=4, top_k=2),
}


def fused_training(plan: str, optimizer: str, steps: int = 2, model: str = "dense") -> dict:
    spec = SPECS[model]
    ref = spec.build()
    ref_opt = OPTIMIZERS[optimizer](ref.parameters())
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    fused = meshkit.fuse_optimizer_into_backward(pm, OPTIMIZERS[optimizer])
    out = {"loss": 0.0, "param": 0.0, "grads_left": 0, "steps": 0, "params": len(list(pm.parameters()))}
    for step in range(steps):
        ids, labels = BatchSpec(batch=4, seq=8, seed=step).make(spec.vocab)
        ref_loss = ref(input_ids=ids, labels=labels).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        per = 4 // pm.dp_size
        mine = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
        loss = pm.forward_backward(ids[mine], labels[mine])
        out["loss"] = max(out["loss"], abs(loss.item() - ref_loss.item()))
        out["grads_left"] += sum(p.grad is not None for p in pm.parameters())
    out["steps"] = fused.steps
    state = pm.full_state_dict()
    out["param"] = max((state[n].float() - p).abs().max().item() for n, p in ref.state_dict().items())
    return out


@pytest.mark.parametrize("plan, optimizer, model", [
    ("dp_shard=2", "adamw", "dense"),
    ("tp=2", "sgd", "dense"),
    ("pp=2", "adamw", "dense"),
    ("pp=2,dp_shard=2", "sgd", "dense"),
    ("tp=2,dp_shard=2,zero=2", "adamw", "dense"),
    ("dp_shard=2,zero=1", "sgd", "dense"),
    # cp folds into FSDP's dp_shard_cp axis; HSDP all-reduces the reduced shards across replicas
    # before the step; ep shards the experts (their own FSDP unit) over dp_shard
    ("dp_shard=2,cp=2", "adamw", "dense"),
    ("dp_replicate=2,dp_shard=2,zero=2", "adamw", "dense"),
    ("dp_shard=2,ep=2", "adamw", "moe"),
])
def test_fused_step_matches_the_unfused_single_device_step(dist, plan, optimizer, model):
    world = meshkit.Plan.from_string(plan).world_size
    for rank, r in enumerate(dist(world).run(fused_training, plan, optimizer, model=model)):
        where = f"{plan} {optimizer}, rank {rank}"
        assert r["loss"] <= LOSS_TOL, f"{where}: loss differs by {r['loss']:.3g}"
        assert r["param"] <= PARAM_TOL, f"{where}: parameters differ by {r['param']:.3g}"
        assert r["grads_left"] == 0, f"{where}: {r['grads_left']} gradients survived a call"
        assert r["steps"] == 2 * r["params"], f"{where}: {r['steps']} updates for {r['params']} parameters x 2 steps"


def fused_refusals() -> list[str]:
    spec = ModelSpec()
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string("dp_shard=2"))
    messages = []
    try:
        meshkit.fuse_optimizer_into_backward(pm, lambda ps: torch.optim.LBFGS(ps))
    except ValueError as e:
        messages.append(str(e))
    meshkit.fuse_optimizer_into_backward(pm, lambda ps: torch.optim.SGD(ps, lr=0.1))
    ids, labels = BatchSpec(batch=2, seq=8).make(spec.vocab)
    for call in (lambda: pm.forward_backward(ids, labels, last_microbatch=False),
                 lambda: (pm.forward_backward(ids, labels), pm.clip_grad_norm_(1.0))):
        try:
            call()
        except ValueError as e:
            messages.append(str(e))
    return messages


def test_fused_refuses_lbfgs_windows_and_clipping_before_any_update(dist):
    for lbfgs, window, clip in dist(2).run(fused_refusals):
        assert "LBFGS needs the whole gradient" in lbfgs
        assert "last_microbatch=False" in window
        assert "does not clip" in clip


def fused_refusal(plan: str, spec: ModelSpec) -> str:
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    try:
        meshkit.fuse_optimizer_into_backward(pm, lambda ps: torch.optim.SGD(ps, lr=0.1))
    except ValueError as e:
        return str(e)
    return "accepted"


@pytest.mark.parametrize("plan, spec, words", [
    ("pp=2", ModelSpec(layers=3, tied=True), "sums after backward"),  # a tied embedding split by pipelining
    ("dp_replicate=2", ModelSpec(), "dp_replicate=2"),  # DDP's buckets keep every gradient: nothing to free
])
def test_fused_refuses_gradients_summed_after_backward_or_kept(dist, plan, spec, words):
    for message in dist(2).run(fused_refusal, plan, spec):
        assert words in message and "fix:" in message


# ------------------------------------------------------------------------------------- checkpoints


def _fused_model(plan: str) -> tuple[meshkit.ParallelModel, FusedOptimizer]:
    pm = meshkit.parallelize(ModelSpec().build(), meshkit.Plan.from_string(plan))
    return pm, meshkit.fuse_optimizer_into_backward(pm, OPTIMIZERS["adamw"])


def _train(pm: meshkit.ParallelModel, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids, labels = BatchSpec(batch=4, seq=8, seed=step).make(ModelSpec().vocab)
        per = 4 // pm.dp_size
        mine = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
        losses.append(pm.forward_backward(ids[mine], labels[mine]).item())
    return losses


def fused_resume(root: str, plan: str, other: str) -> dict:
    """Train 2 fused AdamW steps, save, train 2 more; then from the checkpoint, under `plan` and under
    `other` (resharded), the same 2 steps: the losses and final parameters of each resumed run against
    the uninterrupted one."""
    pm, fused = _fused_model(plan)
    _train(pm, range(2))
    path = meshkit.state.checkpoint.save(f"{root}/step-2", pm, fused, step=2)
    straight = _train(pm, range(2, 4))
    final = pm.full_state_dict()
    out = {}
    for resume in (plan, other):
        pm, fused = _fused_model(resume)
        info = meshkit.state.checkpoint.load(path, pm, fused)
        losses = _train(pm, range(2, 4))
        state = pm.full_state_dict()
        out[resume] = {"step": info["step"], "loss": max(abs(a - b) for a, b in zip(losses, straight)),
                       "param": max((state[n] - t).abs().max().item() for n, t in final.items())}
    return out


def test_fused_optimizer_state_checkpoints_and_resumes_identically(dist, tmp_path):
    """The per-parameter AdamW moments go through DCP: resuming under the saving plan continues
    bit-identically, and under another plan (the moments resharded) within fp32 tolerance. A resume
    without the moments would restart AdamW's bias correction and miss both."""
    plan, other = "dp_shard=2", "tp=2"
    for rank, r in enumerate(dist(2).run(fused_resume, str(tmp_path), plan, other)):
        same, moved = r[plan], r[other]
        assert same["step"] == moved["step"] == 2
        assert same["loss"] == 0.0 and same["param"] == 0.0, f"rank {rank}: resumed run differs: {same}"
        assert moved["loss"] <= LOSS_TOL and moved["param"] <= PARAM_TOL, f"rank {rank}, resumed as {other}: {moved}"
