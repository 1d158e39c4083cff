"""The optimizer fused into backward against the single-device model with its optimizer unfused (SGD and
AdamW under fsdp, tp, pp and their compositions), no gradient surviving a call, clipping and the
optimizers and inputs it refuses."""

from __future__ import annotations

import functools

import pytest
import torch

import meshkit
from meshkit.testing.reference import ADAM_EPS, BatchSpec, ModelSpec
from tests.tests_support import LOSS_TOL, PARAM_TOL

OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-3, eps=ADAM_EPS),
    "sgd": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
}


def fused_training(plan: str, optimizer: str, steps: int = 2) -> dict:
    spec = ModelSpec()
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


@pytest.mark.parametrize("plan, optimizer", [
    ("dp_shard=2", "adamw"),
    ("tp=2", "sgd"),
    ("pp=2", "adamw"),
    ("pp=2,dp_shard=2", "sgd"),
    ("tp=2,dp_shard=2,zero=2", "adamw"),
    ("dp_shard=2,zero=1", "sgd"),
])
def test_fused_step_matches_the_unfused_single_device_step(dist, plan, optimizer):
    world = meshkit.Plan.from_string(plan).world_size
    for rank, r in enumerate(dist(world).run(fused_training, plan, optimizer)):
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


def tied_pipeline() -> str:
    pm = meshkit.parallelize(ModelSpec(layers=3, tied=True).build(), meshkit.Plan.from_string("pp=2"))
    try:
        meshkit.fuse_optimizer_into_backward(pm, lambda ps: torch.optim.SGD(ps, lr=0.1))
    except ValueError as e:
        return str(e)
    return "accepted"


def test_fused_refuses_gradients_summed_after_backward(dist):
    for message in dist(2).run(tied_pipeline):
        assert "sums after backward" in message
