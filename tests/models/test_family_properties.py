"""Hypothesis over the config fields that change the math: family, K/V heads against tp (split or
replicated), head_dim, tied embeddings, rope scaling, windows against the sequence length (in the
zig-zag ring's blocks too), under a drawn plan shape on 4 ranks, against the single-device HF model; for the MoE families, the routing
(top-k, its renormalisation, DeepSeek-V3's groups), shared experts and dense blocks in the stack."""

from __future__ import annotations

import dataclasses
import os

from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from tests_support import CI_PROFILE, assert_matches_reference, examples

from meshkit.testing.families import FAMILY_FIELDS, MOE_KINDS, family_spec
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

# Families whose tiny config takes every drawn field (Phi-3's packed attention keeps kv | heads too);
# the MoE families (experts, MLA) draw their own fields (`moe_cases`).
KINDS = sorted(k for k in FAMILY_FIELDS if k not in ("gemma2", *MOE_KINDS))


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec):
    return dataclasses.asdict(compare_training(plan, model, batch))


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(KINDS))
    shape = draw(st.sampled_from(["tp", "ulysses", "zigzag", "pp"]))
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
            "zigzag": "cp=2,dp_shard=2,cp_attention=zigzag", "pp": "pp=2,dp_shard=2,pp_microbatches=2"}[shape]
    if shape == "tp" and draw(st.booleans()):
        plan = "tp=4"  # kv=1 or 2: K/V heads replicated over 4 or 2 ranks each
    return plan, model, BatchSpec(batch=4, seq=seq, seed=draw(st.integers(0, 99)))


@settings(max_examples=3 if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else 30)
@given(cases())
def test_math_changing_fields(dist, case):
    plan, model, batch = case
    results = dist(4).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, f"{plan} on {model}")


@st.composite
def moe_cases(draw):
    """An MoE family with the fields that change its routing and its stack drawn: top-k and whether
    it is renormalised, DeepSeek-V3's groups (n_group / topk_group), shared experts and dense first
    blocks, Qwen2-MoE's dense blocks (`mlp_only_layers`, `decoder_sparse_step`), OLMoE's q/k/v clamp,
    K/V heads against tp; under TP x EP (DeepSeek-V3's latent attention by heads), Ulysses, the
    pipeline or EP alone."""
    kind = draw(st.sampled_from(["qwen2_moe", "olmoe", "deepseek_v3"]))
    fields = dict(FAMILY_FIELDS[kind])
    top_k = draw(st.sampled_from([1, 2]))
    fields["norm_topk_prob"] = draw(st.booleans())
    kv = 4
    if kind == "deepseek_v3":  # 4 experts: groups of 4 / n_group (at least 2), top_k of the kept groups' experts
        n_group, topk_group = draw(st.sampled_from([(1, 1), (2, 1), (2, 2)]))
        fields.update(n_group=n_group, topk_group=topk_group, n_shared_experts=draw(st.sampled_from([0, 1])),
                      first_k_dense_replace=draw(st.sampled_from([0, 1])))
        top_k = min(top_k, topk_group * 4 // n_group)
    elif kind == "qwen2_moe":
        step = fields["decoder_sparse_step"] = draw(st.sampled_from([1, 2]))  # 2: block 0 dense, 1 MoE
        fields["mlp_only_layers"] = draw(st.sampled_from([[], [0]] + ([[1]] if step == 1 else [])))
        kv = draw(st.sampled_from([1, 2, 4]))  # 1: each K/V head replicated over the 2 tp ranks
    else:
        fields["clip_qkv"] = draw(st.sampled_from([None, 0.5]))
        kv = draw(st.sampled_from([2, 4]))  # its k_norm spans all K/V heads: replication is refused
    shapes = ["ulysses", "pp", "ep", "tp_ep"]  # DeepSeek-V3's latent attention splits by heads over tp too
    plan = {"tp_ep": "dp_shard=2,tp=2,ep=2", "ulysses": "cp=2,dp_shard=2,cp_attention=ulysses",
            "pp": "pp=2,dp_shard=2,pp_microbatches=2", "ep": "dp_shard=4,ep=2"}[draw(st.sampled_from(shapes))]
    model = family_spec(kind, kv_heads=kv, top_k=top_k, seed=draw(st.integers(0, 99)))
    model = dataclasses.replace(model, extra=tuple(fields.items()))
    return plan, model, BatchSpec(batch=4, seq=8, seed=draw(st.integers(0, 99)))


# The case CI runs (explicitly; other profiles draw): Qwen2-MoE under TP x EP with its dense first block
# and gated shared expert, top-1 renormalised, a single K/V head replicated over the tp ranks.
MOE_CI_CASE = ("dp_shard=2,tp=2,ep=2",
               dataclasses.replace(family_spec("qwen2_moe", kv_heads=1, top_k=1, seed=3),
                                   extra=tuple({**dict(FAMILY_FIELDS["qwen2_moe"]), "norm_topk_prob": True,
                                                "mlp_only_layers": [0], "decoder_sparse_step": 1}.items())),
               BatchSpec(batch=4, seq=8, seed=5))


@(settings(phases=[Phase.explicit]) if CI_PROFILE else examples(ci=1))
@example(MOE_CI_CASE)
@given(moe_cases())
def test_moe_family_fields(dist, case):
    plan, model, batch = case
    results = dist(4).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, f"{plan} on {model}")
