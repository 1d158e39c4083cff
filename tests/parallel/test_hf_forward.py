"""The HF module's own forward after `parallelize` (pp = 1): `model(input_ids, attention_mask,
position_ids, labels).loss` and a loss of the user's own on `.logits` backpropagate to the
single-device model's gradients on the global batch, under tp, cp (zig-zag, Ulysses, packed rows),
data ranks and the plans whose gradients meshkit finishes after backward (inside
`pm.backward_context()`, refused outside it); under pp > 1 the forward is refused and
`model.generate` is `pm.generate`."""

from __future__ import annotations

import pytest
import torch
from tests_support import GRAD_TOL, LOSS_TOL

import meshkit
from meshkit.testing.reference import ModelSpec

SPEC = ModelSpec(layers=2, vocab=96)
BATCH, SEQ = 4, 11  # odd: the plans that split the sequence pad it inside the forward


def _batch() -> dict:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, SPEC.vocab, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[torch.rand(labels.shape, generator=gen) < 0.25] = -100
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 8:] = 0  # right padding
    labels[mask == 0] = -100
    positions = torch.cat([torch.arange(4), torch.arange(SEQ - 4)]).expand(BATCH, SEQ).clone()
    # The user's own loss, sum(logits * w), additive over rows as a loss under data parallelism must be.
    weights = torch.randn(BATCH, SEQ, SPEC.vocab, generator=gen) / (BATCH * SEQ)
    weights[mask == 0] = 0  # HF's padded positions attend unlike meshkit's (right padding is never attended to)
    return {"ids": ids, "labels": labels, "mask": mask, "positions": positions, "weights": weights}


def _grads(params) -> dict:
    out = {}
    for name, p in params:
        g = p.grad
        if g is not None:
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _on_rank(plan: str, packed: bool, hf_loss: bool) -> dict:
    data = _batch()
    pos = data["positions"] if packed else None
    mask = None if packed else data["mask"]
    reference = SPEC.build()
    out = reference(input_ids=data["ids"], attention_mask=mask, position_ids=pos, labels=data["labels"],
                    use_cache=False)
    (out.loss if hf_loss else (out.logits * data["weights"]).sum()).backward()
    ref_grads = _grads(reference.named_parameters())

    model = SPEC.build()
    pm = meshkit.parallelize(model, meshkit.Plan.from_string(plan))
    per = BATCH // pm.dp_size
    mine = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
    with pm.backward_context():
        got = model(input_ids=data["ids"][mine], attention_mask=None if mask is None else mask[mine],
                    position_ids=None if pos is None else pos[mine], labels=data["labels"][mine], use_cache=False)
        (got.loss if hf_loss else (got.logits * data["weights"][mine]).sum()).backward()
    grads = _grads(pm.named_parameters())
    kept = data["mask"][mine].bool() if mask is not None else torch.ones(per, SEQ, dtype=torch.bool)
    return {"loss": abs(got.loss.item() - out.loss.item()) if hf_loss else 0.0,
            "logits": (got.logits.detach() - out.logits[mine])[kept].abs().max().item(),
            "grad": max((grads[n] - ref_grads[n]).abs().max().item() for n in grads),
            "missing": sorted(set(ref_grads) - set(grads))}


@pytest.mark.parametrize("plan, packed, hf_loss", [
    ("cp=2,tp=2,cp_attention=zigzag", True, True),
    ("tp=2,dp_shard=2", False, False),
    ("cp=2,dp_shard=2,cp_attention=ulysses", False, True),
    ("dp_shard=2,tp=2,zero=1", True, False),
    ("dp_replicate=2,tp=2", False, True),
])
def test_model_forward_backpropagates_to_the_single_device_gradients(dist, plan, packed, hf_loss):
    for rank, r in enumerate(dist(4).run(_on_rank, plan, packed, hf_loss)):
        where = f"{plan}, rank {rank}"
        assert not r["missing"], f"{where}: no gradient for {r['missing']}"
        assert r["loss"] <= LOSS_TOL, f"{where}: loss differs by {r['loss']:.3g}"
        assert r["logits"] <= 2e-5, f"{where}: logits differ by {r['logits']:.3g}"
        assert r["grad"] <= GRAD_TOL, f"{where}: gradients differ by {r['grad']:.3g}"


def _graph_outside_the_scope(plan: str) -> None:
    model = SPEC.build()
    meshkit.parallelize(model, meshkit.Plan.from_string(plan))
    data = _batch()
    with torch.no_grad():
        model(input_ids=data["ids"][:2])  # no graph: fine anywhere
    model(input_ids=data["ids"][:2], labels=data["labels"][:2])


@pytest.mark.parametrize("plan", ["tp=2", "dp_shard=2,zero=1"])
def test_a_graph_on_a_plan_finished_after_backward_needs_the_scope(dist, plan):
    """Without `pm.backward_context()` the gradients would miss ZeRO-1's reduce-scatter or TP's
    placement: every rank refuses, before any collective of the step, naming the fix."""
    for o in dist(2).run_raw(_graph_outside_the_scope, plan, timeout=60.0):
        assert not o.ok and o.exc_type == "ValueError", f"rank {o.rank}: {o.exc_type}: {o.message}"
        assert "pm.backward_context()" in o.message, o.message


def _bad_forward_input() -> None:
    model = SPEC.build()
    meshkit.parallelize(model, meshkit.Plan.from_string("tp=2,dp_shard=2"))
    data = _batch()
    mask = data["mask"][:2].clone()
    if torch.distributed.get_rank() == 1:
        mask[0, 0] = 0  # left padding on one rank only
    model(input_ids=data["ids"][:2], attention_mask=mask)


def test_left_padding_is_refused_on_every_rank(dist):
    for o in dist(4).run_raw(_bad_forward_input, timeout=60.0):
        assert not o.ok and o.exc_type == "ValueError", f"rank {o.rank}: {o.exc_type}: {o.message}"
        assert "rank 1" in o.message and "pad on the right" in o.message, o.message
