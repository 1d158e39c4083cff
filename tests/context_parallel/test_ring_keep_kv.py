"""`Plan(cp_keep_kv=True)`: the ring kinds keep forward's K/V blocks for backward and send each
block's dK/dV straight to its owner. Same loss, gradients and parameters as the single-device model
(cp=2: the neighbour exchange; cp=4: the pairwise exchange reaches ranks two steps away), packed
documents included. Bytes are checked byte for byte against the estimator in
tests/estimate/test_cp_bytes.py."""

from __future__ import annotations

import dataclasses

import pytest
from tests_support import assert_matches_reference

import meshkit
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec):
    return dataclasses.asdict(compare_training(plan, model, batch))


@pytest.mark.parametrize("kind, cp", [("ring", 2), ("zigzag", 2), ("zigzag", 4)])
def test_kept_kv_matches_single_device(dist, kind, cp):
    plan = f"cp={cp},cp_attention={kind},cp_keep_kv=true"
    model = ModelSpec(heads=4, kv_heads=2, head_dim=8, intermediate=32, vocab=64)
    results = dist(cp).run(_compare_on_rank, plan, model, BatchSpec(batch=1, seq=16, documents=2))
    assert_matches_reference(results, plan)


@pytest.mark.parametrize("kind", ["allgather", "ulysses", "usp"])
def test_keep_kv_refused_for_kinds_that_do_not_resend_kv(kind):
    extra = ",cp_ulysses=2" if kind == "usp" else ""
    plan = meshkit.Plan.from_string(f"cp=4,cp_attention={kind},cp_keep_kv=true{extra}")
    with pytest.raises(ValueError, match="cp_keep_kv=true with cp_attention"):
        plan.validate(world_size=4)
