"""The estimator on every supported family: its parameter count equals the built model's, the whole
estimate runs (Gemma-3's rotary per layer type, MLA, shared experts), and where the config names every
parameter the FLOP formula's active block parameters equal the ones measured on the model.

Stacks that mix dense and MoE blocks (DeepSeek-V3's `first_k_dense_replace`, Qwen2-MoE's
`mlp_only_layers` and `decoder_sparse_step`) are estimated block kind by block kind; their ground
truths are independent of the estimator: the built model's parameters (per pipeline stage too),
FlopCounterMode on a real training step of the whole model, and on a 4-rank CPU mesh the local shards
and CommCounter's bytes of a real `parallelize`d step.
"""

from __future__ import annotations

from fractions import Fraction
from unittest import mock

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import meshkit
from meshkit import metrics
from meshkit.estimate import DEVICES, Workload, estimate, model_state
from meshkit.estimate import moe as est_moe
from meshkit.estimate import search as plan_search
from meshkit.estimate.core import pipeline_timing, stage_weights
from meshkit.estimate.spec import load_config
from meshkit.models.moe import convert_moe_blocks, moe_spec
from meshkit.pipeline.schedules import build_schedule
from meshkit.pipeline.simulate import simulate
from meshkit.pipeline.split import split_layers
from meshkit.testing.families import FAMILY_FIELDS, MOE_KINDS, family_spec

# Uniform stacks: the MoE families' tiny configs with every block sparse.
UNIFORM = {"qwen2_moe": {"mlp_only_layers": []}, "deepseek_v3": {"first_k_dense_replace": 0}}
# Mixed stacks, as the published configs build them: (family, ModelSpec fields, config fields).
MIXED = {
    "deepseek_v3_first_dense": ("deepseek_v3", {"layers": 3}, {"first_k_dense_replace": 1}),
    "qwen2_moe_mlp_only": ("qwen2_moe", {"layers": 3}, {"mlp_only_layers": [0], "qkv_bias": False}),
    "qwen2_moe_sparse_step": ("qwen2_moe", {"layers": 4}, {"mlp_only_layers": [], "decoder_sparse_step": 2,
                                                            "qkv_bias": False}),
}


def _spec(kind: str, spec_fields: dict | None = None, **fields):
    spec = family_spec(kind, **(spec_fields or {}))
    spec.extra = tuple({**dict(spec.extra), **UNIFORM.get(kind, {}), **fields}.items())
    return spec


def _mixed(name: str):
    kind, spec_fields, fields = MIXED[name]
    return _spec(kind, spec_fields, **fields)


@pytest.mark.parametrize("kind", sorted(FAMILY_FIELDS))
def test_parameter_count_on_every_family(kind):
    spec = _spec(kind)
    measured = sum(p.numel() for p in spec.build(device="meta").parameters())
    assert model_state(spec.config(), meshkit.Plan()).params == measured


# The MoE estimates measure meshkit's MoE layer on real tensors: 30-90 s each on 2 loaded cores.
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in MOE_KINDS else k
                                  for k in sorted(FAMILY_FIELDS)])
def test_estimate_runs_on_every_family(kind):
    est = estimate(_spec(kind).config(), meshkit.Plan(), 1, Workload(seq=16))
    assert est.peak_bytes > 0 and est.flops.model > 0


def _active_block_params(model, config) -> int:
    """One MoE block's parameters as a token's matmuls touch them, counted on the built model."""
    block = model.model.layers[-1]
    total = sum(p.numel() for p in block.parameters())
    experts = sum(p.numel() for p in block.mlp.experts.parameters())
    spec = moe_spec(config)
    return total - experts + experts * spec.top_k // spec.num_experts


@pytest.mark.parametrize("kind, fields", [("deepseek_v3", {}), ("qwen2_moe", {"qkv_bias": False})])
def test_active_parameters_of_mla_and_shared_experts(kind, fields):
    """MLA's latent projections and norms, the shared expert and Qwen2-MoE's shared-expert gate are in
    the FLOP formula: its active block parameters equal the built block's."""
    spec = _spec(kind, **fields)
    config = spec.config()
    model = spec.build(device="meta")
    assert metrics.active_block_params(config, config.num_hidden_layers - 1) == _active_block_params(model, config)


