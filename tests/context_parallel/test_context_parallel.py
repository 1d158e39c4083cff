"""Context parallelism on full HF models: every attention kind, alone and with tp / dp_shard / AC,
packed documents included, gives the single-device loss, gradients and parameters after two steps."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests_support import assert_matches_reference, examples

import meshkit
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

KINDS = ["ring", "zigzag", "allgather", "ulysses", "usp", "allgather_usp"]


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec):
    return dataclasses.asdict(compare_training(plan, model, batch))


def _plan(world: int, cp: int, tp: int, kind: str, ac: str) -> str:
    """"allgather_usp" is the all-gather kind's 2D variant: Ulysses over 2 ranks inside."""
    ulysses = ",cp_ulysses=2" if kind in ("usp", "allgather_usp") else ""
    return (f"cp={cp},tp={tp},dp_shard={world // (cp * tp)},cp_attention={kind.removesuffix('_usp')}{ulysses},"
            f"activation_checkpointing={ac}")


@st.composite
def cp_cases(draw):
    kind = draw(st.sampled_from(KINDS))
    cp = 4 if kind.endswith("usp") else draw(st.sampled_from([2, 4]))
    world = draw(st.sampled_from([w for w in (4, 8) if w % cp == 0]))
    tp = draw(st.sampled_from([t for t in (1, 2) if world % (cp * t) == 0]))
    plan = _plan(world, cp, tp, kind, draw(st.sampled_from(["none", "full"])))
    degree = meshkit.Plan.from_string(plan).ulysses_degree
    kv = tp * draw(st.sampled_from([1, 2]))
    heads_per_tp = degree * draw(st.sampled_from([1, 2]))
    model = ModelSpec(kind=draw(st.sampled_from(["llama", "qwen3"])), layers=draw(st.sampled_from([1, 2])),
                      heads=tp * max(heads_per_tp, kv // tp), kv_heads=kv, head_dim=8, intermediate=tp * 8,
                      vocab=tp * 16, tied=draw(st.booleans()), seed=draw(st.integers(0, 99)))
    multiple = meshkit.Plan.from_string(plan).seq_multiple()
    seq = multiple * draw(st.sampled_from([1, 2, 3]))
    dp = world // (cp * tp)
    batch = BatchSpec(batch=dp * draw(st.sampled_from([1, 2])), seq=max(seq, 2 * multiple), ignore=0.3,
                      seed=draw(st.integers(0, 99)), documents=draw(st.sampled_from([1, 3])))
    return world, plan, model, batch


@examples(ci=3)
@given(cp_cases())
def test_random_context_parallel_plans_match_single_device(dist, case):
    world, plan, model, batch = case
    results = dist(world).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, f"{plan} on {model} with {batch}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("other", ["alone", "tp", "dp_shard"])
def test_each_kind_alone_and_composed(dist, kind, other):
    cp = 4 if kind.endswith("usp") else 2
    tp = 2 if other == "tp" else 1
    world = cp * (1 if other == "alone" else 2)
    plan = _plan(world, cp, tp, kind, "none")
    model = ModelSpec(heads=4, kv_heads=2, head_dim=8, intermediate=32, vocab=64)
    batch = BatchSpec(batch=world // (cp * tp), seq=16, documents=2)
    results = dist(world).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, plan)


def test_allgather_with_pipeline_experts_tensor_and_fsdp(dist):
    """The all-gather kind inside the full composition: pp x cp x tp on 8 ranks, MoE experts over ep
    (folded into cp), FSDP over the cp ranks, packed documents, full AC, bf16-free fp32 reference."""
    plan = ("pp=2,cp=2,tp=2,ep=2,pp_microbatches=2,cp_attention=allgather,activation_checkpointing=full")
    model = ModelSpec(kind="mixtral", layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=16, vocab=64,
                      experts=4, top_k=2)
    results = dist(8).run(_compare_on_rank, plan, model, BatchSpec(batch=2, seq=16, documents=3), timeout=300)
    assert_matches_reference(results, plan)


def test_packed_documents_without_context_parallelism(dist):
    results = dist(2).run(_compare_on_rank, "tp=2", ModelSpec(), BatchSpec(batch=2, seq=12, documents=3))
    assert_matches_reference(results, "packed, tp=2")
