"""Plans that only replicate (`dp_replicate` alone, fp32, no offload) run DDP's bucketed all-reduce instead
of FSDP2 units: against the single-device model over accumulation windows under both `grad_sync`
policies (a call that starts with accumulated gradients must not reduce them twice), what runs (DDP on
plain tensors here; FSDP as soon as anything is sharded or cast), and where a window's gradients live
(the fused step's refusal is in test_fused)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

import meshkit
from meshkit.data_parallel.rules import replicates_with_ddp
from meshkit.testing.reference import BatchSpec, ModelSpec
from tests.data_parallel.windows import assert_windows_match, train_windows

CASES = [
    ("dp_replicate=2,grad_sync=every_microbatch", ModelSpec(), 3),
    ("dp_replicate=2,grad_sync=last_microbatch,activation_checkpointing=full", ModelSpec(tied=True), 2),
    ("dp_replicate=2,zero=1", ModelSpec(experts=4, intermediate=16), 2),
]


@pytest.mark.parametrize("plan, spec, calls", CASES, ids=[c[0] for c in CASES])
def test_replicate_only_matches_single_device(dist, plan, spec, calls):
    assert_windows_match(dist(2).run(train_windows, plan, spec, calls), plan)


def _layout(plan: str) -> dict:
    pm = meshkit.parallelize(ModelSpec().build(), meshkit.Plan.from_string(plan))
    return {"fsdp": any(isinstance(m, FSDPModule) for part in pm.model_parts for m in part.modules()),
            "plain": all(type(p) is torch.nn.Parameter for p in pm.parameters())}


@pytest.mark.parametrize("plan, ddp", [
    ("dp_replicate=2", True),
    ("dp_replicate=2,param_dtype=bfloat16", False),  # FSDP casts
    ("dp_replicate=2,offload=optimizer", False),  # FSDP keeps the state in host memory
])
def test_ddp_only_where_nothing_is_sharded_or_cast(dist, plan, ddp):
    assert replicates_with_ddp(meshkit.Plan.from_string(plan).resolve(2)) is ddp
    for layout in dist(2).run(_layout, plan):
        assert layout == {"fsdp": not ddp, "plain": ddp}, plan


def test_replicate_rule_needs_every_other_axis_at_one():
    for plan in ("dp_replicate=2,dp_shard=2", "dp_replicate=2,tp=2", "dp_replicate=2,cp=2", "dp_replicate=2,pp=2",
                 "dp_replicate=2,reduce_dtype=bfloat16", "dp_shard=2"):
        assert not replicates_with_ddp(meshkit.Plan.from_string(plan).resolve(4 if "=2," in plan else 2)), plan


def _grad_storages_across_steps() -> list[bool]:
    """For each parameter: after zero_grad (gradients None) and the next window's first (unreduced) call,
    does its gradient live in the same storage as after the previous window's reduction (DDP's bucket)?
    From the third window: DDP rebuilds its buckets in gradient order once, in the second."""
    spec = ModelSpec()
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string("dp_replicate=2,grad_sync=last_microbatch"))
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    storages = {}
    for step in range(3):
        for call in range(2):
            ids, labels = BatchSpec(batch=2, seq=8, seed=10 * step + call).make(spec.vocab)
            pm.forward_backward(ids, labels, last_microbatch=call == 1)
            if step == 2 and call == 0:
                same = [p.grad is not None and p.grad.untyped_storage().data_ptr() == storages[id(p)]
                        for p in pm.parameters()]
        if step == 1:
            storages = {id(p): p.grad.untyped_storage().data_ptr() for p in pm.parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return same


def test_a_window_accumulates_in_the_buckets(dist):
    """No fresh gradient beside DDP's buckets in a window's earlier calls (two gradients' bytes otherwise)."""
    for same in dist(2).run(_grad_storages_across_steps):
        assert same and all(same)
