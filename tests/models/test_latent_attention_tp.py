"""DeepSeek-V3's multi-head latent attention split over tp, against HF: loss, every gradient (the
replicated latent layers' partial ones summed over tp), the clipped norm and parameters after two
AdamW steps, composed with FSDP, pipelining and expert parallelism.

The family test runs tp=2 x dp_shard=2 with SP (tests/models/test_families.py). Here: tp with experts
over ep, tp without SP, the latent variants (no q latent: `q_proj` colwise on the hidden states;
attention biases: the rowwise `o_proj` bias joins once, after the sum), tp x pp under a one-pass and
a zero-bubble schedule (whose deferred weight gradients leave the local-shard linears alone), and tp x
ring CP, where each rank's heads go round the ring."""

from __future__ import annotations

import dataclasses

import pytest
from tests_support import assert_matches_reference

import meshkit
from meshkit.models import roles
from meshkit.testing.families import family_spec
from meshkit.testing.reference import BatchSpec, compare_training

BATCH = BatchSpec(batch=4, seq=8)
# (plan, ModelSpec overrides, extra config fields)
CASES = {
    # dense blocks only (MoE under tp needs SP): the plain blocks' local path without SP
    "tp_nosp_variants": ("tp=2,dp_shard=2,sequence_parallel=false", {},
                         {"q_lora_rank": None, "attention_bias": True, "first_k_dense_replace": 2}),
    "tp_ep": ("tp=2,dp_shard=2,ep=2", {}, {"attention_bias": True}),
    "tp_pp": ("pp=2,tp=2,pp_microbatches=2", {"layers": 4}, {}),
    "tp_pp_zb": ("pp=2,tp=2,pp_schedule=zb_h1,pp_microbatches=4", {"layers": 4}, {}),
    "tp_ring": ("tp=2,cp=2,cp_attention=zigzag", {}, {}),
    "tp4": ("tp=4", {"heads": 8, "kv_heads": 8}, {}),
}
CI = ("tp_nosp_variants", "tp_pp")


def _compare_on_rank(plan: str, fields: dict, extra: dict):
    spec = family_spec("deepseek_v3", **fields)
    spec.extra = tuple({**dict(spec.extra), **extra}.items())
    return dataclasses.asdict(compare_training(plan, spec, BATCH))


@pytest.mark.parametrize("case", [c if c in CI else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_latent_attention_under_tp(dist, case):
    plan, fields, extra = CASES[case]
    results = dist(4).run(_compare_on_rank, plan, fields, extra)
    assert_matches_reference(results, f"deepseek_v3 {case} under {plan}")


def test_tp_must_split_the_heads():
    """Every rank up-projects the latents for whole heads: a tp that does not divide them is refused by
    the plan's validation, naming the largest degree that works and the ones that do."""
    config = family_spec("deepseek_v3", heads=6, kv_heads=6).config()
    assert roles.tp_degree_problem(config, 3) is None
    with pytest.raises(ValueError, match=r"largest tp that works is 3; fix: use a tp in \[1, 2, 3, 6\]"):
        meshkit.Plan(tp=4).validate(config, 4)


def test_latent_layers_stay_whole():
    """The roles TP applies: up-projections colwise, o rowwise, the down-projections and latent norms
    whole (`latent`), with or without a q latent."""
    for q_lora, q_proj in ((16, "self_attn.q_b_proj"), (None, "self_attn.q_proj")):
        spec = family_spec("deepseek_v3")
        spec.extra = tuple({**dict(spec.extra), "q_lora_rank": q_lora}.items())
        config = spec.config()
        block = spec.build(device="meta").model.layers[0]
        got = {k: v for k, v in roles.block_roles(block, config).items() if k.startswith("self_attn.")}
        want = {q_proj: "colwise", "self_attn.kv_a_proj_with_mqa": "latent", "self_attn.kv_a_layernorm": "latent",
                "self_attn.kv_b_proj": "colwise", "self_attn.o_proj": "rowwise"}
        if q_lora:
            want |= {"self_attn.q_a_proj": "latent", "self_attn.q_a_layernorm": "latent"}
        assert got == want
