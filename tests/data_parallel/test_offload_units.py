"""Every FSDP unit gets the plan's offload policy, the MoE experts' own units included.

Offload moves shards between host and device memory and never changes CPU numerics, so the
side-by-side runs of test_offload_axes cannot see a unit built without the policy; the units' own
structure can: each unit's policy, and every parameter inside some unit.
"""

from __future__ import annotations

import warnings

from torch.distributed.fsdp import CPUOffloadPolicy

import meshkit
from meshkit._compat.fsdp import fsdp_unit_policies
from meshkit.testing.reference import ModelSpec

MOE = ModelSpec(experts=4, layers=2)


def _units_on_rank(plan: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "offloading saves nothing here": no accelerator
        pm = meshkit.parallelize(MOE.build(device="meta"), meshkit.Plan.from_string(plan))
    units = [u for part in pm.model_parts for u in fsdp_unit_policies(part)]
    experts = {id(p) for part in pm.model_parts for m in part.modules() if hasattr(m, "experts")
               for p in m.experts.parameters()}
    covered = {id(p): isinstance(policy, CPUOffloadPolicy) for policy, params in units for p in params}
    return {"policies": [type(policy).__name__ for policy, _ in units],
            "expert_units": sum(any(id(p) in experts for p in params) for _, params in units),
            "uncovered": [n for n, p in pm.named_parameters() if id(p) not in covered],
            "not_offloaded": [n for n, p in pm.named_parameters() if not covered.get(id(p), True)]}


def test_every_fsdp_unit_carries_the_offload_policy(dist):
    for rank, r in enumerate(dist(4).run(_units_on_rank, "dp_shard=4,ep=2,offload=params")):
        assert r["expert_units"] == MOE.layers, f"rank {rank}: {r['expert_units']} expert units"
        assert not r["uncovered"], f"rank {rank}: parameters in no FSDP unit: {r['uncovered']}"
        assert set(r["policies"]) == {"CPUOffloadPolicy"}, f"rank {rank}: unit policies {r['policies']}"
        assert not r["not_offloaded"], f"rank {rank}: not offloaded: {r['not_offloaded']}"
