"""PEFT LoRA models under meshkit plans against the single-device PeftModel: loss, every adapter
gradient, and parameters after AdamW steps (base weights frozen, never given a gradient)."""

from __future__ import annotations

import dataclasses

import pytest
from tests_support import assert_matches_reference

from meshkit.testing.reference import BatchSpec, LoraSpec, ModelSpec, compare_training


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec, meta_init: bool = False):
    return dataclasses.asdict(compare_training(plan, model, batch, meta_init=meta_init))


@pytest.mark.parametrize("plan", ["tp=2,dp_shard=2", "tp=2,dp_shard=2,sequence_parallel=false",
                                  "dp_shard=4", "pp=2,tp=2,pp_schedule=zb_h1,pp_microbatches=2"])
def test_lora_explicit_plans(dist, plan):
    model = ModelSpec(layers=2, lora=LoraSpec())
    results = dist(4).run(_compare_on_rank, plan, model, BatchSpec(batch=4, seq=8))
    assert_matches_reference(results, plan)
