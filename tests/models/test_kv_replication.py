"""MQA and GQA with fewer K/V heads than tp ranks: K/V heads replicated across the tp ranks that read
them, against the single-device model (loss, every gradient, parameters after two AdamW steps)."""

from __future__ import annotations

import dataclasses

import pytest
from tests_support import assert_matches_reference

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
