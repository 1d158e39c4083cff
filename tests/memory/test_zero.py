"""ZeRO-1/2/3 and the accumulation policy against the single-device model: loss, every gradient after a
window of micro-batches, and parameters after AdamW steps, composed with tp, cp, pp, ep and HSDP;
what each stage keeps between the calls of a window; the bad inputs."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import meshkit
from meshkit.testing.reference import ADAM_EPS, BatchSpec, ModelSpec
from tests.tests_support import GRAD_TOL, LOSS_TOL, NORM_TOL, PARAM_TOL


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float()


def train_windows(plan: str, spec: ModelSpec, calls: int = 2, steps: int = 2) -> dict:
    """`steps` optimizer steps, each over a window of `calls` forward_backward calls, sharded and on one
    process side by side; the worst differences (run on every rank)."""
    ref = spec.build()
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=ADAM_EPS)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=ADAM_EPS)
    out = {"loss": 0.0, "grad": 0.0, "norm": 0.0, "param": 0.0, "missing": []}
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
    return out


MOE = ModelSpec(experts=4, intermediate=16)

CASES = [
    ("zero=1,grad_sync=every_microbatch,tp=2,dp_shard=2", ModelSpec()),
    ("zero=1,grad_sync=last_microbatch,cp=2,dp_shard=2", ModelSpec()),
    ("zero=1,grad_sync=last_microbatch,pp=2,dp_shard=2", ModelSpec(layers=3, tied=True)),
    ("zero=2,grad_sync=every_microbatch,pp=2,dp_shard=2", ModelSpec(layers=3)),
    ("zero=2,grad_sync=last_microbatch,tp=2,dp_shard=2", ModelSpec(tied=True)),
    ("zero=2,grad_sync=every_microbatch,cp=2,dp_shard=2", ModelSpec()),
    ("zero=1,grad_sync=every_microbatch,dp_shard=2,ep=2", MOE),
    ("zero=2,grad_sync=last_microbatch,dp_replicate=2,dp_shard=2", ModelSpec()),
    ("zero=3,grad_sync=last_microbatch,dp_shard=2,tp=2", ModelSpec()),
]


@pytest.mark.parametrize("plan, spec", CASES, ids=[c[0] for c in CASES])
def test_zero_stage_and_grad_sync_match_single_device(dist, plan, spec):
    world = meshkit.Plan.from_string(plan).world_size
    for rank, r in enumerate(dist(world).run(train_windows, plan, spec)):
        where = f"{plan}, rank {rank}"
        assert not r["missing"], f"{where}: no gradient for {r['missing']}"
        assert r["loss"] <= LOSS_TOL, f"{where}: loss differs by {r['loss']:.3g}"
        assert r["grad"] <= GRAD_TOL, f"{where}: gradient differs by {r['grad']:.3g}"
        assert r["norm"] <= NORM_TOL, f"{where}: grad norm differs by {r['norm']:.3g}"
        assert r["param"] <= PARAM_TOL, f"{where}: parameters differ by {r['param']:.3g}"


def window_state(plan: str) -> list[dict]:
    """After each call of a 2-call window: do sharded gradients exist, do full (unsharded) gradients
    persist, are parameters still gathered. Read through the module's registered parameters: FSDP2
    swaps the gathered ones in while a unit is unsharded."""
    spec = ModelSpec()
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    block = pm.model_parts[0].layers["0"]
    sharded = list(pm.parameters())
    seen = []
    for c in range(2):
        ids, labels = BatchSpec(batch=2, seq=8, seed=c).make(spec.vocab)
        pm.forward_backward(ids, labels, last_microbatch=c == 1)
        weight = block.self_attn.q_proj.weight
        seen.append({"sharded_grads": any(p.grad is not None for p in sharded),
                     "gathered": not isinstance(weight, DTensor),
                     "full_grad": not isinstance(weight, DTensor) and weight.grad is not None})
    return seen


@pytest.mark.parametrize("zero, grad_sync, expected", [
    # (sharded grads, params gathered, full grad kept) after the window's first and last call
    (1, "every_microbatch", [(True, True, False), (True, False, False)]),
    (1, "last_microbatch", [(False, True, True), (True, False, False)]),
    (2, "every_microbatch", [(True, True, False), (True, False, False)]),
    (2, "last_microbatch", [(False, True, True), (True, False, False)]),
    (3, "every_microbatch", [(True, False, False), (True, False, False)]),
])
def test_what_each_stage_keeps_between_calls(dist, zero, grad_sync, expected):
    (seen, *_) = dist(2).run(window_state, f"dp_shard=2,zero={zero},grad_sync={grad_sync}")
    got = [(s["sharded_grads"], s["gathered"], s["full_grad"]) for s in seen]
    assert got == expected, f"zero={zero}, {grad_sync}: {got}"


@pytest.mark.parametrize("options, words", [
    (dict(zero=4), "zero=4"),
    (dict(zero=True), "zero=True"),
    (dict(zero=2, reshard_after_forward=True), "reshard_after_forward=True"),
    (dict(zero=1, reshard_after_forward=True), "ZeRO-1"),
    (dict(grad_sync="never"), "grad_sync='never'"),
    (dict(offload="disk"), "offload='disk'"),
])
def test_bad_memory_options_raise_before_training(options, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        meshkit.Plan(**options)


def test_memory_options_from_string_and_toml():
    plan = meshkit.Plan.from_string("zero=1,grad_sync=last_microbatch,offload=optimizer")
    assert (plan.zero, plan.grad_sync, plan.offload) == (1, "last_microbatch", "optimizer")
    assert meshkit.Plan.from_toml({"plan": {"zero": 2}}).fsdp_reshard is False
    assert meshkit.Plan(zero=3).fsdp_reshard is True


def clip_inside_window() -> str:
    spec = ModelSpec()
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string("dp_shard=2,zero=1,grad_sync=last_microbatch"))
    ids, labels = BatchSpec(batch=2, seq=8).make(spec.vocab)
    pm.forward_backward(ids, labels, last_microbatch=False)
    try:
        pm.clip_grad_norm_(1.0)
    except ValueError as e:
        pm.forward_backward(ids, labels)  # closing the window makes the gradients readable again
        pm.clip_grad_norm_(1.0)
        return str(e)
    return "no error"


def test_clipping_an_open_window_is_refused_on_every_rank(dist):
    for message in dist(2).run(clip_inside_window):
        assert "last_microbatch=True" in message
