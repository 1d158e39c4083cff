"""The estimator's context-parallel bytes, byte for byte against CommCounter, for EVERY CP kind in fp32
and bf16 (bf16 parameters with fp32 gradient reduction, and bf16 reduction too).

A seeded bug survived the suite while its only CP byte test ran one kind in fp32: sizing the ring's
dK/dV in bf16 while the code sends them in the reduce dtype passes when the two are equal. Here the
parameter dtype and the reduce dtype differ in one of the three settings, and every kind runs each.

Collectives are keyed by kind and group size (FSDP over 4 ranks, the cp axis or its Ulysses/outer
parts over 2), which keeps FSDP's gathers apart from the all-gather kind's on any layout.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from tests_support import CI_PROFILE
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from meshkit import estimate as est
from meshkit.comm_counter import CommCounter
from meshkit.estimate import search as plan_search
from meshkit.plan import Plan
from meshkit.testing.families import family_spec

MODEL = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, vocab_size=96)
KINDS = {  # cp_attention and its degrees, on 4 ranks
    "ring": "cp=2,dp_shard=2,cp_attention=ring,cp_keep_kv=false",
    "zigzag": "cp=2,dp_shard=2,cp_attention=zigzag,cp_keep_kv=false",
    "allgather": "cp=2,dp_shard=2,cp_attention=allgather",
    "ulysses": "cp=2,dp_shard=2,cp_attention=ulysses",
    "usp": "cp=4,cp_attention=usp,cp_ulysses=2",
    "allgather_usp": "cp=4,cp_attention=allgather,cp_ulysses=2",
}
DTYPES = {  # (param, reduce, AC): recompute re-issues the attention collectives, so AC varies too
    "fp32": "param_dtype=float32,reduce_dtype=float32,activation_checkpointing=none",
    "bf16_reduce_fp32": "param_dtype=bfloat16,reduce_dtype=float32,activation_checkpointing=selective",
    "bf16": "param_dtype=bfloat16,reduce_dtype=bfloat16,activation_checkpointing=full",
}
PLANS = {f"{k}/{d}": f"{KINDS[k]},{DTYPES[d]}" for k in KINDS for d in DTYPES}
# cp_keep_kv: the ring kinds keep forward's K/V for backward (no K/V resent, dK/dV straight to the owner)
PLANS.update({f"{k}_keep/{d}": f"{KINDS[k]},cp_keep_kv=true,{DTYPES[d]}" for k in ("ring", "zigzag")
              for d in (("fp32", "bf16_reduce_fp32") if k == "zigzag" else ("fp32",))})
# the kind and keep-K/V left open: chosen for the model (`context_parallel.rules.choose_cp`)
PLANS.update({f"auto/{d}": f"cp=2,dp_shard=2,{DTYPES[d]}" for d in ("fp32", "bf16_reduce_fp32")})
BATCH, SEQ = 2, 16


def _config() -> LlamaConfig:
    return LlamaConfig(max_position_embeddings=64, use_cache=False, **MODEL)


def _size_of(label: str) -> int:
    """Size of a group CommCounter could not name (the functional all-to-all passes only its name)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_world_size(_resolve_process_group(label.removeprefix("group:")))


# Multi-head latent attention (DeepSeek-V3, a dense first block and an MoE one): K has qk_nope + qk_rope
# = 12 dims per head and V 6, padded to 12 for the kernels and the ring's packed buffer; every head has
# its own K and V. Estimating with the rope head dim (4) or the K/V heads of the config would miss.
# CI runs the zig-zag ring; other profiles Ulysses and the all-gather kind in bf16 with fp32 reduction
# too (full AC: selective AC with cp on this model fails in meshkit's recompute, a CheckpointError).
MLA_PLANS = {"zigzag/fp32": f"{KINDS['zigzag']},{DTYPES['fp32']}"}
if not CI_PROFILE:
    MLA_PLANS["ulysses/fp32"] = f"{KINDS['ulysses']},{DTYPES['fp32']}"
    MLA_PLANS["allgather/bf16_reduce_fp32"] = (f"{KINDS['allgather']},param_dtype=bfloat16,reduce_dtype=float32,"
                                               "activation_checkpointing=full")


