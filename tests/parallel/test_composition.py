"""All axes at once: random full plans on 8 ranks and the five-axis plan on 16 ranks, dense and MoE,
every schedule and CP kind, against the single-device model after two optimizer steps."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st
from tests_support import assert_matches_reference, examples

import meshkit
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec):
    return dataclasses.asdict(compare_training(plan, model, batch))


def test_five_axes_on_sixteen_ranks(dist):
    plan = ("pp=2,dp_shard=2,cp=2,tp=2,ep=2,pp_schedule=zb_h1,pp_microbatches=2,cp_attention=zigzag,"
            "activation_checkpointing=full")
    model = ModelSpec(kind="mixtral", layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=16, vocab=64,
                      experts=4, top_k=2)
    results = dist(16).run(_compare_on_rank, plan, model, BatchSpec(batch=4, seq=16, documents=2), timeout=600)
    assert_matches_reference(results, plan)


@st.composite
def full_plans(draw):
    """Degrees multiplying to 8 over pp, dp_shard, cp, tp; ep folded over dp_shard x cp."""
    pp, cp, tp = (draw(st.sampled_from([1, 2])) for _ in range(3))
    dp_shard = 8 // (pp * cp * tp)
    moe = draw(st.booleans())
    ep = draw(st.sampled_from([e for e in (1, 2, 4) if (dp_shard * cp) % e == 0])) if moe else 1
    schedule, v = draw(st.sampled_from(SCHEDULES)) if pp > 1 else ("1f1b", 1)
    kind = draw(st.sampled_from(["ring", "zigzag", "ulysses"])) if cp > 1 else "zigzag"
    ac = draw(st.sampled_from(["none", "selective", "full"]))
    m = 2
    plan = (f"pp={pp},dp_shard={dp_shard},cp={cp},tp={tp},ep={ep},pp_schedule={schedule},"
            f"pp_virtual_stages={v},pp_microbatches={m if pp > 1 else 1},cp_attention={kind},"
            f"activation_checkpointing={ac}")
    model = ModelSpec(layers=max(2, pp * v), heads=4, kv_heads=2, head_dim=8, intermediate=16, vocab=64,
                      tied=draw(st.booleans()), experts=4 if moe else 0, top_k=2,
                      seed=draw(st.integers(0, 99)))
    multiple = meshkit.Plan.from_string(plan).seq_multiple()
    batch = BatchSpec(batch=dp_shard * m, seq=max(8, multiple), ignore=0.3, seed=draw(st.integers(0, 99)),
                      documents=draw(st.sampled_from([1, 2])))
    return plan, model, batch


@examples(ci=2)
@given(full_plans())
def test_random_full_plans_on_eight_ranks(dist, case):
    plan, model, batch = case
    results = dist(8).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, f"{plan} on {model} with {batch}")
