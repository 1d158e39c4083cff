"""Hypothesis over the config fields that change the math: family, K/V heads against tp (split or
replicated), head_dim, tied embeddings, rope scaling, windows against the sequence length, under a
drawn plan shape on 4 ranks, against the single-device HF model."""

from __future__ import annotations

import dataclasses
import os

from hypothesis import given, settings
from hypothesis import strategies as st
from tests_support import assert_matches_reference

from meshkit.testing.families import FAMILY_FIELDS, MOE_KINDS
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

# Families whose tiny config takes every drawn field (Phi-3's packed attention keeps kv | heads too);
# the MoE families (experts, MLA) run in test_families.py.
KINDS = sorted(k for k in FAMILY_FIELDS if k not in ("gemma2", *MOE_KINDS))


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec):
    return dataclasses.asdict(compare_training(plan, model, batch))


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(KINDS))
    shape = draw(st.sampled_from(["tp", "ulysses", "pp"]))
    kv = draw(st.sampled_from([1, 2, 4]))
    if kind == "olmo2":
        kv = 4  # its k_norm spans all K/V heads: replication is refused (tests/models/test_families.py)
    heads = 4
    fields = dict(FAMILY_FIELDS[kind])
    seq = draw(st.sampled_from([8, 16]))
    if "sliding_window" in fields:
        fields["sliding_window"] = draw(st.sampled_from([2, 5, seq]))
    if draw(st.booleans()) and kind in ("llama", "qwen2", "mistral", "helium"):
        fields["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    model = ModelSpec(kind=kind, heads=heads, kv_heads=kv, head_dim=draw(st.sampled_from([4, 8])),
                      tied=draw(st.booleans()), seed=draw(st.integers(0, 99)), extra=tuple(fields.items()))
    plan = {"tp": "tp=2,dp_shard=2", "ulysses": "cp=2,dp_shard=2,cp_attention=ulysses",
            "pp": "pp=2,dp_shard=2,pp_microbatches=2"}[shape]
    if shape == "tp" and draw(st.booleans()):
        plan = "tp=4"  # kv=1 or 2: K/V heads replicated over 4 or 2 ranks each
    return plan, model, BatchSpec(batch=4, seq=seq, seed=draw(st.integers(0, 99)))


@settings(max_examples=3 if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else 30)
@given(cases())
def test_math_changing_fields(dist, case):
    plan, model, batch = case
    results = dist(4).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, f"{plan} on {model}")
