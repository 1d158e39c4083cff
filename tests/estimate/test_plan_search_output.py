"""What `python -m meshkit.estimate.search` prints: every plan pastes into `Plan.from_string` unchanged,
short sequences get an answer (cp is simply not tried), and an empty answer says what removed the
candidates."""

from __future__ import annotations

import dataclasses
import re

from transformers import LlamaConfig

from meshkit.estimate import search as plan_search
from meshkit.estimate.spec import DEVICES
from meshkit.plan import Plan

MODEL = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=4096)


def _printed_plans(text: str) -> list[str]:
    """The plan column of every table row: what a user copies."""
    return re.findall(r"ms  (\S+|single device)  \(mbs=\d+, m=\d+\)", text)


def test_printed_plans_round_trip_through_from_string():
    device = dataclasses.replace(DEVICES["h100"], memory_bytes=256 * 2**20)
    result = plan_search.search(MODEL, 4, 1024, 16 * 1024, device, top=8)
    assert result.plans
    text = plan_search.render(result, plan_search.budget(device), 4)
    printed = _printed_plans(text)
    assert len(printed) >= len(result.plans), text
    for cand, line in zip(result.plans, printed):
        assert Plan.from_string(line) == cand.plan, f"{line!r} does not parse back to {cand.plan}"


def test_short_sequences_get_plans_without_context_parallelism():
    result = plan_search.search(MODEL, 4, 256, 16 * 256, DEVICES["h100"], top=50)
    assert result.plans, "seq below 512 answered with nothing"
    assert all(c.plan.cp == 1 for c in result.plans)
    assert any("fewer than 512 tokens per context shard" in why for why in result.removed)


def test_an_empty_answer_names_what_removed_the_candidates():
    empty = plan_search.SearchResult([], {}, 0, {}, {"cp > 1 leaves fewer than 512 tokens": 3})
    text = plan_search.render(empty, 1.0, 8)
    assert "no layout was estimated: cp > 1 leaves fewer than 512 tokens (3 degree combinations)" in text
