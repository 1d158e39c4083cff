"""ZeRO-1/2/3 and the accumulation policy against the single-device model: loss, every gradient after a
window of micro-batches, and parameters after AdamW steps, composed with tp, cp, pp, ep and HSDP;
what each stage keeps between the calls of a window; the bad inputs."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import DTensor

import meshkit
from meshkit.testing.reference import BatchSpec, ModelSpec
from tests.data_parallel.windows import assert_windows_match, train_windows

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
    assert_windows_match(dist(world).run(train_windows, plan, spec), plan)


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
