"""The estimator's figures for one simulated rank, in the dry run's terms, and how the two differ.

`meshkit.estimate` predicts the worst rank; here it is asked about the simulated rank itself: its
pipeline rank (with the in-flight microbatches the pipeline simulator gives it), its TP and FSDP
shards (uneven splits differ by a row per tensor), its messages. Its memory terms map onto the dry
run's parts: model state onto parameters, gradients and optimizer; held activations onto
activations; the FSDP buffers (gathered units, unreduced gradients) onto fsdp_buffers; the transient
(loss backward or a block's recompute and gradient buffers) onto temporaries.

Collectives are compared per axis and kind in `CommCounter`'s unit, leaving out calls of one or two
scalars (at most 16 bytes: the loss and its token count, gradient-norm partials, a checked step's
failure flag riding with its token count in one int64 pair), which the estimator does not model; a group that is several axes at once (ep = dp_shard
x cp makes the expert group FSDP's) is reported under one name on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshkit.data_parallel.rules import replicates_with_ddp
from meshkit.dryrun.measure import axis_name
from meshkit.dryrun.memory import PARTS
from meshkit.estimate.comm import communication
from meshkit.estimate.core import estimate
from meshkit.estimate.peak import rank_memory
from meshkit.estimate.spec import DEVICES, Workload
from meshkit.plan import Plan

#: Calls of at most this many bytes (a scalar, or the checked step's [flag, token count]) are not compared.
SCALAR_BYTES = 16


@dataclass(frozen=True)
class RankEstimate:
    """The estimator's peak, parts and collectives for one rank."""

    peak_bytes: int
    parts: dict[str, int]
    collectives: dict[str, dict[str, int]]  # axis -> kind -> bytes per step
    in_flight: int


def estimate_rank(config: Any, plan: Plan, world: int, workload: Workload, coords: dict[str, int],
                  axes: dict[str, list[int]]) -> RankEstimate:
    """What `meshkit.estimate` predicts for the rank at `coords` (`rank.mesh_coords` plus its fsdp
    index); `axes` (the rank's groups by axis name) name the estimator's axes as the dry run does."""
    plan = plan.resolve(world)
    whole = estimate(config, plan, world, workload)
    pp_rank = coords["pp"]
    in_flight = whole.sim.peak_activations[pp_rank] if whole.sim is not None else 1
    mem = rank_memory(config, plan, workload, pp_rank, in_flight, tp_rank=coords["tp"], fsdp_rank=coords["fsdp"],
                      cp_rank=coords["cp"])
    s = mem.state
    at_step = mem.moment == "optimizer"
    parts = {"parameters": s.param_bytes, "gradients": s.grad_bytes if at_step else mem.grads_held,
             "optimizer": s.optimizer_bytes, "activations": 0 if at_step else mem.activations - mem.head_freed,
             "fsdp_buffers": 0 if at_step else mem.fsdp_buffers, "temporaries": mem.transient}
    if mem.offloaded:  # host memory holds the sharded state
        for part in ("parameters", "gradients", "optimizer"):
            parts[part] = 0
    collectives: dict[str, dict[str, int]] = {}
    for c in communication(config, plan, workload, DEVICES["h100"], s, 1.0, 0.0, pp_rank=pp_rank):
        if c.buffer <= SCALAR_BYTES:
            continue
        name = axis_name(axes[c.axis], axes) if c.axis in axes else c.axis
        kind = collectives.setdefault(name or c.axis, {})
        kind[c.kind] = kind.get(c.kind, 0) + int(c.calls * c.buffer)
    if replicates_with_ddp(plan) and "dp_replicate" in axes:
        # Not the estimator's: the dry run's DDP looks for unused parameters (`_compat.replicate`, a fake
        # world cannot rebuild buckets), all-reducing an int32 per parameter tensor as a window syncs
        name = axis_name(axes["dp_replicate"], axes) or "dp_replicate"
        kind = collectives.setdefault(name, {})
        kind["all_reduce"] = kind.get("all_reduce", 0) + 4 * s.trained_tensors
    return RankEstimate(mem.peak, {p: parts[p] for p in PARTS}, collectives, in_flight)


def collective_differences(measured: dict[str, dict[str, int]], estimated: dict[str, dict[str, int]]) -> list[str]:
    """Every (axis, kind) whose bytes differ, as 'kind@axis: measured vs estimated'."""
    out = []
    for name in sorted(set(measured) | set(estimated)):
        m, e = measured.get(name, {}), estimated.get(name, {})
        for kind in sorted(set(m) | set(e)):
            if m.get(kind, 0) != e.get(kind, 0):
                out.append(f"{kind}@{name}: measured {m.get(kind, 0)} vs estimated {e.get(kind, 0)}")
    return out
