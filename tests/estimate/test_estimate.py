"""The estimator against what really happens: bytes of model state, saved activations, FLOPs, bytes moved.

Ground truths are independent of the estimator's machinery:
- model state: the local shards, gradients and AdamW state of a real `parallelize`d model on a
  4-rank CPU mesh (tp=2 x dp_shard=2, uneven FSDP shards included);
- activations: every storage created during a real forward that is still alive when the loss is
  computed (a dispatch mode records storages, weak references tell which survive), parameters
  excluded, under each AC mode, on one process and on the TP/SP mesh;
- FLOPs: torch's FlopCounterMode on a fake block of the real shape;
- communication: `comm_counter.CommCounter`'s count of the same training step.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests_support import CI_PROFILE, examples
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig, MixtralConfig

from meshkit import estimate as est
from meshkit.activation_checkpoint import AC_MODES
from meshkit.estimate import activations as acts
from meshkit.estimate import search as plan_search
from meshkit.estimate.__main__ import main as estimate_cli
from meshkit.plan import DTYPES, Plan
from meshkit.transport import shared_memory

SMALL = {
    "gqa": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256),
    "mha_tied": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=6,
                     num_key_value_heads=6, vocab_size=300, tie_word_embeddings=True),
    "mqa_head_dim": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, head_dim=24, vocab_size=200),
}
# Uneven FSDP shards on purpose: 35 gate rows per tp rank split 18/17, a 129-row vocabulary half 65/64.
MESH_MODEL = dict(hidden_size=48, intermediate_size=70, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=8, vocab_size=258)


# Mixtral-shaped: 4 experts of width 40, top-2; 2 experts per rank under ep=2.
MOE_MODEL = dict(hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=8, vocab_size=258, num_local_experts=4, num_experts_per_tok=2)


# DeepSeek-V3's multi-head latent attention, every block dense: 6 heads split 3/3 over tp=2, the latent
# layers whole on every tp rank.
MLA_MODEL = dict(hidden_size=48, intermediate_size=70, num_hidden_layers=2, num_attention_heads=6,
                 num_key_value_heads=6, vocab_size=258, q_lora_rank=16, kv_lora_rank=12, qk_rope_head_dim=4,
                 qk_nope_head_dim=8, v_head_dim=6, first_k_dense_replace=2)


def _config(kw: dict):
    if "kv_lora_rank" in kw:
        return DeepseekV3Config(max_position_embeddings=512, use_cache=False, head_dim=kw["qk_rope_head_dim"], **kw)
    if "num_local_experts" in kw:
        return MixtralConfig(max_position_embeddings=512, use_cache=False, sliding_window=None, **kw)
    return LlamaConfig(max_position_embeddings=512, use_cache=False, **kw)


def _model(config) -> torch.nn.Module:
    """The HF model, with its sparse blocks already meshkit MoE layers (what `parallelize` runs)."""
    from meshkit.models.moe import convert_moe_blocks

    model = AutoModelForCausalLM.from_config(config)
    convert_moe_blocks(model)
    return model


# ------------------------------------------------------------------- ground truth: live storages

def _wrappers() -> tuple[type, ...]:
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    return (DTensor, AsyncCollectiveTensor)


_WRAPPERS = _wrappers()


class _LiveStorages(TorchDispatchMode):
    """Weak references to every storage an op creates. Ops on tensor subclasses (DTensor, the
    functional collectives' AsyncCollectiveTensor) are declined, so the plain-tensor ops they lower
    to, which allocate the memory, come back here; a wrapper subclass's own storage holds no data."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, StorageWeakRef] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if any(issubclass(t, _WRAPPERS) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if type(t) in (torch.Tensor, torch.nn.Parameter):
                ref = StorageWeakRef(t.untyped_storage())
                self.refs[ref.cdata] = ref
        return out

    def live_bytes(self, exclude: set[int]) -> int:
        gc.collect()
        total = 0
        for key, ref in self.refs.items():
            if key not in exclude and not ref.expired():
                # current size: FSDP frees gathered parameters by resizing their storage to 0
                total += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        return total


def _keys(tensors) -> set[int]:
    out = set()
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        out.add(StorageWeakRef(local.untyped_storage()).cdata)
    return out


def _estimated_activations(config, *, batch: int, seq: int, tp: int, ac: str, dtype: str) -> int:
    kw = dict(batch=batch, seq=seq, tp=tp, dtype=dtype)
    blocks = config.num_hidden_layers * sum(est.block_activations(config, ac=ac, **kw).values())
    return blocks + acts.shared_activations(config, **kw) + sum(acts.head_activations(config, **kw).values())


# --------------------------------------------------------------------------- single process


def _measure_single(config, ac: str, batch: int, seq: int, dtype: torch.dtype, wrap=lambda model: model) -> int:
    """meshkit's forward on one process (its stage, AC wrapper and loss), live bytes at the loss;
    `wrap` makes the model what it trains (a PEFT LoRA model)."""
    from meshkit.activation_checkpoint import apply_activation_checkpointing
    from meshkit.models import llama
    from meshkit.models.stage import CausalLMStage
    from meshkit.step import loss as loss_lib

    torch.manual_seed(0)
    model = wrap(_model(config)).to(dtype)
    acts.pin_attention(model)
    parts = llama.parts(model)
    stage = CausalLMStage(dict(enumerate(apply_activation_checkpointing(parts.blocks, ac))), parts.rotary,
                          embed=parts.embed, norm=parts.norm, lm_head=parts.lm_head)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(seq).unsqueeze(0)
    targets = loss_lib.shift_labels(ids)
    mode = _LiveStorages()
    with mode:
        logits = stage(ids, positions)
        loss = loss_lib.summed_cross_entropy(logits, targets)
    live = mode.live_bytes(_keys(model.parameters()) | _keys([logits]))
    del logits
    loss.backward()  # the graph was real: backward must run
    return live


@pytest.mark.parametrize("name", sorted(SMALL) + ["moe"])
@pytest.mark.parametrize("ac", AC_MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activations_match_saved_tensors(name: str, ac: str, dtype: str) -> None:
    config = _config(MOE_MODEL if name == "moe" else SMALL[name])
    batch, seq = 2, 40
    measured = _measure_single(config, ac, batch, seq, DTYPES[dtype])
    estimated = _estimated_activations(config, batch=batch, seq=seq, tp=1, ac=ac, dtype=dtype)
    assert abs(estimated - measured) / measured < 0.10, (name, ac, dtype, estimated, measured)


# ------------------------------------------------------------------------------ on a CPU mesh


def _measure_on_rank(plan_text: str, model_kw: dict, batch: int, seq: int) -> dict:
    """One rank, one step: live activations at its loss and the bytes CommCounter counts in it, then
    the model state after AdamW's step (one step, not two: every collective's bytes are the same in a
    later step; only each rank's share of the MoE all-to-alls moves with the routing, not their total)."""
    import meshkit
    from meshkit.step import loss as loss_lib
    from tests.estimate.rank_comm import counted_step, state_bytes

    config = _config(model_kw)
    plan = Plan.from_string(plan_text)
    torch.manual_seed(0)
    model = _model(config)
    pm = meshkit.parallelize(model, plan)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(pm.dp_rank))
    measured: dict = {}
    original = loss_lib.summed_cross_entropy
    mode = _LiveStorages()

    def snapshot(logits, targets):  # runs inside forward_backward, once every activation exists
        loss = original(logits, targets)
        channels = _keys(shared_memory.mapped_buffers())  # the TP channel's slots: not activations
        measured["activations"] = mode.live_bytes(_keys(model.parameters()) | _keys([logits]) | channels)
        return loss

    loss_lib.summed_cross_entropy = snapshot
    try:
        with mode:
            measured.update(counted_step(pm, plan, ids))
    finally:
        loss_lib.summed_cross_entropy = original
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    opt.step()
    measured.update(state_bytes(pm, opt))
    return measured


# One counted run per plan on the same 4 ranks: TP/SP + FSDP under each AC mode, and TP without SP +
# HSDP in bf16 mixed precision.
MESH_PLANS = {ac: f"tp=2,dp_shard=2,activation_checkpointing={ac}" for ac in AC_MODES}
MESH_PLANS["hsdp_no_sp_bf16"] = ("tp=2,dp_replicate=2,sequence_parallel=false,param_dtype=bfloat16,"
                                 "activation_checkpointing=selective")
MESH_PLANS["cp_zigzag_selective"] = "cp=2,dp_shard=2,cp_attention=zigzag,activation_checkpointing=selective"
MESH_PLANS["cp_ulysses_full"] = "cp=2,dp_shard=2,cp_attention=ulysses,activation_checkpointing=full"
MESH_PLANS["cp_allgather"] = "cp=2,dp_shard=2,cp_attention=allgather"  # holds the gathered K/V for backward
MESH_PLANS["pp_interleaved_fsdp"] = "pp=2,dp_shard=2,pp_schedule=interleaved_1f1b,pp_virtual_stages=2,pp_microbatches=2"
MESH_PLANS["pp_tp_selective"] = "pp=2,tp=2,pp_microbatches=2,activation_checkpointing=selective"
MESH_PLANS["pp_tied_fsdp"] = "pp=2,dp_shard=2,pp_microbatches=2"  # the head holds a copy of the embedding
# Under the V both copies sit on pp rank 0 and are summed there: no all-reduce, rank 0 holds both.
MESH_PLANS["pp_zb_v_tied_fsdp"] = "pp=2,dp_shard=2,pp_schedule=zb_v,pp_microbatches=2"
# DualPipe: each rank holds two chunks, copies of its mirror's (2x parameters), both edges with the tied
# embedding's two copies on each; every gradient summed over the pair in one flat all-reduce.
MESH_PLANS["pp_dualpipe_tied_fsdp"] = "pp=2,dp_shard=2,pp_schedule=dualpipe,pp_microbatches=2"
# One K/V head under tp=2: tensor parallelism replicates it (each rank holds the whole K/V projections
# and computes its query heads' K/V rows), which a role table of plain colwise K/V would count as split.
MESH_PLANS["tp_replicated_kv"] = "tp=2,dp_shard=2"
# Multi-head latent attention under tp with SP and selective AC: the latent layers run whole on the
# gathered sequence (their saved tensors full length) and their partial gradients are all-reduced.
MESH_PLANS["tp_latent_attention"] = "tp=2,dp_shard=2,activation_checkpointing=selective"
# Only replicas: DDP's bucketed all-reduce (`data_parallel.replicate`), gradients resident in its buckets.
MESH_PLANS["replicate_only"] = "dp_replicate=4"
MESH_MODELS = {key: MESH_MODEL for key in MESH_PLANS} | {"tp_latent_attention": MLA_MODEL} | {
    key: MESH_MODEL | dict(tie_word_embeddings=True)
    for key in ("pp_tied_fsdp", "pp_zb_v_tied_fsdp", "pp_dualpipe_tied_fsdp")} | {
    "tp_replicated_kv": MESH_MODEL | dict(num_key_value_heads=1)}
MESH_BATCH, MESH_SEQ = 2, 16


def _mesh_workload(plan: Plan) -> est.Workload:
    return est.Workload(seq=MESH_SEQ, mbs=MESH_BATCH // plan.microbatches, microbatches=plan.microbatches)


@pytest.fixture(scope="module")
def mesh_runs(dist) -> dict[str, list[dict]]:
    return {key: dist(4).run(_measure_on_rank, plan, MESH_MODELS[key], MESH_BATCH, MESH_SEQ)
            for key, plan in MESH_PLANS.items()}


@pytest.mark.parametrize("key", ["none", "hsdp_no_sp_bf16", "replicate_only", "cp_zigzag_selective", "pp_interleaved_fsdp", "pp_tied_fsdp",
                                 "pp_zb_v_tied_fsdp", "pp_dualpipe_tied_fsdp", "tp_replicated_kv",
                                 "tp_latent_attention"])
def test_model_state_exact_on_mesh(mesh_runs, key: str) -> None:
    config, plan = _config(MESH_MODELS[key]), Plan.from_string(MESH_PLANS[key]).resolve(4)
    for rank, r in enumerate(mesh_runs[key]):
        state = est.model_state(config, plan, pp_rank=r["pp_rank"], tp_rank=r["tp_rank"], fsdp_rank=r["fsdp_rank"])
        assert (state.param_bytes, state.grad_bytes, state.optimizer_bytes) == (
            r["params"], r["grads"], r["optimizer"]), f"rank {rank}"
    if key == "none":
        assert len({r["params"] for r in mesh_runs[key]}) > 1, "the config should make FSDP shards uneven"


@pytest.mark.parametrize("key", sorted(k for k, v in MESH_PLANS.items() if "pp=" not in v))
def test_activations_on_mesh(mesh_runs, key: str) -> None:
    config, plan = _config(MESH_MODELS[key]), Plan.from_string(MESH_PLANS[key]).resolve(4)
    estimated = est.estimate(config, plan, 4, _mesh_workload(plan)).memory.activations
    for rank, r in enumerate(mesh_runs[key]):
        assert abs(estimated - r["activations"]) / r["activations"] < 0.10, (key, rank, estimated, r["activations"])


@pytest.mark.parametrize("key", sorted(MESH_PLANS))
def test_communication_matches_comm_counter(mesh_runs, key: str) -> None:
    """Every collective over tp and FSDP, byte for byte: SP all-gathers and reduce-scatters (with
    what recompute re-issues), norm-gradient and vocab-parallel-loss all-reduces, FSDP gathers and
    gradient reduce-scatters. Only the loss/token-count scalars over dp are left out."""
    config, plan = _config(MESH_MODELS[key]), Plan.from_string(MESH_PLANS[key]).resolve(4)
    for rank, r in enumerate(mesh_runs[key]):
        state = est.model_state(config, plan, pp_rank=r["pp_rank"], tp_rank=r["tp_rank"])
        predicted: dict[str, float] = {}
        for c in est.communication(config, plan, _mesh_workload(plan), est.DEVICES["h100"], state, 1.0, 0.0):
            if c.axis == "pp_cp_tp":  # the input checks' batch signature: these runs check no inputs
                continue
            # the tied copies' and DualPipe's pairs of pp ranks: the whole pp axis at pp=2
            label = f"{c.kind}@{'pp' if c.axis in ('pp_ends', 'pp_mirror') else c.axis}"
            predicted[label] = predicted.get(label, 0) + c.calls * c.buffer
        counted = {k: v for k, v in r["comm"].items()
                   if k.split("@")[1] in ("tp", "dp_shard_cp", "dp_replicate", "cp", "pp") and v > 64}  # no scalars
        for axis in ("cp", "pp"):  # a ring or pipeline exchange is one send and one receive of one buffer
            if f"send@{axis}" in counted:
                assert counted.pop(f"recv@{axis}") == counted[f"send@{axis}"]
                counted[f"p2p@{axis}"] = counted.pop(f"send@{axis}")
        assert counted == pytest.approx(predicted), f"{key}, rank {rank}"


# -------------------------------------------------------------------------- mixture of experts

# Experts split over ep and FSDP'd over the rest (fp32, AC none); TP with SP and per-rank routing under
# full and selective AC (selective keeps attention's reduce-scatter output; both re-run the dispatch
# all-to-alls); HSDP in bf16 with selective AC. Routing is whatever the random router does: per-rank
# all-to-all and expert activations vary with it, their sums over the ranks do not.
MOE_PLANS = {
    "moe_ep_fsdp": "dp_shard=4,ep=2",
    "moe_tp_ep_full": "tp=2,dp_shard=2,ep=2,activation_checkpointing=full",
    "moe_tp_ep_selective": "tp=2,dp_shard=2,ep=2,activation_checkpointing=selective",
    "moe_hsdp_ep_bf16": "dp_replicate=2,dp_shard=2,ep=2,param_dtype=bfloat16,activation_checkpointing=selective",
    "moe_one_expert_per_ep_rank": "dp_shard=4,ep=2",
}
# One expert per ep rank over two FSDP ranks: whole experts cannot be split evenly, so FSDP shards
# each expert's rows instead (dim 1), and every rank holds the same share.
MOE_MODELS = {key: MOE_MODEL for key in MOE_PLANS} | {
    "moe_one_expert_per_ep_rank": MOE_MODEL | dict(num_local_experts=2),
}


@pytest.fixture(scope="module")
def moe_runs(dist) -> dict[str, list[dict]]:
    return {key: dist(4).run(_measure_on_rank, plan, MOE_MODELS[key], MESH_BATCH, MESH_SEQ)
            for key, plan in MOE_PLANS.items()}


@pytest.mark.parametrize("key", sorted(MOE_PLANS))
def test_moe_model_state_exact_on_mesh(moe_runs, key: str) -> None:
    config, plan = _config(MOE_MODELS[key]), Plan.from_string(MOE_PLANS[key]).resolve(4)
    for rank, r in enumerate(moe_runs[key]):
        state = est.model_state(config, plan, pp_rank=r["pp_rank"], tp_rank=r["tp_rank"], fsdp_rank=r["fsdp_rank"])
        assert (state.param_bytes, state.grad_bytes, state.optimizer_bytes) == (
            r["params"], r["grads"], r["optimizer"]), f"{key}, rank {rank}"


@pytest.mark.parametrize("key", sorted(MOE_PLANS))
def test_moe_activations_on_mesh(moe_runs, key: str) -> None:
    """Uniform routing is exact on average over the ranks; each rank within 10% of it as well."""
    config, plan = _config(MOE_MODELS[key]), Plan.from_string(MOE_PLANS[key]).resolve(4)
    estimated = est.estimate(config, plan, 4, _mesh_workload(plan)).memory.activations
    measured = [r["activations"] for r in moe_runs[key]]
    assert abs(estimated - sum(measured) / 4) / (sum(measured) / 4) < 0.10, (key, estimated, measured)


@pytest.mark.parametrize("key", sorted(MOE_PLANS))
def test_moe_communication_matches_comm_counter(moe_runs, key: str) -> None:
    """tp, FSDP, expert-FSDP and HSDP bytes exact on every rank; the expert-parallel all-to-alls exact
    in total over the ranks (each rank sends T*K rows; what it receives depends on the routing)."""
    config, plan = _config(MOE_MODELS[key]), Plan.from_string(MOE_PLANS[key]).resolve(4)
    total_a2a = 0.0
    for rank, r in enumerate(moe_runs[key]):
        state = est.model_state(config, plan, pp_rank=r["pp_rank"], tp_rank=r["tp_rank"], fsdp_rank=r["fsdp_rank"])
        predicted: dict[str, float] = {}
        for c in est.communication(config, plan, _mesh_workload(plan), est.DEVICES["h100"], state, 1.0, 0.0):
            if c.axis == "pp_cp_tp":  # the input checks' batch signature: these runs check no inputs
                continue
            # the tied copies' and DualPipe's pairs of pp ranks: the whole pp axis at pp=2
            label = f"{c.kind}@{'pp' if c.axis in ('pp_ends', 'pp_mirror') else c.axis}"
            predicted[label] = predicted.get(label, 0) + c.calls * c.buffer
        # With ep = dp_shard x cp the ep group is the FSDP group (CommCounter names it dp_shard_cp):
        # all-to-alls are the experts' here (no Ulysses).
        comm = {"all_to_all@ep" if k.startswith("all_to_all@") else k: v for k, v in r["comm"].items()}
        counted = {k: v for k, v in comm.items()
                   if k.split("@")[1] in ("tp", "dp_shard_cp", "dp_replicate", "ep", "ep_fsdp") and v > 64}
        total_a2a += counted.pop("all_to_all@ep") - predicted.pop("all_to_all@ep")
        assert counted == pytest.approx(predicted), f"{key}, rank {rank}: {counted} vs {predicted}"
    assert total_a2a == 0


# ------------------------------------------------------------------------------------ pipeline


@pytest.mark.parametrize("schedule,pp,v", [("1f1b", 2, 1), ("1f1b", 4, 1), ("zb_h1", 3, 1), ("zb_h1", 4, 1),
                                           ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 4, 2), ("zb_h2", 3, 1),
                                           ("zb_v", 3, 2), ("dualpipe_v", 2, 2), ("dualpipe", 2, 2),
                                           ("dualpipe", 4, 2), ("zb_auto", 3, 1)])
def test_pipeline_timing_extends_the_simulation_exactly(schedule: str, pp: int, v: int) -> None:
    from fractions import Fraction

    from meshkit.pipeline.schedules import build_schedule
    from meshkit.pipeline.simulate import Costs, simulate

    for recompute in (Fraction(0), Fraction(1, 3)):
        for m in (4 * pp + 1, 5 * pp + 2, 6 * pp):
            m += m % 2 if schedule == "dualpipe" else 0  # half the microbatches enter at each end
            timing = est.pipeline_timing(schedule, pp, m, v, recompute)
            costs = Costs(1, 1 + recompute, 1)  # zb_auto is built for them
            full = simulate(build_schedule(schedule, pp, m, v, costs=costs), costs)
            assert timing.step_time == full.step_time, (schedule, pp, m, recompute)
            assert timing.bubble_fraction == full.bubble_fraction
            assert timing.peak_activations == full.peak_activations


@pytest.mark.parametrize("kind", ["gqa", "mha_tied"])
def test_dualpipe_holds_its_mirrors_chunks_too(kind: str) -> None:
    """DualPipe's parameter, gradient and optimizer memory on pp rank r is what 1F1B puts on ranks r and
    pp-1-r together (each chunk on two ranks: 2x per rank, as DeepSeek-V3's report says)."""
    config = _config(dict(SMALL[kind], num_hidden_layers=6))
    one_f = Plan(pp=4, pp_microbatches=8).resolve(4)
    dual = Plan(pp=4, pp_schedule="dualpipe", pp_microbatches=8).resolve(4)
    for r in range(4):
        mine, mirror = est.model_state(config, one_f, pp_rank=r), est.model_state(config, one_f, pp_rank=3 - r)
        state = est.model_state(config, dual, pp_rank=r)
        assert state.params == mine.params + mirror.params
        assert state.optimizer_bytes == mine.optimizer_bytes + mirror.optimizer_bytes
    whole = est.estimate(config, dual, 4, est.Workload(seq=256, mbs=1, microbatches=8))
    assert any("DualPipe" in c.what for c in whole.comm)


def test_zb_auto_bubble_is_the_simulators_at_the_devices_costs() -> None:
    """The estimate's zb_auto bubble is that of the schedule zb_auto builds at the device's F/B/W (from
    FLOPs, full AC's recompute in B) within the plan's memory limit; more memory, less bubble."""
    from fractions import Fraction

    from meshkit import metrics
    from meshkit.pipeline.schedules import build_schedule
    from meshkit.pipeline.simulate import Costs, simulate

    config = _config(dict(SMALL["gqa"], num_hidden_layers=6))
    workload = est.Workload(seq=256, mbs=1, microbatches=8)
    bubbles = []
    for limit in (2, 4, 7):
        plan = Plan(pp=4, pp_schedule="zb_auto", pp_microbatches=8, pp_memory_limit=limit,
                    activation_checkpointing="full").resolve(4)
        estimate = est.estimate(config, plan, 4, workload)
        flops = metrics.flops_per_token(config, 256, "full")
        recompute = Fraction(3 * flops.recompute / flops.model).limit_denominator(8)
        costs = Costs(1, 1 + recompute, 1)
        expected = simulate(build_schedule("zb_auto", 4, 8, costs=costs, memory_limit=limit), costs)
        assert estimate.sim.bubble_fraction == expected.bubble_fraction
        assert max(estimate.sim.peak_activations) <= limit
        bubbles.append(estimate.sim.bubble_fraction)
    assert bubbles[0] > bubbles[1] >= bubbles[2]


def test_plan_search_tries_dualpipe_and_zb_auto() -> None:
    import dataclasses

    config = _config(SEARCH_MODEL)
    device = dataclasses.replace(est.DEVICES["h100"], memory_bytes=4096 * 2**20)
    result = plan_search.search(config, 8, 512, 64 * 512, device, top=2000)
    schedules = {c.plan.pp_schedule for c in result.plans if c.plan.pp > 1}
    assert {"dualpipe", "zb_auto"} <= schedules, schedules


# --------------------------------------------------------------------------------------- FLOPs


@pytest.mark.parametrize("name", sorted(SMALL))
def test_flop_formula_matches_flop_counter(name: str) -> None:
    counted, formula = est.flop_counter_check(_config(SMALL[name]), 37)
    assert counted == formula


def test_flop_check_leaves_the_moe_layer_out_on_both_sides() -> None:
    counted, formula = est.flop_counter_check(_config(MOE_MODEL), 37)
    assert counted == formula


def test_flop_counter_at_llama3_8b_shape() -> None:
    counted, formula = est.flop_counter_check(est.load_config("llama3-8b"), 2048)
    assert counted == formula


# ------------------------------------------------------------------------------------- presets


def test_presets_have_the_published_sizes() -> None:
    """Parameter counts of the real checkpoints: 8.03B, 70.6B, 405.9B (1.24B tied)."""
    sizes = {"llama3.2-1b": 1.24e9, "llama3-8b": 8.03e9, "llama3-70b": 70.55e9, "llama3-405b": 405.85e9}
    for name, expected in sizes.items():
        config = est.load_config(name)
        state = est.model_state(config, Plan())
        total = state.params
        assert abs(total - expected) / expected < 0.005, (name, total)


def test_moe_presets_have_the_published_sizes() -> None:
    """Mixtral-8x7B: 46.7B parameters, 12.9B active; Qwen3-30B-A3B: 30.5B, 3.3B active (embeddings in)."""
    from meshkit import metrics

    for name, total, active in (("mixtral-8x7b", 46.70e9, 12.88e9), ("qwen3-30b-a3b", 30.53e9, 3.35e9)):
        config = est.load_config(name)
        params = est.model_state(config, Plan()).params
        assert abs(params - total) / total < 0.005, (name, params)
        n_active = metrics.nonembedding_params(config) + config.vocab_size * config.hidden_size
        assert abs(n_active - active) / active < 0.01, (name, n_active)


def test_playbook_zero_formulas() -> None:
    config = est.load_config("llama3-8b")
    state = est.model_state(config, Plan(dp_shard=8))
    psi = 8.03e9
    assert state.zero["ZeRO-3"] == pytest.approx(16 * psi / 8, rel=0.01)
    assert state.zero["ZeRO-1"] == pytest.approx(4 * psi + 12 * psi / 8, rel=0.01)
    assert state.persistent == pytest.approx(state.zero["ZeRO-3"], rel=0.001)


def test_cli_prints_every_section(capsys) -> None:
    assert estimate_cli(["--model", "llama3-8b", "--plan", "tp=8,dp_shard=-1", "--world", "64", "--seq", "8192",
                         "--mbs", "1", "--ac", "selective", "--no-flop-check"]) == 0
    out = capsys.readouterr().out
    for needle in ("parameters", "gradients", "optimizer", "activations held", "peak", "FLOPs", "dp_shard_cp",
                   "tp ", "step time"):
        assert needle in out, needle


# --------------------------------------------------------------------------------- plan search


SEARCH_MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=4096)


