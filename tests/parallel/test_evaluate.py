"""`ParallelModel.evaluate`: the single-device loss of the global batch under every axis (a pipeline
runs its training schedule's forwards alone), gradients untouched, and training unchanged by an
evaluation anywhere in the step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests_support import LOSS_TOL

import meshkit
from meshkit.testing.reference import BatchSpec, ModelSpec

DENSE = ModelSpec(layers=4)
MOE = ModelSpec(layers=2, intermediate=16, experts=4, top_k=2)
BATCH = BatchSpec(batch=8, seq=8, ignore=0.2)


def _rows(pm, batch: BatchSpec) -> slice:
    per = batch.batch // pm.dp_size
    return slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)


def _evaluate_on_rank(plan: str, spec: ModelSpec, batch: BatchSpec) -> dict:
    reference = spec.build()
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    ids, labels = batch.make(spec.vocab)
    with torch.no_grad():
        ref_loss = reference(input_ids=ids, labels=labels, use_cache=False).loss.item()
    pm.eval()
    first = pm.evaluate(ids[_rows(pm, batch)], labels[_rows(pm, batch)]).item()
    again = pm.evaluate(ids[_rows(pm, batch)], labels[_rows(pm, batch)]).item()
    pm.train()
    return {"loss": first, "again": again, "ref_loss": ref_loss,
            "grads": [n for n, p in pm.named_parameters() if p.grad is not None]}


@pytest.mark.parametrize(
    "plan, spec",
    [
        ("dp_shard=2,tp=2", DENSE),
        ("cp=2,dp_shard=2,cp_attention=zigzag", DENSE),
        ("pp=2,dp_shard=2", DENSE),
        ("pp=2,tp=2,pp_schedule=zb_h1,pp_microbatches=4", DENSE),
        ("pp=2,cp=2,pp_schedule=interleaved_1f1b,pp_virtual_stages=2", DENSE),
        ("pp=4,pp_schedule=gpipe,pp_microbatches=8", DENSE),
        ("pp=2,dp_shard=2,ep=2", MOE),
    ],
)
def test_evaluate_gives_the_single_device_loss(dist, plan, spec):
    for rank, r in enumerate(dist(4).run(_evaluate_on_rank, plan, spec, BATCH)):
        assert abs(r["loss"] - r["ref_loss"]) <= LOSS_TOL, f"{plan}, rank {rank}: {r['loss']} vs {r['ref_loss']}"
        assert r["again"] == r["loss"], f"{plan}, rank {rank}: a second evaluation differs"
        assert not r["grads"], f"{plan}, rank {rank}: evaluate left gradients on {r['grads'][:4]}"


def _losses(plan: str, spec: ModelSpec, batch: BatchSpec, evaluate: bool) -> list[float]:
    """Three steps; with `evaluate`, an evaluation after each backward (before the optimizer step)."""
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        ids, labels = batch.make(spec.vocab, step)
        rows = _rows(pm, batch)
        losses.append(pm.forward_backward(ids[rows], labels[rows]).item())
        if evaluate:
            held_out, held_labels = batch.make(spec.vocab, 100 + step)
            pm.evaluate(held_out[rows], held_labels[rows])
        opt.step()
        opt.zero_grad()
    return losses


def _with_and_without_evaluation(plan: str, spec: ModelSpec, batch: BatchSpec) -> tuple[list, list]:
    return _losses(plan, spec, batch, False), _losses(plan, spec, batch, True)


@pytest.mark.parametrize("plan", ["dp_shard=4", "pp=2,dp_shard=2", "dp_shard=2,tp=2,param_dtype=bfloat16"])
def test_evaluating_between_backward_and_step_leaves_training_unchanged(dist, plan):
    """An FSDP unit left gathered by a forward without backward would serve the pre-step weights to
    the next forward; evaluate reshards, so training is bit for bit the same with or without it."""
    spec = dataclasses.replace(DENSE, layers=2)
    for rank, (plain, evaluated) in enumerate(dist(4).run(_with_and_without_evaluation, plan, spec, BATCH)):
        assert evaluated == plain, f"{plan}, rank {rank}: {evaluated} vs {plain}"
