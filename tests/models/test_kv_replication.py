"""MQA and GQA with fewer K/V heads than tp ranks: K/V heads replicated across the tp ranks that read
them, against the single-device model (loss, every gradient, parameters after two AdamW steps)."""

from __future__ import annotations

import dataclasses

import pytest
from tests_support import assert_matches_reference

import meshkit
from meshkit import mesh as mesh_lib
from meshkit.testing.families import family_spec
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec):
    return dataclasses.asdict(compare_training(plan, model, batch))


@pytest.mark.parametrize("plan, model", [
    ("tp=2,dp_shard=2", ModelSpec(heads=4, kv_heads=1)),                       # MQA, SP, 2D with FSDP
    ("tp=4,sequence_parallel=false", ModelSpec(heads=8, kv_heads=2, head_dim=4)),  # 2 ranks per K/V head, no SP
    ("tp=4", ModelSpec(kind="qwen3", heads=4, kv_heads=1, tied=True)),          # per-head k_norm on a shared head
])
def test_kv_heads_fewer_than_tp(dist, plan, model):
    results = dist(4).run(_compare_on_rank, plan, model, BatchSpec(batch=4, seq=8))
    assert_matches_reference(results, f"{plan} on {model}")


def _refuse_before_mesh(plan: str, model: ModelSpec) -> None:
    """parallelize with `init_mesh` made to fail loudly: the refusal must come before it."""
    built = mesh_lib.init_mesh

    def no_mesh(*args, **kwargs):
        raise RuntimeError("the mesh was built before the model was checked")

    mesh_lib.init_mesh = no_mesh
    try:
        meshkit.parallelize(model.build(device="meta"), meshkit.Plan.from_string(plan))
    finally:
        mesh_lib.init_mesh = built


@pytest.mark.parametrize("kind", ["olmo2", "olmoe"])
def test_whole_projection_norm_refuses_replicated_kv_before_the_mesh(dist, kind):
    """OLMo-2 / OLMoE normalise q and k over all heads; with one K/V head and tp=2 every rank raises a
    ValueError naming the rule and the largest tp that works, before any mesh or collective exists."""
    model = family_spec(kind, kv_heads=1)
    outcomes = dist(2).run_raw(_refuse_before_mesh, "tp=2", model, timeout=120)
    for o in outcomes:
        assert not o.ok and isinstance(o.value, ValueError), f"rank {o.rank}: {o.exc_type}: {o.message}"
        assert "whole projection" in o.message and "largest tp that works is 1" in o.message, o.message
