"""Host offload composed with each other axis on 4 gloo ranks: the same plan with and without
`offload`, and the single-device model, side by side (loss, every gradient, the clipped norm, and
parameters after two optimizer steps of two-call windows).

On this GPU-less machine FSDP2's offload path still runs (unpinned copies, the optimizer step on the
host tensors), so its numerics are checked here; what it saves is a GPU matter. The README's memory
matrix names these plans (tests/data_parallel/test_memory_matrix.py keeps it true).
"""

from __future__ import annotations

import warnings

import pytest

from meshkit.testing.reference import ModelSpec
from tests.data_parallel.windows import assert_windows_match, train_windows
from tests.tests_support import LOSS_TOL, PARAM_TOL

DENSE = ModelSpec()
MOE = ModelSpec(experts=4)
# README memory-matrix column -> (plan with offload, model)
OFFLOAD_PLANS = {
    "TP": ("tp=2,dp_shard=2,offload=optimizer", DENSE),
    "CP": ("cp=2,dp_shard=2,offload=params", DENSE),
    "PP": ("pp=2,dp_shard=2,offload=optimizer", DENSE),
    "EP": ("dp_shard=4,ep=2,offload=params", MOE),
    "HSDP": ("dp_replicate=2,dp_shard=2,zero=2,offload=optimizer,grad_sync=last_microbatch", DENSE),
}


def without_offload(plan: str) -> str:
    """The same plan with the default placement (no host offload)."""
    return ",".join(part for part in plan.split(",") if not part.startswith("offload="))


def offload_and_plain(plan: str, spec: ModelSpec) -> dict:
    """Both runs against the single-device model, and their largest differences from each other."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "offloading saves nothing here": this machine has no accelerator
        offloaded = train_windows(plan, spec, keep=True)
    plain = train_windows(without_offload(plan), spec, keep=True)
    a, b = offloaded.pop("state"), plain.pop("state")
    assert a.keys() == b.keys()
    return {"offloaded": offloaded, "plain": plain,
            "loss": max(abs(x - y) for x, y in zip(offloaded["losses"], plain["losses"], strict=True)),
            "param": max((a[k].double() - b[k].double()).abs().max().item() for k in a)}


@pytest.mark.parametrize("column", sorted(OFFLOAD_PLANS))
def test_offload_matches_the_same_plan_without_it_and_one_device(dist, column):
    plan, spec = OFFLOAD_PLANS[column]
    results = dist(4).run(offload_and_plain, plan, spec)
    assert_windows_match([r["offloaded"] for r in results], plan)
    assert_windows_match([r["plain"] for r in results], without_offload(plan))
    for rank, r in enumerate(results):
        assert r["loss"] <= LOSS_TOL, f"{plan}, rank {rank}: offload changes the loss by {r['loss']:.3g}"
        assert r["param"] <= PARAM_TOL, f"{plan}, rank {rank}: offload changes parameters by {r['param']:.3g}"
