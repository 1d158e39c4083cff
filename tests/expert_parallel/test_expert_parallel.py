"""Expert parallelism through `parallelize` on Llama-MoE models (MLPs swapped for meshkit MoE):
ep folded over dp_shard x cp, alone and with HSDP, TP (attention), CP, PP and activation
checkpointing, gives the single-device loss, gradients and parameters after two steps."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests_support import assert_matches_reference, examples
from torch.distributed.tensor import DTensor

import meshkit
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

MOE = ModelSpec(layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=16, vocab=64, experts=4, top_k=2)


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec, meta_init: bool = False):
    return dataclasses.asdict(compare_training(plan, model, batch, meta_init=meta_init))


@pytest.mark.parametrize(
    "plan, world",
    [
        ("dp_shard=2,ep=2", 2),
        ("dp_shard=4,ep=4", 4),
        ("dp_shard=4,ep=2", 4),
        ("dp_replicate=2,dp_shard=2,ep=2", 4),
        ("dp_shard=2,tp=2,ep=2", 4),
        ("dp_shard=2,cp=2,ep=4", 4),
        ("pp=2,dp_shard=2,ep=2,pp_schedule=zb_h1", 4),
        ("dp_shard=2,tp=2,ep=2,activation_checkpointing=selective", 4),
        ("dp_shard=4,ep=2,activation_checkpointing=full", 4),
        ("dp_shard=4,ep=2,activation_checkpointing=selective", 4),  # once crashed in backward (test_moe_selective_ac)
        ("dp_shard=4,ep=2/2 experts", 4),  # FSDP splits each expert's rows (Shard(1)): fewer experts than ranks
        ("dp_replicate=2,dp_shard=2/3 experts", 4),  # HSDP, 3 experts over 2 FSDP ranks: Shard(1)
    ],
)
def test_expert_parallel_plans_match_single_device(dist, plan, world):
    plan, _, experts = plan.partition("/")
    degrees = meshkit.Plan.from_string(plan)
    batch = BatchSpec(batch=2 * degrees.dp_shard * degrees.dp_replicate, seq=8, ignore=0.2)
    model = dataclasses.replace(MOE, shared_expert=8 if "tp" in plan else 0,
                                experts=int(experts.split()[0]) if experts else MOE.experts)
    results = dist(world).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, plan)


@st.composite
def ep_cases(draw):
    world = draw(st.sampled_from([4, 8]))
    ep = draw(st.sampled_from([2, 4]))
    cp = draw(st.sampled_from([1, 2]))
    tp = draw(st.sampled_from([1, 2])) if world == 8 else 1
    dp_shard = world // (cp * tp)
    if (dp_shard * cp) % ep:
        ep = 2
    experts = ep * draw(st.sampled_from([1, 2, 3]))  # 3: FSDP splits expert rows when E/ep is odd
    model = dataclasses.replace(MOE, experts=experts, top_k=draw(st.sampled_from([1, 2])),
                                shared_expert=draw(st.sampled_from([0, 8])), seed=draw(st.integers(0, 99)))
    plan = f"dp_shard={dp_shard},cp={cp},tp={tp},ep={ep}"
    batch = BatchSpec(batch=dp_shard * draw(st.sampled_from([1, 2])), seq=8 * cp, ignore=0.3,
                      seed=draw(st.integers(0, 99)))
    return world, plan, model, batch


@examples(ci=3)
@given(ep_cases())
def test_random_expert_parallel_plans(dist, case):
    world, plan, model, batch = case
    results = dist(world).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, f"{plan} on {model}")


def test_meta_device_moe_model(dist):
    results = dist(4).run(_compare_on_rank, "dp_shard=4,ep=2", MOE, BatchSpec(batch=4, seq=8), meta_init=True)
    assert_matches_reference(results, "meta init with ep")


def _experts_held(plan: str, model: ModelSpec) -> list[tuple[int, ...]]:
    pm = meshkit.parallelize(model.build(), meshkit.Plan.from_string(plan))
    experts = pm.model.model.layers[0].mlp.experts
    return [tuple(p.to_local().shape) for p in (experts.gate_up_proj, experts.down_proj)]


@pytest.mark.parametrize(
    "plan, experts, held",
    [
        # 4 experts over ep=4, FSDP over the dp_shard_cp/ep = 1 remaining rank: one whole expert each.
        ("dp_shard=4,ep=4", 4, [(1, 32, 32), (1, 32, 16)]),
        # 2 experts per FSDP pair: one whole expert each.
        ("dp_shard=4,ep=2", 4, [(1, 32, 32), (1, 32, 16)]),
        # One expert per ep rank over 2 FSDP ranks, and 2 experts over 4 FSDP ranks: whole experts
        # would leave ranks empty, so each expert's rows are split (FSDP Shard(1)).
        ("dp_shard=4,ep=2", 2, [(1, 16, 32), (1, 16, 16)]),
        ("dp_shard=4", 2, [(2, 8, 32), (2, 8, 16)]),
        ("dp_replicate=2,dp_shard=2,ep=2", 2, [(1, 32, 32), (1, 32, 16)]),
        ("dp_replicate=2,dp_shard=2", 3, [(3, 16, 32), (3, 16, 16)]),
    ],
)
def test_each_rank_holds_an_equal_share_of_experts(dist, plan, experts, held):
    model = dataclasses.replace(MOE, experts=experts)
    assert dist(4).run(_experts_held, plan, model) == [held] * 4


def _bad(plan: str, model: ModelSpec) -> None:
    meshkit.parallelize(model.build(), meshkit.Plan.from_string(plan))


@pytest.mark.parametrize(
    "plan, model, message",
    [
        ("dp_shard=4,ep=3", MOE, "ep=3: expert parallelism folds over dp_shard x cp = 4"),
        ("dp_shard=4,ep=4", dataclasses.replace(MOE, experts=6), "does not divide num_experts=6"),
        ("dp_shard=4,ep=2", dataclasses.replace(MOE, experts=0), "no meshkit MoE layers"),
        ("dp_shard=2,tp=2,sequence_parallel=false", MOE, "needs sequence_parallel=true"),
    ],
)
def test_bad_expert_plans_fail_on_every_rank(dist, plan, model, message):
    for o in dist(4).run_raw(_bad, plan, model, timeout=30):
        assert isinstance(o.value, ValueError) and message in o.message, o


def _bias_updates() -> list[float]:
    model = dataclasses.replace(MOE, bias_update_rate=1e-2).build()
    pm = meshkit.parallelize(model, meshkit.Plan(dp_shard=4, ep=2))
    ids, labels = BatchSpec(batch=4, seq=8).make(MOE.vocab)
    mine = slice(pm.dp_rank, pm.dp_rank + 1)
    pm.forward_backward(ids[mine], labels[mine])
    pm.update_expert_biases()
    return [b.mlp.expert_bias.tolist() for b in model.model.layers]


def test_router_bias_updates_are_identical_on_every_rank(dist):
    results = dist(4).run(_bias_updates)
    assert all(r == results[0] for r in results)
    assert any(v != 0 for layer in results[0] for v in layer)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("plan", ["dp_shard=4,ep=2", "dp_shard=2,tp=2,ep=2", "dp_shard=2,cp=2,ep=4,cp_attention=ulysses"])
def test_hf_moe_models_match_the_unconverted_hf_model(dist, kind, plan):
    # The reference is HF's own model with its own sparse blocks; the sharded copy is converted.
    model = dataclasses.replace(MOE, kind=kind)
    degrees = meshkit.Plan.from_string(plan)
    batch = BatchSpec(batch=2 * degrees.dp_shard, seq=8)
    results = dist(4).run(_compare_on_rank, plan, model, batch)
    assert_matches_reference(results, f"{kind} {plan}")


def _aux_loss(kind: str) -> tuple[float, float]:
    spec = dataclasses.replace(MOE, kind=kind)
    ref, model = spec.build(), spec.build()
    for m in (ref, model):
        m.config.output_router_logits = True
        m.config.router_aux_loss_coef = m.router_aux_loss_coef = 0.05  # HF reads it once, at construction
    ids, labels = BatchSpec(batch=4, seq=8).make(spec.vocab)
    ref_loss = ref(input_ids=ids, labels=labels, use_cache=False).loss
    pm = meshkit.parallelize(model, meshkit.Plan(dp_shard=4, ep=2))
    mine = slice(pm.dp_rank, pm.dp_rank + 1)
    loss = pm.forward_backward(ids[mine], labels[mine])
    ref_loss.backward()
    refp = dict(ref.named_parameters())
    err = max(((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - refp[n].grad).abs().max().item()
              for n, p in pm.named_parameters())
    return abs(loss.item() - ref_loss.item()), err


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_hf_auxiliary_loss_when_the_config_asks_for_it(dist, kind):
    for loss_err, grad_err in dist(4).run(_aux_loss, kind):
        assert loss_err < 1e-5 and grad_err < 2e-6, (loss_err, grad_err)
