"""Pipeline parallelism through `parallelize`: every schedule, alone and with dp_shard / tp / cp / AC,
gives the single-device loss, gradients and parameters after two steps; PP and non-PP agree."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tests_support import assert_matches_reference, examples

import meshkit
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec, meta_init: bool = False):
    return dataclasses.asdict(compare_training(plan, model, batch, meta_init=meta_init))


def _plan(pp: int, schedule: str, v: int, m: int, extra: str = "") -> str:
    return f"pp={pp},pp_schedule={schedule},pp_virtual_stages={v},pp_microbatches={m}" + (f",{extra}" if extra else "")


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule, v", SCHEDULES)
def test_every_schedule_alone(dist, pp, schedule, v):
    m = 2 * pp
    model = ModelSpec(layers=pp * v)
    results = dist(pp).run(_compare_on_rank, _plan(pp, schedule, v, m), model, BatchSpec(batch=m, seq=8))
    assert_matches_reference(results, f"pp={pp} {schedule}")


@st.composite
def composed(draw):
    schedule, v = draw(st.sampled_from(SCHEDULES))
    other = draw(st.sampled_from(["dp_shard=2", "tp=2", "cp=2", "dp_shard=2,tp=2", "cp=2,tp=2,activation_checkpointing=full",
                                  "dp_replicate=2,activation_checkpointing=selective"]))
    pp = 2
    degrees = meshkit.Plan.from_string(other)
    world = pp * degrees.dp_shard * degrees.dp_replicate * degrees.tp * degrees.cp
    dp = degrees.dp_shard * degrees.dp_replicate
    m = draw(st.sampled_from([2, 4]))
    model = ModelSpec(kind=draw(st.sampled_from(["llama", "qwen3"])), layers=pp * v + draw(st.sampled_from([0, 1])),
                      heads=4, kv_heads=2, head_dim=8, intermediate=32, vocab=64, seed=draw(st.integers(0, 99)))
    batch = BatchSpec(batch=dp * m, seq=8, ignore=0.3, seed=draw(st.integers(0, 99)),
                      documents=draw(st.sampled_from([1, 2])))
    return world, _plan(pp, schedule, v, m, other), model, batch


@examples(ci=2)
@given(composed())
def test_pipeline_composed_with_other_axes(dist, case):
    world, plan, model, batch = case
    results = dist(world).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, f"{plan} on {model} with {batch}")


def test_pp_dp_tp_on_eight_ranks(dist):
    plan = _plan(2, "zb_h1", 1, 4, "dp_shard=2,tp=2")
    model = ModelSpec(layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=32, vocab=64)
    results = dist(8).run(_compare_on_rank, plan, model, BatchSpec(batch=8, seq=8, documents=2))
    assert_matches_reference(results, plan)


def test_meta_device_model_under_pipelining(dist):
    plan = _plan(2, "1f1b", 1, 2, "dp_shard=2")
    results = dist(4).run(_compare_on_rank, plan, ModelSpec(layers=3), BatchSpec(batch=4, seq=8), meta_init=True)
    assert_matches_reference(results, "meta init under pp")


def _grads_of(plan: str) -> dict:
    from torch.distributed.tensor import DTensor

    spec = ModelSpec(layers=4)
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    ids, labels = BatchSpec(batch=4, seq=8, ignore=0.3).make(spec.vocab)
    pm.forward_backward(ids, labels)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in pm.named_parameters()}
    return {n: g.clone() for n, g in grads.items()}


def test_pp_and_non_pp_gradients_are_identical(dist):
    plain = dist(2).run(_grads_of, "tp=2")[0]
    for schedule, v in SCHEDULES:
        merged = {}
        for rank_grads in dist(2).run(_grads_of, _plan(2, schedule, v, 4)):
            merged.update(rank_grads)
        assert merged.keys() == plain.keys(), schedule
        worst = max((merged[n] - plain[n]).abs().max().item() for n in plain)
        assert worst < 1e-6, f"{schedule}: pp=2 and pp=1 gradients differ by {worst}"


@pytest.mark.parametrize(
    "plan, world",
    [
        (_plan(2, "1f1b", 1, 2), 2),
        (_plan(2, "zb_h1", 1, 2, "dp_shard=2"), 4),
        (_plan(2, "interleaved_1f1b", 2, 2, "tp=2"), 4),
        (_plan(4, "1f1b", 1, 4), 4),  # first and last stage two ranks apart: a group of their own
        (_plan(2, "gpipe", 1, 2, "dp_replicate=2,activation_checkpointing=full"), 4),
    ],
)
def test_tied_embeddings_under_pipelining(dist, plan, world):
    """The embedding (first stage) and the head (last stage) hold copies of one weight: summed
    gradients, one norm, equal updates: the single-device model's numbers."""
    degrees = meshkit.Plan.from_string(plan)
    model = ModelSpec(tied=True, layers=4)
    batch = BatchSpec(batch=degrees.microbatches * degrees.dp_shard * degrees.dp_replicate, seq=8, ignore=0.2)
    results = dist(world).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, f"tied, {plan}")


