"""PEFT LoRA models under meshkit plans against the single-device PeftModel: the loss, every adapter
gradient and the parameters after AdamW steps, with the base weights frozen (never a gradient, never
trainable again after TP: NeMo AutoModel #547). B starts non-zero (`LoraSpec.b_nonzero`), so A's
gradient is checked from the first step. A property test draws plans and LoRA configs; explicit cases
pin both TP paths (local shards, DTensor styles with the zero-bubble B/W split), and the matrix (every
CP kind, HSDP, AC, ZeRO, offload, every schedule, EP MoE, families with biases, meta init) runs slow."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tests_support import assert_matches_reference, examples
from torch.distributed.tensor import DTensor, Shard

import meshkit
from meshkit.pipeline import weight_grad
from meshkit.testing.reference import LLAMA_LINEARS, BatchSpec, LoraSpec, ModelSpec, compare_training

LORA = LoraSpec()
ATTENTION = LoraSpec(targets=("q_proj", "k_proj", "v_proj", "o_proj"))
# attention everywhere and the MLP of the dense block 1 (block 0's MoE and its shared expert are refused)
DENSE_MLP_AND_ATTENTION = LoraSpec(targets=r".*(self_attn\.[qkvo]_proj|layers\.1\.mlp\.(gate|up|down)_proj)")


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec, meta_init: bool = False):
    return dataclasses.asdict(compare_training(plan, model, batch, meta_init=meta_init))


@st.composite
def lora_cases(draw):
    """A plan over 4 ranks (pp, dp_replicate/dp_shard, cp, tp; schedules, CP kinds, AC, ZeRO) and a LoRA
    config (r, alpha, targets, rsLoRA) on a tiny Llama, tied or not, built on CPU or on meta."""
    pp, cp, tp = (draw(st.sampled_from([1, 2])) for _ in range(3))
    if pp * cp * tp > 4:
        pp = 1
    dp = 4 // (pp * cp * tp)
    replicate = 2 if dp == 4 and draw(st.booleans()) else 1
    schedule, v = draw(st.sampled_from([("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1),
                                        ("zb_v", 2)])) if pp > 1 else ("1f1b", 1)
    kind = draw(st.sampled_from(["ring", "zigzag", "ulysses", "allgather"])) if cp > 1 else "zigzag"
    plan = (f"pp={pp},dp_replicate={replicate},dp_shard={dp // replicate},cp={cp},tp={tp},pp_schedule={schedule},"
            f"pp_virtual_stages={1 if schedule == 'zb_v' else v},pp_microbatches={2 if pp > 1 else 1},"
            f"cp_attention={kind},activation_checkpointing={draw(st.sampled_from(['none', 'selective', 'full']))},"
            f"zero={draw(st.sampled_from([1, 2, 3]))}")
    targets = tuple(t for t in LLAMA_LINEARS if draw(st.booleans())) or ("o_proj",)
    lora = LoraSpec(r=draw(st.sampled_from([1, 2, 4, 8])), alpha=draw(st.sampled_from([1, 4, 16])),
                    targets=targets, rslora=draw(st.booleans()))
    model = ModelSpec(layers=max(2, pp * v), tied=draw(st.booleans()), seed=draw(st.integers(0, 99)), lora=lora)
    multiple = meshkit.Plan.from_string(plan).seq_multiple()
    batch = BatchSpec(batch=4, seq=max(8, multiple), ignore=0.3, seed=draw(st.integers(0, 99)))
    return plan, model, batch, draw(st.booleans())  # meta init: load_full_state_dict under PEFT's names


@examples(ci=2)
@given(lora_cases())
def test_random_plans_and_lora_configs(dist, case):
    plan, model, batch, meta_init = case
    results = dist(4).run(_compare_on_rank, plan, model, batch, meta_init)
    assert_matches_reference(results, f"{plan} with {model.lora}")


CASES = [
    # CI: the local-shard TP path (f/g ops) with SP, and the DTensor styles under the zero-bubble B/W split
    pytest.param("tp=2,dp_shard=2", ModelSpec(lora=LORA), 8, False, id="tp2-sp-local"),
    pytest.param("pp=2,tp=2,pp_schedule=zb_h1,pp_microbatches=2", ModelSpec(lora=LORA), 8, True, id="pp2-tp2-zbh1"),
    # CI: DDP (a plan that only replicates) with frozen weights, set up at the first forward after meta init
    pytest.param("dp_replicate=4", ModelSpec(lora=LORA), 8, True, id="ddp-meta-init"),
    # slow (tests/ci_subset.py names the CI case covering each)
    pytest.param("tp=2,dp_shard=2,sequence_parallel=false", ModelSpec(lora=LORA), 8, False, id="tp2-no-sp"),
    pytest.param("dp_replicate=2,dp_shard=2", ModelSpec(lora=LORA), 8, True, id="hsdp"),
    pytest.param("cp=2,tp=2,cp_attention=ulysses", ModelSpec(lora=LORA), 16, False, id="cp2-tp2-ulysses"),
    pytest.param("cp=2,dp_shard=2,cp_attention=ring", ModelSpec(lora=LORA), 16, False, id="cp2-ring"),
    pytest.param("cp=2,dp_shard=2,cp_attention=allgather", ModelSpec(lora=LORA), 16, False, id="cp2-allgather"),
    pytest.param("cp=4,cp_attention=usp,cp_ulysses=2", ModelSpec(lora=LORA), 16, False, id="cp4-usp"),
    pytest.param("tp=2,dp_shard=2,activation_checkpointing=selective", ModelSpec(lora=LORA), 8, False, id="tp2-sac"),
    pytest.param("pp=2,dp_shard=2,activation_checkpointing=full", ModelSpec(lora=LORA), 8, False, id="pp2-full-ac"),
    pytest.param("dp_shard=4,zero=1", ModelSpec(lora=LORA), 8, False, id="zero1"),
    pytest.param("dp_shard=4,zero=2", ModelSpec(lora=LORA), 8, False, id="zero2"),
    pytest.param("dp_shard=4,offload=params", ModelSpec(lora=LORA), 8, True, id="offload-params"),
    pytest.param("pp=2,dp_shard=2,pp_schedule=interleaved_1f1b,pp_virtual_stages=2,pp_microbatches=2",
                 ModelSpec(layers=4, lora=LORA), 8, False, id="pp2-interleaved"),
    pytest.param("pp=2,dp_shard=2,pp_schedule=gpipe,pp_microbatches=2", ModelSpec(tied=True, lora=LORA), 8, False,
                 id="pp2-gpipe-tied"),
    pytest.param("pp=2,tp=2,pp_schedule=zb_v,pp_microbatches=2", ModelSpec(layers=4, lora=LORA), 8, False,
                 id="pp2-zbv"),
    pytest.param("pp=2,tp=2,pp_schedule=dualpipe_v,pp_microbatches=4", ModelSpec(layers=4, lora=LORA), 8, False,
                 id="pp2-dualpipev"),
    pytest.param("pp=2,tp=2,pp_schedule=zb_h2,pp_microbatches=4", ModelSpec(lora=LORA), 8, False, id="pp2-zbh2"),
    pytest.param("dp_shard=2,tp=2,ep=2", ModelSpec(kind="mixtral", experts=4, intermediate=16, lora=ATTENTION), 8,
                 True, id="mixtral-ep2-tp2"),
    pytest.param("dp_shard=2,tp=2,ep=2,activation_checkpointing=selective",
                 ModelSpec(kind="qwen2_moe", experts=4, intermediate=16, extra=(("mlp_only_layers", [1]),),
                           lora=DENSE_MLP_AND_ATTENTION), 8, False, id="qwen2moe-dense-mlp-ep2"),
    pytest.param("tp=2,dp_shard=2", ModelSpec(kind="qwen2", lora=LORA), 8, False, id="qwen2-biases"),
    pytest.param("dp_shard=4,compile=true", ModelSpec(layers=1, lora=LORA), 8, False, id="compiled-fsdp"),
    pytest.param("pp=2,tp=2,pp_schedule=dualpipe,pp_microbatches=4", ModelSpec(tied=True, layers=4, lora=LORA),
                 8, True, id="pp2-dualpipe-tied"),
    pytest.param("pp=2,tp=2,pp_schedule=zb_auto,pp_microbatches=4", ModelSpec(layers=4, lora=LORA), 8, False,
                 id="pp2-zb-auto"),
]


@pytest.mark.parametrize(("plan", "model", "seq", "meta_init"), CASES)
def test_lora_plans(dist, plan, model, seq, meta_init):
    results = dist(4).run(_compare_on_rank, plan, model, BatchSpec(batch=4, seq=seq), meta_init)
    assert_matches_reference(results, plan)


def _frozen_on_rank(plan: str):
    """Frozen weights: still FSDP-sharded, no gradient, and (zero bubble) no deferred W work."""
    pm = meshkit.parallelize(ModelSpec(lora=LORA).build(), meshkit.Plan.from_string(plan))
    linears = {id(m): n for n, m in pm.model.named_modules() if isinstance(m, torch.nn.Linear)}
    by_weight, deferred = {}, set()  # FSDP swaps in unsharded weights: map them back through their module
    forward, add = weight_grad._deferrable_forward, weight_grad.PendingWeightGrads.add

    def spy_forward(module, x):
        by_weight[id(module.weight)] = linears[id(module)]
        return forward(module, x)

    def spy_add(self, weight, bias, x, grad_out):
        deferred.add(by_weight[id(weight)])
        return add(self, weight, bias, x, grad_out)

    weight_grad._deferrable_forward, weight_grad.PendingWeightGrads.add = spy_forward, spy_add
    try:
        ids, labels = BatchSpec(batch=4, seq=8).make(64)
        rows = slice(pm.dp_rank * 2, (pm.dp_rank + 1) * 2)
        pm.forward_backward(ids[rows], labels[rows])
    finally:
        weight_grad._deferrable_forward, weight_grad.PendingWeightGrads.add = forward, add
    params = dict(pm.named_parameters())
    frozen = {n: p for n, p in params.items() if not p.requires_grad}
    adapters = {n.rsplit(".", 1)[0] for n, p in params.items() if p.requires_grad}
    return {
        "frozen": len(frozen), "trainable": len(params) - len(frozen),
        "frozen_unsharded": [n for n, p in frozen.items()
                             if not (isinstance(p, DTensor) and any(isinstance(s, Shard) for s in p.placements))],
        "frozen_with_grad": [n for n, p in frozen.items() if p.grad is not None],
        "trainable_without_grad": [n for n, p in params.items() if p.requires_grad and p.grad is None],
        "deferred_not_adapters": sorted(deferred - adapters), "adapters_not_deferred": sorted(adapters - deferred),
    }


def test_frozen_base_stays_sharded_without_gradients_or_weight_gradient_work(dist):
    for r in dist(4).run(_frozen_on_rank, "pp=2,dp_shard=2,pp_schedule=zb_h1,pp_microbatches=2"):
        assert r["frozen"] and r["trainable"]
        assert not r["frozen_unsharded"], f"frozen weights FSDP left whole: {r['frozen_unsharded']}"
        assert not r["frozen_with_grad"] and not r["trainable_without_grad"], r
        assert not r["deferred_not_adapters"] and not r["adapters_not_deferred"], r



def _fused_vs_unfused(plan: str):
    """The optimizer fused into backward steps the adapters only, as the unfused AdamW does."""
    spec, batch = ModelSpec(lora=LORA), BatchSpec(batch=4, seq=8)
    fused_pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    plain_pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    fused = meshkit.fuse_optimizer_into_backward(fused_pm, lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-3))
    plain = torch.optim.AdamW([p for p in plain_pm.parameters() if p.requires_grad], lr=1e-2, eps=1e-3)
    rows = slice(fused_pm.dp_rank * 2, (fused_pm.dp_rank + 1) * 2)
    for step in range(2):
        ids, labels = batch.make(64, step)
        fused_pm.forward_backward(ids[rows], labels[rows])
        plain_pm.forward_backward(ids[rows], labels[rows])
        plain.step()
        plain.zero_grad()
    a, b = fused_pm.full_state_dict(), plain_pm.full_state_dict()
    trainable = sum(p.requires_grad for p in fused_pm.parameters())
    return max((a[k] - b[k]).abs().max().item() for k in a), len(fused.optimizers), trainable


def test_fused_optimizer_steps_only_the_adapters(dist):
    for diff, optimizers, trainable in dist(2).run(_fused_vs_unfused, "dp_shard=2"):
        assert optimizers == trainable and diff < 1e-6, (diff, optimizers, trainable)
