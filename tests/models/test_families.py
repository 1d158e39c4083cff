"""Every supported HF family x the plan shapes (and ep for the MoE families) on 4 ranks, against HF:
loss, every gathered gradient, clipped norm and parameters after two AdamW steps. Every plan shape
applies every family's math (soft-capping and windows shorter than the sequence in the ring kinds'
blocks, DeepSeek-V3's latent attention split by heads over tp). Only the LoRA shape refuses a family
(packed projections under tp, PEFT's expert parameters): every rank then raises the reason and the fix
before any collective.

CI (the `ci` hypothesis profile) runs a representative subset (each quirk under each plan shape at
least once); any other profile runs every family x plan."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from tests_support import assert_matches_reference

import meshkit
from meshkit.testing.families import FAMILY_FIELDS, LORA, MOE_KINDS, family_spec, plan_refusal
from meshkit.testing.reference import BatchSpec, compare_training

PLANS = {
    "tp": "tp=2,dp_shard=2",
    "ring": "cp=2,dp_shard=2,cp_attention=ring",
    "zigzag": "cp=2,dp_shard=2,cp_attention=zigzag",
    "ulysses": "cp=2,dp_shard=2,cp_attention=ulysses",
    "pp": "pp=2,dp_shard=2,pp_microbatches=2",
    "ep": "dp_shard=4,ep=4",  # MoE families only: one expert per rank
    "lora": "tp=2,dp_shard=2",  # a PEFT LoRA model (families.LORA: attention and dense-MLP adapters)
}
# Each quirk under the shape most likely to break it: soft-capping, windows and post-norms under TP and
# (in the zig-zag ring's blocks, the window shorter than the sequence) CP; windows and rope per layer
# type under Ulysses; packed projections and the whole-projection q/k norm under TP; multipliers across
# pipeline stages; NoPE layers under ring CP; Qwen2-MoE's gated shared expert with experts over ep;
# OLMoE's in-place q/k/v clamps under TP; DeepSeek-V3's latent attention (V padded to the q/k head dim)
# through the zig-zag ring, and split by heads under TP with its MoE blocks.
CI_CASES = {
    ("gemma2", "tp"), ("gemma2", "zigzag"), ("gemma3_text", "ulysses"), ("phi3", "tp"), ("olmo2", "tp"),
    ("granite", "pp"), ("smollm3", "ring"), ("qwen2_moe", "ep"), ("olmoe", "tp"),
    ("deepseek_v3", "zigzag"), ("deepseek_v3", "tp"),
    # gpt-oss: sinks split with the query heads under TP (biased experts on each rank's sequence
    # shard), sinks following the heads under Ulysses with alternating windows.
    ("gpt_oss", "tp"), ("gpt_oss", "ulysses"),
    # LoRA: adapters on gpt-oss's biased attention (the DTensor path: row-parallel o_proj with a bias)
    # and a packed model's refusal.
    ("gpt_oss", "lora"), ("phi3", "lora"),
}
FULL = os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci"
BATCH = BatchSpec(batch=4, seq=8, documents=1)


def _compare_on_rank(plan: str, kind: str, batch: BatchSpec, lora: bool = False):
    return dataclasses.asdict(compare_training(plan, family_spec(kind, lora=LORA if lora else None), batch))


def _train_one_step(plan: str, kind: str, batch: BatchSpec, lora: bool = False):
    model = family_spec(kind, lora=LORA if lora else None).build()
    # Start validation together: the pool gives ranks a few seconds to follow a rank that raised, and
    # building the model takes longer than that on a loaded machine.
    torch.distributed.barrier()
    pm = meshkit.parallelize(model, meshkit.Plan.from_string(plan))
    ids, labels = batch.make(64)
    pm.forward_backward(ids[:2], labels[:2])


CASES = [(kind, shape) for kind in FAMILY_FIELDS for shape in PLANS
         if (shape != "ep" or kind in MOE_KINDS) and (FULL or (kind, shape) in CI_CASES)]


@pytest.mark.parametrize("kind, shape", CASES)
def test_family_under_plan(dist, kind, shape):
    plan = PLANS[shape]
    refusal = plan_refusal(kind, shape)
    if refusal is None:
        results = dist(4).run(_compare_on_rank, plan, kind, BATCH, shape == "lora")
        assert_matches_reference(results, f"{kind} under {plan}")
        return
    outcomes = dist(4).run_raw(_train_one_step, plan, kind, BATCH, shape == "lora", timeout=300)
    reason, fix = refusal
    for o in outcomes:
        assert not o.ok and isinstance(o.value, ValueError), f"rank {o.rank}: {o.exc_type}: {o.message}"
        assert reason in o.message and fix in o.message, o.message


# TP composed with EP on the MoE families: TP ranks route their own sequence shard through whole experts
# split over ep, the shared expert and its gate whole on every TP rank (gradients summed over tp).
# Under the slow profile: CI runs Qwen2-MoE under tp x ep in test_family_properties (MOE_CI_CASE), and
# DeepSeek-V3 (latent attention split by heads, with attention biases) in test_latent_attention_tp.py.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2_moe", "olmoe"])
def test_moe_families_under_tp_and_ep(dist, kind):
    plan = "dp_shard=2,tp=2,ep=2"
    results = dist(4).run(_compare_on_rank, plan, kind, BATCH)
    assert_matches_reference(results, f"{kind} under {plan}")