def _tied_copies_equal_after_steps(plan: str) -> float:
    spec = ModelSpec(tied=True, layers=4)
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for step in range(3):
        ids, labels = BatchSpec(batch=4, seq=8, seed=step).make(spec.vocab)
        rows = slice(pm.dp_rank * 4 // pm.dp_size, (pm.dp_rank + 1) * 4 // pm.dp_size)
        for half in (slice(0, 2), slice(2, 4)):  # two accumulated calls per step
            pm.forward_backward(ids[rows][half], labels[rows][half], loss_denominator=4 * 7 * 2)
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    state = pm.full_state_dict()
    return (state["model.embed_tokens.weight"] - state["lm_head.weight"]).abs().max().item()


def test_tied_copies_stay_identical(dist):
    for diff in dist(4).run(_tied_copies_equal_after_steps, _plan(4, "zb_h1", 1, 2)):
        assert diff == 0.0


def _odd_batch() -> None:
    pm = meshkit.parallelize(ModelSpec(layers=2).build(), meshkit.Plan(pp=2, pp_microbatches=4))
    ids, labels = BatchSpec(batch=6, seq=8).make(64)
    pm.forward_backward(ids, labels)


def test_a_batch_that_does_not_split_into_microbatches(dist):
    for o in dist(2).run_raw(_odd_batch, timeout=30):
        assert isinstance(o.value, ValueError) and "pp_microbatches=4" in o.message, o


# ZB-H2 and the V schedules through `parallelize`, one composition each (the runtime tests cover the
# schedules' numerics at more depths). Under the V placement the last stage, and so the tied LM-head
# copy, lives on pp rank 0 beside the embedding: the two copies' gradients are summed locally.
MOE = ModelSpec(layers=4, experts=4, top_k=2, intermediate=16)


@pytest.mark.parametrize(
    "plan, world, model",
    [
        (_plan(2, "zb_v", 1, 4), 2, ModelSpec(tied=True, layers=4)),
        (_plan(4, "zb_v", 1, 8), 4, ModelSpec(tied=True, layers=6)),
        (_plan(2, "zb_v", 1, 4, "dp_shard=2,activation_checkpointing=full"), 4, ModelSpec(tied=True, layers=4)),
        (_plan(2, "dualpipe_v", 1, 4, "tp=2"), 4, ModelSpec(tied=True, layers=4, kind="qwen3")),
        (_plan(2, "dualpipe_v", 1, 4, "cp=2,activation_checkpointing=selective"), 4, ModelSpec(layers=4)),
        (_plan(2, "zb_h2", 1, 4, "dp_shard=2,tp=2"), 8, ModelSpec(tied=True, layers=3)),
        (_plan(2, "zb_v", 1, 4, "dp_shard=2,ep=2"), 4, MOE),
    ],
)
def test_zero_bubble_schedules_through_parallelize(dist, plan, world, model):
    degrees = meshkit.Plan.from_string(plan)
    batch = BatchSpec(batch=degrees.microbatches * degrees.dp_shard * degrees.dp_replicate, seq=8, ignore=0.2,
                      documents=2)
    results = dist(world).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, f"{plan} on {model}")


def test_tied_copies_stay_identical_under_the_v(dist):
    for diff in dist(2).run(_tied_copies_equal_after_steps, _plan(2, "zb_v", 1, 2)):
        assert diff == 0.0