def test_latent_down_projections_are_computed_whole_on_every_tp_rank():
    """Under tp every rank runs MLA's down-projections for the whole sequence: the step's compute time
    holds (tp - 1) more copies of their forward and backward FLOPs, each rank's share 1/tp, than it
    would if tp divided them (a dense DeepSeek-V3, so no MoE layer is measured)."""
    from meshkit.models import roles

    config = _spec("deepseek_v3", first_k_dense_replace=2).config()
    plan, workload, device = meshkit.Plan(tp=2), Workload(seq=16, microbatches=2), DEVICES["h100"]
    with_latents = estimate(config, plan, 2, workload).times["compute"]
    with mock.patch.object(roles, "tp_replicated_params", lambda _: 0):
        divided = estimate(config, plan, 2, workload).times["compute"]
    replicated = config.hidden_size * (config.q_lora_rank + config.kv_lora_rank + config.qk_rope_head_dim)
    share = workload.mbs * workload.seq / plan.tp / (device.peak_flops * workload.mfu)
    expected = workload.microbatches * 3 * 2 * replicated * (plan.tp - 1) * config.num_hidden_layers * share
    assert with_latents - divided == pytest.approx(expected, rel=1e-9)


# ----------------------------------------------------------------------- mixed dense and MoE stacks


def _stage_params(model, ranges: list[range]) -> list[int]:
    """Parameters of each pipeline stage of the built model: the embedding goes with the first stage,
    the final norm and LM head with the last, each block with the stage holding it."""
    count = [sum(p.numel() for b in r for p in model.model.layers[b].parameters()) for r in ranges]
    count[0] += model.model.embed_tokens.weight.numel()
    count[-1] += model.model.norm.weight.numel() + model.lm_head.weight.numel()
    return count


@pytest.mark.parametrize("name", sorted(MIXED))
def test_parameter_count_of_mixed_stacks(name):
    """Both block kinds are counted, each as often as the stack has it, and each pipeline stage holds
    the blocks of its own kinds (a dense first stage holds fewer parameters)."""
    spec = _mixed(name)
    config = spec.config()
    kinds = est_moe.block_kinds(config)
    assert {"dense", "moe"} <= set(kinds), kinds
    model = spec.build(device="meta")
    assert [type(b.mlp).__name__.endswith("MLP") for b in model.model.layers] == [k == "dense" for k in kinds]
    assert model_state(config, meshkit.Plan()).params == sum(p.numel() for p in model.parameters())
    plan = meshkit.Plan(pp=2, pp_microbatches=2)
    ranges = split_layers(config.num_hidden_layers, 2)
    held = [model_state(config, plan, pp_rank=r).params for r in range(2)]
    assert held == _stage_params(model, ranges)


def _norm_weights(config) -> int:
    """Norm weights the FLOP convention counts in N (they feed no matmul): two per block, MLA's two
    latent norms, the final norm."""
    latent = (config.q_lora_rank or 0) + config.kv_lora_rank if getattr(config, "kv_lora_rank", None) else 0
    return config.num_hidden_layers * (2 * config.hidden_size + latent) + config.hidden_size


@pytest.mark.parametrize("name", [n if n == "deepseek_v3_first_dense" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(MIXED)])
def test_flops_of_mixed_stacks_match_flop_counter(name):
    """The estimate's model FLOPs of a whole mixed stack equal FlopCounterMode's count of a real
    training step (eager attention; meshkit's MoE layers with the per-expert loop, so each routed
    token's expert matmuls are counted whatever the routing), less the norm weights in N."""
    spec = _mixed(name)
    config = spec.config()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = spec.build()
    model.config._attn_implementation = "eager"
    convert_moe_blocks(model, expert_backend="loop")
    seq = 16
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids).logits.float().logsumexp(-1).sum().backward()
    # what `estimate` reports as its model FLOPs (no recompute: AC none)
    formula = metrics.flops_per_token(spec.config(), seq).model * seq - 6 * _norm_weights(config) * seq
    assert counter.get_total_flops() == formula


@pytest.mark.parametrize("schedule, pp, v", [("1f1b", 2, 1), ("zb_h1", 3, 1), ("interleaved_1f1b", 2, 2), ("zb_h2", 3, 1),
                                           ("zb_v", 2, 2), ("dualpipe_v", 2, 2), ("dualpipe", 4, 2),
                                           ("zb_auto", 3, 1)])