def _mla_config():
    return family_spec("deepseek_v3", vocab=MODEL["vocab_size"]).config()


def _count_on_rank(plans: dict[str, str], family: str = "llama") -> dict[str, dict[str, int]]:
    """Bytes per (kind, group size) of one forward_backward under each plan (scalars left out)."""
    out = {}
    for key, text in plans.items():
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config()) if family == "llama" else family_spec(family, vocab=MODEL["vocab_size"]).build()
        pm = meshkit.parallelize(model, Plan.from_string(text))
        pm.check_inputs = False  # its few-byte agreement checks are not part of the estimate
        ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
        with CommCounter(pm.mesh) as counter:
            pm.forward_backward(ids, ids)
        counted: dict[str, int] = {}
        for kind, label, nbytes in counter.events:
            if nbytes <= 8:  # the loss and token-count scalars
                continue
            k = f"{kind}@{counter.sizes.get(label) or _size_of(label)}"
            counted[k] = counted.get(k, 0) + nbytes
        out[key] = counted
    return out


@pytest.fixture(scope="module")
def counted(dist) -> list[dict[str, dict[str, int]]]:
    return dist(4).run(_count_on_rank, PLANS, timeout=600)


def _predicted(plan: Plan, config=None) -> dict[str, float]:
    config = config or _config()
    state = est.model_state(config, plan)
    work = est.Workload(seq=SEQ, mbs=BATCH, microbatches=1)  # BATCH rows per data rank
    predicted: dict[str, float] = {}
    for c in est.communication(config, plan, work, est.DEVICES["h100"], state, 1.0, 0.0):
        if c.axis == "pp_cp_tp":  # the input checks' batch signature: these runs check no inputs
            continue
        kinds = ("send", "recv") if c.kind == "p2p" else (c.kind,)
        for kind in kinds:  # a ring exchange is one send and one receive of one buffer
            predicted[f"{kind}@{c.group}"] = predicted.get(f"{kind}@{c.group}", 0) + c.calls * c.buffer
    return predicted


@pytest.mark.parametrize("key", sorted(PLANS))
def test_cp_bytes_match_comm_counter_every_kind_and_dtype(counted, key: str) -> None:
    plan = Plan.from_string(PLANS[key]).resolve(4)
    predicted = _predicted(plan)
    assert any(k.endswith("@2") for k in predicted), "the plan should move CP bytes over a 2-rank group"
    for rank, by_plan in enumerate(counted):
        assert by_plan[key] == pytest.approx(predicted), f"{key}, rank {rank}"


@pytest.fixture(scope="module")
def mla_counted(dist) -> list[dict[str, dict[str, int]]]:
    return dist(4).run(_count_on_rank, MLA_PLANS, "deepseek_v3", timeout=600)


@pytest.mark.parametrize("key", sorted(MLA_PLANS))
def test_mla_cp_bytes_match_comm_counter(mla_counted, key: str) -> None:
    """What the ring, all-gather and Ulysses kinds move for MLA: K at qk_nope + qk_rope dims, V padded
    to them, one K/V head per query head. Every collective of the step (CP, FSDP of the dense block,
    the MoE block and its experts) byte for byte."""
    plan = Plan.from_string(MLA_PLANS[key]).resolve(4)
    predicted = _predicted(plan, _mla_config())
    assert any(k.endswith("@2") for k in predicted), "the plan should move CP bytes over a 2-rank group"
    for rank, by_plan in enumerate(mla_counted):
        assert by_plan[key] == pytest.approx(predicted), f"{key}, rank {rank}"


