"""Packed rows on gpt-oss: two documents in one row keep to themselves, as HF keeps them when run apart.

HF's `GptOssModel` builds its masks without the position ids, so on a packed row it attends across
documents (checked here too, so the comparison cannot pass by accident); the family tests therefore
run one document per row. meshkit reads document boundaries from position ids restarting at 0. Here
each row packs two documents of different lengths (the second longer than the sliding window, whose
layers alternate with full attention), and meshkit under tp=2 x dp_shard=2 (sinks split with the
query heads, biased experts) must give the logits, loss and every gradient of HF run on each document
alone, the loss being the token cross-entropies of all documents over their valid-target count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tests_support import GRAD_TOL, LOSS_TOL

import meshkit
from meshkit.testing.families import family_spec

LOGITS_TOL = 2e-5  # fp32, logits of order 1 (as tests/parallel/test_inference.py); independent of the rank count
PLAN = "tp=2,dp_shard=2"
DOCS = [(5, 7), (8, 4)]  # document lengths in each row (one row per data rank); the window is 4


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _packed_on_rank(plan: str) -> dict:
    spec = family_spec("gpt_oss")
    ref, model = spec.build(), spec.build()
    pm = meshkit.parallelize(model, meshkit.Plan.from_string(plan))
    seq = sum(DOCS[0])
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, spec.vocab, (len(DOCS), seq), generator=gen)
    labels = ids.clone()
    labels[torch.rand(labels.shape, generator=gen) < 0.2] = -100
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    bounds = [[(sum(row[:i]), sum(row[: i + 1])) for i in range(len(row))] for row in DOCS]
    for r, row in enumerate(bounds):  # a document's first token is no target of the previous one
        for start, _ in row[1:]:
            labels[r, start] = -100

    # The reference: HF on each document alone; the loss sums every document's token cross-entropies
    # and divides by the valid targets of all of them.
    ref_logits = torch.empty(len(DOCS), seq, spec.vocab)
    summed, valid = torch.zeros(()), 0
    for r, row in enumerate(bounds):
        for start, end in row:
            logits = ref(input_ids=ids[r:r + 1, start:end], use_cache=False).logits[0]
            ref_logits[r, start:end] = logits.detach()
            targets = labels[r, start + 1:end]
            summed = summed + F.cross_entropy(logits[:-1], targets, ignore_index=-100, reduction="sum")
            valid += int((targets != -100).sum())
    ref_loss = summed / valid
    ref_loss.backward()
    with torch.no_grad():  # HF on the packed row: its documents see each other
        hf_packed = ref(input_ids=ids, position_ids=positions, use_cache=False).logits

    mine = slice(pm.dp_rank, pm.dp_rank + 1)
    loss = pm.forward_backward(ids[mine], labels[mine], position_ids=positions[mine])
    ref_params = dict(ref.named_parameters())
    grad, scale, missing = 0.0, 0.0, []
    for name, p in pm.named_parameters():
        if p.grad is None:
            missing.append(name)
            continue
        ref_grad = ref_params[name].grad
        grad = max(grad, (_full(p.grad) - ref_grad).abs().max().item())
        scale = max(scale, ref_grad.abs().max().item())
    logits = pm.forward(ids[mine], positions[mine], gather=True)
    return {"loss": abs(loss.item() - ref_loss.item()), "grad": grad, "grad_scale": scale, "missing": missing,
            "logits": (logits - ref_logits[mine]).abs().max().item(),
            "hf_packed": (hf_packed - ref_logits).abs().max().item()}


def test_gpt_oss_packed_documents_match_hf_on_each_document(dist):
    for rank, r in enumerate(dist(4).run(_packed_on_rank, PLAN)):
        where = f"{PLAN}, rank {rank}"
        assert r["hf_packed"] > 1e-3, f"{where}: HF's packed row matched its documents: the check proves nothing"
        assert not r["missing"], f"{where}: parameters without gradients: {r['missing']}"
        assert r["logits"] <= LOGITS_TOL, f"{where}: logits differ by {r['logits']:.3g}"
        assert r["loss"] <= LOSS_TOL, f"{where}: loss differs by {r['loss']:.3g}"
        assert r["grad"] <= GRAD_TOL, f"{where}: gradient differs by {r['grad']:.3g} (scale {r['grad_scale']:.3g})"