def test_pipeline_with_unequal_stages_matches_full_simulation(schedule, pp, v):
    """Stages of different weights (a dense first stage, MoE stages after it): the extended
    simulation equals the full one, step time, bubble and in-flight peaks."""
    from meshkit.estimate.core import StageCosts

    weights = tuple(Fraction(1 + (s % 3), 2) for s in range(pp * v))
    for recompute in (Fraction(0), Fraction(1, 3)):
        for m in (4 * pp + 1, 6 * pp + 2):
            m += m % 2 if schedule == "dualpipe" else 0  # half the microbatches enter at each end
            timing = pipeline_timing(schedule, pp, m, v, recompute, weights)
            costs = StageCosts(1, 1 + recompute, 1, weights=weights)  # zb_auto is built for them
            full = simulate(build_schedule(schedule, pp, m, v, costs=costs), costs)
            assert timing.step_time == full.step_time, (schedule, pp, m, recompute)
            assert timing.bubble_fraction == full.bubble_fraction
            assert timing.peak_activations == full.peak_activations


def test_stage_weights_follow_the_block_kinds():
    """A dense first stage weighs less than the MoE stages; a uniform stack keeps equal stages."""
    config = _mixed("deepseek_v3_first_dense").config()
    plan = meshkit.Plan(pp=3, pp_microbatches=3)  # 3 blocks over 3 stages: embedding + block 0 (dense), ...
    weights = stage_weights(config, plan, 16)
    assert sum(weights) == pytest.approx(3, rel=1e-3) and weights[0] < weights[1]
    assert stage_weights(_spec("deepseek_v3").config(), plan, 16) is None


# DeepSeek-V3-shaped, small: MLA, 4 routed experts in 2 groups (1 kept) top-2 with a shared expert, the
# first 2 of 6 blocks dense (the published model: 256 experts in 8 groups, the first 3 of 61 blocks).
DEEPSEEK_SHAPED = dict(hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=6,
                       num_attention_heads=8, num_key_value_heads=8, q_lora_rank=96, kv_lora_rank=64,
                       qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
                       num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                       routed_scaling_factor=2.5, first_k_dense_replace=2, vocab_size=4096,
                       max_position_embeddings=4096, tie_word_embeddings=False)
# Layouts the search weighs (a few, to keep the test short; the full enumeration runs in the plan-search tests): experts
# over ep, a pipeline whose first stage holds the dense blocks, both, and tp (MLA split by heads).
SEARCH_LAYOUTS = [meshkit.Plan(dp_shard=8, ep=4), meshkit.Plan(pp=2, dp_shard=4),
                  meshkit.Plan(pp=2, dp_shard=4, ep=2), meshkit.Plan(tp=2, dp_shard=4, ep=2)]


def test_plan_search_on_a_deepseek_v3_shaped_stack():
    """Dense first blocks no longer stop the search: it returns expert-parallel, pipelined and tensor-
    parallel plans (MLA split by heads), each validates and fits its budget, the pipelined ones timed
    with stages of their own costs (here the dense blocks' wide MLPs make the first stage the heavier)."""
    import transformers

    config = transformers.AutoConfig.for_model("deepseek_v3", **DEEPSEEK_SHAPED)
    device = DEVICES["h100"].__class__("small", 989e12, 0.5 * 1024**3, 450e9, 50e9, gpus_per_node=4)
    with mock.patch.object(plan_search, "layouts", lambda *_, **__: SEARCH_LAYOUTS):
        result = plan_search.search(config, 8, 1024, 16 * 1024, device, top=500)
    assert {"ep+fsdp", "pp+fsdp", "pp+ep+fsdp", "tp+ep+fsdp"} <= set(result.best_by_family), result.rejected
    for cand in result.plans:
        cand.plan.validate(config, 8, 1024)
        assert cand.estimate.peak_bytes <= plan_search.budget(device)
        if cand.plan.pp > 1:
            weights = stage_weights(config, cand.plan, 1024)
            assert weights is not None and weights[0] != weights[-1], cand.describe()


def test_deepseek_v3_preset_has_the_published_size():
    """671B parameters (the multi-token-prediction module, not part of the HF model, aside)."""
    config = load_config("deepseek-v3")
    assert est_moe.block_kinds(config)[:4] == ("dense",) * 3 + ("moe",)
    assert model_state(config, meshkit.Plan()).params == pytest.approx(671e9, rel=0.01)


