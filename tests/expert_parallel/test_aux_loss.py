"""Router auxiliary losses against a hand-built single-device reference, with HF's default coefficient
(0.001): under gradient accumulation (each call's term weighted by its share of the window's tokens)
and under pipelining (each microbatch's term by 1/microbatches). CE and aux come back apart from
`forward_backward` and `evaluate`, and `evaluate` returns what `forward_backward` does on one batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from tests_support import GRAD_TOL, LOSS_TOL
from torch.distributed.tensor import DTensor

import meshkit
from meshkit.expert_parallel import moe_layers
from meshkit.testing.reference import BatchSpec, ModelSpec

HF_DEFAULT_COEF = transformers.MixtralConfig().router_aux_loss_coef
BATCH = BatchSpec(batch=4, seq=8, ignore=0.3)
CALLS = 2


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")


def _valid(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


def _grad_error(pm, ref) -> float:
    refp = dict(ref.named_parameters())
    return max(((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - refp[n].grad).abs().max().item()
               for n, p in pm.named_parameters())


def _hf_aux_with_accumulation(plan: str) -> dict:
    spec = ModelSpec(kind="mixtral", layers=2, intermediate=16, experts=4, top_k=2)
    ref, model = spec.build(), spec.build()
    for m in (ref, model):
        m.config.output_router_logits = True
    pm = meshkit.parallelize(model, meshkit.Plan.from_string(plan))
    per = BATCH.batch // pm.dp_size
    rows = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
    batches = [BATCH.make(spec.vocab, call) for call in range(CALLS)]
    window = sum(_valid(labels) for _, labels in batches)
    out = {"ce": [], "aux": [], "ref_ce": [], "ref_aux": []}
    for ids, labels in batches:
        got = ref(input_ids=ids, use_cache=False)
        ce, aux = _ce_sum(got.logits, labels) / window, HF_DEFAULT_COEF * got.aux_loss * _valid(labels) / window
        (ce + aux).backward()
        parts = pm.forward_backward(ids[rows], labels[rows], loss_denominator=window, parts=True)
        out["ce"].append(parts.ce.item()), out["aux"].append(parts.aux.item())
        out["ref_ce"].append(ce.item()), out["ref_aux"].append(aux.item())
    out["grad"] = _grad_error(pm, ref)
    ids, labels = batches[0]
    with torch.no_grad():
        hf_loss = ref(input_ids=ids, labels=labels, use_cache=False).loss.item()
    evaluated = pm.evaluate(ids[rows], labels[rows], parts=True)
    trained = pm.forward_backward(ids[rows], labels[rows], parts=True)
    out["eval"] = [t.item() for t in evaluated]
    out["train"] = [t.item() for t in trained]
    out["hf_loss"] = hf_loss
    return out


def _llama_moe_aux_with_pipelining(plan: str) -> dict:
    spec = ModelSpec(layers=4, intermediate=16, experts=4, top_k=2)
    ref, model = spec.build(), spec.build()
    for layer in moe_layers(ref) + moe_layers(model):
        layer.aux_loss_coef, layer.z_loss_coef = HF_DEFAULT_COEF, HF_DEFAULT_COEF
    pm = meshkit.parallelize(model, meshkit.Plan.from_string(plan))
    m = pm.plan.microbatches
    per = BATCH.batch // pm.dp_size
    rows = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
    batches = [BATCH.make(spec.vocab, call) for call in range(CALLS)]
    window = sum(_valid(labels) for _, labels in batches)
    out = {"ce": [], "aux": [], "ref_ce": [], "ref_aux": []}
    for ids, labels in batches:
        weight = _valid(labels) / window
        ref_ce, ref_aux = 0.0, 0.0
        for i in range(m):  # microbatch i: slice i of every data rank's rows, routed with global counts
            mb = [r * per + j for r in range(pm.dp_size) for j in range(i * per // m, (i + 1) * per // m)]
            for layer in moe_layers(ref):
                layer.aux_loss_scale = weight / m
            ce = _ce_sum(ref(input_ids=ids[mb], use_cache=False).logits, labels[mb]) / window
            ce.backward()
            ref_ce += ce.item()
            ref_aux += sum(layer.aux_loss.item() for layer in moe_layers(ref)) * weight / m
        parts = pm.forward_backward(ids[rows], labels[rows], loss_denominator=window, parts=True)
        out["ce"].append(parts.ce.item()), out["aux"].append(parts.aux.item())
        out["ref_ce"].append(ref_ce), out["ref_aux"].append(ref_aux)
    out["grad"] = _grad_error(pm, ref)
    return out


def _check(results: list[dict], context: str) -> None:
    for rank, r in enumerate(results):
        assert r["grad"] <= GRAD_TOL, f"{context}, rank {rank}: gradients differ by {r['grad']:.3g}"
        assert min(r["aux"]) > 0, f"{context}, rank {rank}: no auxiliary loss reported"
        for key in ("ce", "aux"):
            for call, (got, want) in enumerate(zip(r[key], r[f"ref_{key}"])):
                assert abs(got - want) <= LOSS_TOL * max(1.0, abs(want)), \
                    f"{context}, rank {rank}, call {call}: {key} {got} vs reference {want}"


@pytest.mark.parametrize("plan", ["tp=2,dp_shard=2,ep=2"])
def test_hf_aux_loss_under_gradient_accumulation(dist, plan):
    results = dist(4).run(_hf_aux_with_accumulation, plan)
    _check(results, plan)
    for rank, r in enumerate(results):
        loss, ce, aux = r["eval"]
        assert abs(loss - r["hf_loss"]) <= LOSS_TOL, f"rank {rank}: evaluate {loss} vs HF's loss {r['hf_loss']}"
        assert abs(loss - (ce + aux)) <= LOSS_TOL and aux > 0, f"rank {rank}: evaluate parts {r['eval']}"
        assert max(abs(a - b) for a, b in zip(r["eval"], r["train"])) <= LOSS_TOL, \
            f"rank {rank}: evaluate {r['eval']} vs forward_backward {r['train']} on the same batch"


@pytest.mark.parametrize("plan", ["pp=2,dp_shard=2,ep=2", "pp=2,tp=2,pp_microbatches=4,pp_schedule=zb_h1"])
def test_moe_layer_aux_loss_under_pipelining_and_accumulation(dist, plan):
    _check(dist(4).run(_llama_moe_aux_with_pipelining, plan), plan)

