"""gpt-oss's attention sinks through whole models under the plans that move heads or merge blocks,
against the single-device HF model (loss, every gradient, the sinks' included, parameters after two
AdamW steps). The window is as long as the sequence under the merging CP kinds, so only the sinks
change their math (shorter windows are refused there: test_families).

- tp=4 with one K/V head (MQA): every rank holds one query head, its sink, and a replicated K/V head;
- tp=2 x zig-zag cp=2: each rank's sinks are its query heads', added once to the merged denominator;
- all-gather K/V over cp=4, and USP (Ulysses 2 x ring 2): each Ulysses rank's heads' sinks.
"""

from __future__ import annotations

import dataclasses

import pytest
from tests_support import assert_matches_reference

from meshkit.testing.families import FAMILY_FIELDS, family_spec
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

BATCH = BatchSpec(batch=4, seq=8)


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec):
    return dataclasses.asdict(compare_training(plan, model, batch))


def _window(length: int) -> tuple:
    return tuple((k, length if k == "sliding_window" else v) for k, v in FAMILY_FIELDS["gpt_oss"])


@pytest.mark.parametrize("plan, model", [
    ("tp=4", family_spec("gpt_oss", kv_heads=1)),
    ("tp=2,cp=2,cp_attention=zigzag", family_spec("gpt_oss", extra=_window(BATCH.seq))),
    ("cp=4,cp_attention=allgather", family_spec("gpt_oss", extra=_window(BATCH.seq))),
    ("cp=4,cp_attention=usp,cp_ulysses=2", family_spec("gpt_oss", extra=_window(BATCH.seq))),
], ids=["tp4-mqa", "tp2-zigzag2", "allgather4", "usp2x2"])
def test_sinks_under_tp_and_ring(dist, plan, model):
    results = dist(4).run(_compare_on_rank, plan, model, BATCH)
    assert_matches_reference(results, f"gpt_oss under {plan}")
