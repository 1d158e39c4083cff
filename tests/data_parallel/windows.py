"""Accumulation windows trained sharded and on one process side by side (the memory tests' reference)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import meshkit
from meshkit.testing.reference import ADAM_EPS, BatchSpec, ModelSpec
from tests.tests_support import GRAD_TOL, LOSS_TOL, NORM_TOL, PARAM_TOL


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()


def train_windows(plan: str, spec: ModelSpec, calls: int = 2, steps: int = 2, keep: bool = False) -> dict:
    """`steps` optimizer steps, each over a window of `calls` forward_backward calls, sharded and on one
    process side by side; the worst differences (run on every rank). `keep`: also each window's loss
    and the final full state dict, to compare two sharded runs with each other."""
    ref = spec.build()
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=ADAM_EPS)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=ADAM_EPS)
    out = {"loss": 0.0, "grad": 0.0, "norm": 0.0, "param": 0.0, "missing": [], "losses": []}
    ref_params = dict(ref.named_parameters())
    for step in range(steps):
        batches = [BatchSpec(batch=4, seq=8, ignore=0.3, seed=10 * step + c).make(spec.vocab) for c in range(calls)]
        ref_loss = ref(input_ids=torch.cat([b[0] for b in batches]), labels=torch.cat([b[1] for b in batches])).loss
        ref_loss.backward()
        per = 4 // pm.dp_size
        mine = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
        window = sum(pm.count_valid_tokens(labels[mine]) for _, labels in batches)
        loss = sum(pm.forward_backward(ids[mine], labels[mine], loss_denominator=window,
                                       last_microbatch=c == calls - 1).item()
                   for c, (ids, labels) in enumerate(batches))
        out["loss"] = max(out["loss"], abs(loss - ref_loss.item()))
        out["losses"].append(loss)
        for name, p in pm.named_parameters():
            if p.grad is None:
                out["missing"].append(name)
                continue
            out["grad"] = max(out["grad"], (_full(p.grad) - ref_params[name].grad).abs().max().item())
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        out["norm"] = max(out["norm"], abs(pm.clip_grad_norm_(1.0).item() - ref_norm.item()))
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    state = pm.full_state_dict()
    out["param"] = max((state[n].float() - p).abs().max().item() for n, p in ref.state_dict().items())
    if keep:
        out["state"] = state
    return out


def assert_windows_match(results: list[dict], plan: str) -> None:
    """Every rank's `train_windows` differences within the suite's fixed fp32 tolerances."""
    for rank, r in enumerate(results):
        where = f"{plan}, rank {rank}"
        assert not r["missing"], f"{where}: no gradient for {r['missing']}"
        assert r["loss"] <= LOSS_TOL, f"{where}: loss differs by {r['loss']:.3g}"
        assert r["grad"] <= GRAD_TOL, f"{where}: gradient differs by {r['grad']:.3g}"
        assert r["norm"] <= NORM_TOL, f"{where}: grad norm differs by {r['norm']:.3g}"
        assert r["param"] <= PARAM_TOL, f"{where}: parameters differ by {r['param']:.3g}"