@examples(ci=3)
@given(world=st.sampled_from([4, 8, 16, 32]), seq=st.sampled_from([512, 1024, 2048]),
       memory_mib=st.sampled_from([48, 128, 512, 4096]), batch_seqs=st.sampled_from([8, 32, 128]))
def test_plan_search_returns_valid_plans_that_fit(world, seq, memory_mib, batch_seqs) -> None:
    import dataclasses


    config = _config(SEARCH_MODEL)
    device = dataclasses.replace(est.DEVICES["h100"], memory_bytes=memory_mib * 2**20)
    result = plan_search.search(config, world, seq, batch_seqs * seq, device, top=5)
    for cand in result.plans:
        cand.plan.validate(config, world, seq)
        again = est.estimate(config, cand.plan, world, cand.workload, device)
        assert again.peak_bytes <= plan_search.budget(device)
        assert math.isclose(again.step_time, cand.estimate.step_time)
        assert cand.workload.global_tokens(cand.plan) == pytest.approx(batch_seqs * seq, rel=0.25)
    assert result.plans or result.rejected
    times = [c.estimate.step_time for c in result.plans]
    assert times == sorted(times)


@settings(deadline=None, max_examples=3 if CI_PROFILE else 6)
@given(world=st.sampled_from([4, 8]), memory_mib=st.sampled_from([24, 64, 1024]))
def test_plan_search_moe_returns_valid_expert_parallel_plans(world, memory_mib) -> None:
    import dataclasses


    config = _config(dict(MOE_MODEL, hidden_size=128, intermediate_size=256, num_attention_heads=8,
                          num_key_value_heads=4, head_dim=16, num_local_experts=8, vocab_size=2048))
    device = dataclasses.replace(est.DEVICES["h100"], memory_bytes=memory_mib * 2**20)
    result = plan_search.search(config, world, 512, 32 * 512, device, top=50)
    for cand in result.plans:
        cand.plan.validate(config, world, 512)
        assert config.num_local_experts % cand.plan.ep == 0 and (cand.plan.dp_shard * cand.plan.cp) % cand.plan.ep == 0
        assert est.estimate(config, cand.plan, world, cand.workload, device).peak_bytes <= plan_search.budget(device)
    families = set(result.best_by_family) | set(result.rejected)
    assert any("ep" in f for f in families), families


def test_plan_search_explains_rejections() -> None:
    """A budget nothing fits: every family is listed with the smallest peak it reached."""
    import dataclasses


    device = dataclasses.replace(est.DEVICES["h100"], memory_bytes=2**20)
    result = plan_search.search(_config(SEARCH_MODEL), 8, 1024, 64 * 1024, device)
    assert not result.plans
    assert "fsdp" in result.rejected and "nothing fits" in result.rejected["fsdp"]
