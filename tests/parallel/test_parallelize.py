"""TP/SP + FSDP2/HSDP + AC on HF Llama-family models compute what the single-device model computes.

Hypothesis draws plans (tp, dp_shard, dp_replicate, SP, AC) and tiny model configs (GQA ratios, odd
head counts, head dims, tied embeddings, Qwen3's per-head norms) and batches with ignored labels;
every rank trains a sharded copy and a single-device copy and reports the worst differences in the
loss, in every gathered gradient, and in every parameter after two AdamW steps. Tolerances are fixed
fp32 tolerances, the same for 2 and 8 ranks.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests_support import assert_matches_reference, examples

from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec, meta_init: bool = False):
    return dataclasses.asdict(compare_training(plan, model, batch, meta_init=meta_init))


@st.composite
def plans_and_models(draw):
    world = draw(st.sampled_from([2, 4, 8]))
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if world % t == 0]))
    rest = world // tp
    dp_replicate = draw(st.sampled_from([r for r in (1, 2) if rest % r == 0]))
    dp_shard = rest // dp_replicate
    sp = draw(st.booleans())
    ac = draw(st.sampled_from(["none", "selective", "full"]))
    kv = tp * draw(st.sampled_from([1, 2]))
    heads = kv * draw(st.sampled_from([1, 2, 3]))
    model = ModelSpec(
        kind=draw(st.sampled_from(["llama", "qwen3"])),
        layers=draw(st.sampled_from([1, 2])),
        heads=heads,
        kv_heads=kv,
        head_dim=draw(st.sampled_from([4, 8])),
        intermediate=tp * draw(st.sampled_from([6, 10])),
        vocab=tp * draw(st.sampled_from([15, 17])),
        tied=draw(st.booleans()),
        seed=draw(st.integers(0, 1000)),
    )
    per_rank = draw(st.sampled_from([1, 2]))
    seq = tp * draw(st.sampled_from([3, 4])) if sp else draw(st.sampled_from([5, 7]))
    batch = BatchSpec(batch=per_rank * dp_replicate * dp_shard, seq=seq,
                      ignore=draw(st.sampled_from([0.0, 0.3, 0.9])), seed=draw(st.integers(0, 1000)))
    plan = (f"tp={tp},dp_replicate={dp_replicate},dp_shard={dp_shard},sequence_parallel={sp},"
            f"activation_checkpointing={ac}")
    return world, plan, model, batch


@examples(ci=3)
@given(plans_and_models())
def test_random_plans_match_single_device(dist, case):
    world, plan, model, batch = case
    results = dist(world).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, f"{plan} on {model} with {batch}")


@pytest.mark.parametrize(
    "plan",
    [
        "tp=2,dp_shard=2,dp_replicate=2",
        "tp=2,dp_shard=2,dp_replicate=2,sequence_parallel=false,activation_checkpointing=selective",
        "tp=8,dp_shard=1",
        "dp_shard=8",
    ],
)
def test_eight_rank_plans(dist, plan):
    model = ModelSpec(heads=8, kv_heads=8, head_dim=4, intermediate=32, vocab=64)
    batch = BatchSpec(batch=8, seq=16)
    results = dist(8).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, plan)


@pytest.mark.parametrize("kind", ["qwen2", "mistral"])
def test_other_llama_family_models(dist, kind):
    model = ModelSpec(kind=kind, heads=4, kv_heads=2, vocab=64)
    results = dist(4).run(_compare_on_rank, "tp=2,dp_shard=2", model, BatchSpec(batch=4, seq=8))
    assert_matches_reference(results, kind)


@pytest.mark.parametrize("plan, world", [("tp=2,dp_shard=2", 4), ("tp=2", 2), ("cp=2,dp_shard=2", 4)])
def test_meta_device_model_loads_its_shards(dist, plan, world):
    model = ModelSpec(kind="qwen3", tied=True)
    batch = BatchSpec(batch=world // (2 if "tp" in plan or "cp" in plan else 1), seq=8)
    results = dist(world).run(_compare_on_rank, plan, model, batch, meta_init=True)
    assert_matches_reference(results, f"meta init, {plan}")


def _misplaced_grads(plan: str) -> list[str]:
    import torch

    import meshkit

    pm = meshkit.parallelize(ModelSpec(layers=2).build(), meshkit.Plan.from_string(plan))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    pm.forward_backward(ids, ids)
    return [n for n, p in pm.named_parameters()
            if hasattr(p, "placements") and tuple(p.grad.placements) != tuple(p.placements)]


@pytest.mark.parametrize("plan, world", [("tp=2", 2), ("pp=2,tp=2", 4)])
def test_tp_without_fsdp_leaves_gradients_placed_like_parameters(dist, plan, world):
    # Without FSDP to redistribute them, the vocab-parallel embedding's gradient would stay a full
    # Replicate [vocab, hidden] tensor and the norms' gradients Partial.
    for misplaced in dist(world).run(_misplaced_grads, plan):
        assert misplaced == []


def _second_model_on_the_same_layout(plan: str, same_layout: str, other_layout: str) -> dict:
    import os

    import meshkit

    first = compare_training(plan, ModelSpec(), BatchSpec(batch=4, seq=8))
    threads = len(os.listdir("/proc/self/task"))
    pm = meshkit.parallelize(ModelSpec(seed=1).build(), meshkit.Plan.from_string(plan))
    second = compare_training(same_layout, ModelSpec(seed=2), BatchSpec(batch=4, seq=8))
    threads_grew = len(os.listdir("/proc/self/task")) - threads
    return dict(first=dataclasses.asdict(first), second=dataclasses.asdict(second), threads_grew=threads_grew,
                same=pm.mesh is meshkit.init_mesh(meshkit.Plan.from_string(same_layout)),
                other=pm.mesh is not meshkit.init_mesh(meshkit.Plan.from_string(other_layout)))


def test_models_on_one_layout_share_one_mesh(dist):
    """A second model under the same axis sizes reuses the first one's mesh: torch never frees a mesh's
    process groups (gloo: threads and sockets), and both models still train like the single-device one."""
    for r in dist(4).run(_second_model_on_the_same_layout, "dp_shard=2,tp=2",
                         "tp=2,dp_shard=2,activation_checkpointing=full", "dp_shard=4"):
        assert r["same"] and r["other"], r
        assert r["threads_grew"] == 0, r
        assert_matches_reference([r["first"]], "the first model")
        assert_matches_reference([r["second"]], "a second model on the reused mesh")