# ------------------------------------------------------------------------ on a 4-rank CPU mesh

# Experts split over ep and FSDP'd over the rest, on stacks with a dense first block: DeepSeek-V3 on one
# pipeline stage, Qwen2-MoE over two stages whose first holds only the dense block.
MESH_CASES = {
    "deepseek_v3_ep_fsdp": ("deepseek_v3_first_dense", "dp_shard=4,ep=2"),
    # MLA split by heads: up-projections colwise, o rowwise, the latent layers whole on every tp rank
    # with partial gradients (all-reduced over tp)
    "deepseek_v3_tp_ep": ("deepseek_v3_first_dense", "tp=2,dp_shard=2,ep=2"),
    "qwen2_moe_pp_ep": ("qwen2_moe_mlp_only", "pp=2,dp_shard=2,ep=2,pp_microbatches=2"),
}
MESH_BATCH, MESH_SEQ = 2, 16


def _measure_mixed(name: str, plan_text: str) -> dict:
    """One rank: the bytes CommCounter counts in a step, then its model state after AdamW's step."""
    from tests.estimate.rank_comm import counted_step, state_bytes

    spec = _mixed(name)
    config = spec.config()
    plan = meshkit.Plan.from_string(plan_text)
    model = spec.build()
    pm = meshkit.parallelize(model, plan)
    ids = torch.randint(0, config.vocab_size, (MESH_BATCH, MESH_SEQ), generator=torch.Generator().manual_seed(0))
    out = counted_step(pm, plan, ids)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    opt.step()
    out.update(state_bytes(pm, opt))
    return out


@pytest.fixture(scope="module")
def mixed_runs(dist) -> dict[str, list[dict]]:
    return {key: dist(4).run(_measure_mixed, name, plan) for key, (name, plan) in MESH_CASES.items()}


@pytest.mark.parametrize("key", sorted(MESH_CASES))
def test_mixed_stack_state_and_bytes_on_mesh(mixed_runs, key):
    """Every rank's parameter, gradient and AdamW bytes exactly; its FSDP, expert-FSDP and pipeline
    bytes exactly; the expert all-to-alls (only the MoE blocks') exactly in total over the ranks."""
    name, plan_text = MESH_CASES[key]
    config = _mixed(name).config()
    plan = meshkit.Plan.from_string(plan_text).resolve(4)
    workload = Workload(seq=MESH_SEQ, mbs=MESH_BATCH // plan.microbatches, microbatches=plan.microbatches)
    total_a2a = 0.0
    for rank, r in enumerate(mixed_runs[key]):
        state = model_state(config, plan, pp_rank=r["pp_rank"], tp_rank=r["tp_rank"], fsdp_rank=r["fsdp_rank"])
        assert (state.param_bytes, state.grad_bytes, state.optimizer_bytes) == (
            r["params"], r["grads"], r["optimizer"]), f"{key}, rank {rank}"
        predicted: dict[str, float] = {}
        for c in meshkit.estimate.communication(config, plan, workload, DEVICES["h100"], state, 1.0, 0.0):
            if c.axis == "pp_cp_tp":  # the input checks' batch signature: these runs check no inputs
                continue
            label = f"{c.kind}@{c.axis}"
            predicted[label] = predicted.get(label, 0) + c.calls * c.buffer
        # Groups that coincide get one name: with cp = 1 the FSDP group is dp_shard's, and with
        # ep = dp_shard x cp the ep group is the FSDP group. All-to-alls are the experts'.
        comm = {"all_to_all@ep" if k.startswith("all_to_all@") else
                k.replace("@dp_shard", "@dp_shard_cp") if k.endswith("@dp_shard") else k: v
                for k, v in r["comm"].items()}
        counted = {k: v for k, v in comm.items()
                   if k.split("@")[1] in ("tp", "dp_shard_cp", "dp_replicate", "ep", "ep_fsdp", "pp") and v > 64}
        if "send@pp" in counted:  # a pipeline exchange is one send and one receive of one buffer
            assert counted.pop("recv@pp") == counted["send@pp"]
            counted["p2p@pp"] = counted.pop("send@pp")
        total_a2a += counted.pop("all_to_all@ep", 0) - predicted.pop("all_to_all@ep", 0)
        assert counted == pytest.approx(predicted), f"{key}, rank {rank}: {counted} vs {predicted}"
    assert total_a2a == 0