def test_cp_gradient_bytes_follow_the_reduce_dtype(counted) -> None:
    """The dK/dV traffic halves from fp32 to bf16 reduction while the K/V traffic does not change."""
    for kind, grad_key in (("zigzag", "send@2"), ("allgather", "reduce_scatter@2")):
        fp32 = counted[0][f"{kind}/bf16_reduce_fp32"]
        bf16 = counted[0][f"{kind}/bf16"]
        plan32 = Plan.from_string(PLANS[f"{kind}/bf16_reduce_fp32"]).resolve(4)
        grads = [c for c in est.communication(_config(), plan32, est.Workload(seq=SEQ, mbs=BATCH, microbatches=1),
                                              est.DEVICES["h100"], est.model_state(_config(), plan32), 1.0, 0.0)
                 if "dK/dV" in c.what]
        assert grads, kind
        saved = sum(c.calls * c.buffer for c in grads) / 2
        # full AC (the bf16 setting) re-sends K/V in recompute; selective does too: same K/V bytes
        assert fp32[grad_key] - bf16[grad_key] == pytest.approx(saved), kind


def test_plan_search_picks_the_cp_kind_the_numbers_favour() -> None:
    """The search estimates the zig-zag ring with and without kept K/V and the all-gather kind for every
    cp layout and keeps the faster that fits; which one depends on the plan (sequence, degrees, links),
    so more than one is chosen here, and each choice is the estimator's own argmin. Four layouts keep
    the search short."""
    config = est.load_config("llama3-8b")
    layouts = [Plan(cp=16), Plan(cp=8, tp=2), Plan(cp=4, tp=4), Plan(cp=2, dp_shard=8)]
    chosen = set()
    for seq in (8192, 32768):
        with mock.patch.object(plan_search, "layouts", lambda *_: layouts):
            result = plan_search.search(config, 16, seq, 16 * seq, "h100", top=100)
        assert len(result.plans) > 4, seq
        for cand in result.plans:
            mine = (cand.plan.cp_attention, cand.plan.cp_keep_kv)
            assert mine in plan_search.cp_kinds(cand.plan), cand.describe()
            for kind, keep in plan_search.cp_kinds(cand.plan):
                alt = est.estimate(config, dataclasses.replace(cand.plan, cp_attention=kind, cp_keep_kv=keep), 16,
                                   cand.workload, est.DEVICES["h100"])
                assert (cand.estimate.step_time, cand.estimate.peak_bytes) <= (alt.step_time, alt.peak_bytes) or \
                    alt.peak_bytes > plan_search.budget(est.DEVICES["h100"]), (cand.describe(), kind, keep)
            chosen.add(mine)
    assert ("zigzag", True) in chosen and len(chosen) > 1, chosen


def test_the_default_moves_the_fewest_cp_bytes(counted) -> None:
    """Counted, not estimated: with the kind and keep-K/V left open, the cp=2 run sends no more bytes
    on the cp axis than any kind set explicitly (here the kept-K/V zig-zag ring: GQA, short sequences)."""
    for dtype in ("fp32", "bf16_reduce_fp32"):
        cp_bytes = {k.split("/")[0]: sum(v for key, v in by_kind.items() if key.endswith("@2"))
                    for k, by_kind in counted[0].items() if k.endswith(f"/{dtype}") and "usp" not in k}
        others = {k: v for k, v in cp_bytes.items() if k != "auto"}
        assert len(others) >= 4, others
        assert cp_bytes["auto"] == min(others.values()), (dtype, cp_bytes)
    fp32 = counted[0]
    assert fp32["auto/fp32"]["send@2"] * 2 == fp32["zigzag/fp32"]["send@2"]  # the old default sent twice as much


def test_kept_kv_halves_the_ring_bytes_at_cp2(counted) -> None:
    """cp=2 without AC: forward K/V, backward K/V again and dK/dV a full turn (4 shards per layer)
    become forward K/V and one dK/dV message (2 shards): the all-gather kind's bytes."""
    for kind in ("ring", "zigzag"):
        assert counted[0][f"{kind}_keep/fp32"]["send@2"] * 2 == counted[0][f"{kind}/fp32"]["send@2"]
