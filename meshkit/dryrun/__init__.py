"""The real code on a fake world at any size, against the estimator.

`dry_run(config, plan, world, workload)` simulates chosen ranks of a world of `world` ranks, each in
a process of its own on torch's fake process group: meshkit builds the real mesh, parallelizes the
model built on the meta device, materialises the rank's shards as fake tensors and runs one real
training step (`forward_backward` over the step's calls, `clip_grad_norm_`, AdamW), measuring the
peak of live bytes by part and every collective by axis, beside `meshkit.estimate`'s figures for the
same rank. `python -m meshkit.dryrun` is its command line; docs/estimate.md, "Dry run", says what is
simulated and how it compares.

Modules: `values` (the host reads of a fake step: a symmetric world, balanced routing), `memory`
(the allocation tracker), `measure` (one step measured, fake or real), `rank` (one simulated rank),
`world` (ranks in processes of their own), `roles` (which ranks to simulate), `compare` (the
estimator's side), `checkpoint_plan` (DCP's metadata for the plan), `report`, `__main__`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshkit.dryrun.compare import SCALAR_BYTES, RankEstimate, collective_differences, estimate_rank
from meshkit.dryrun.rank import RankRun
from meshkit.dryrun.roles import default_ranks
from meshkit.dryrun.world import run_ranks
from meshkit.estimate.spec import Workload
from meshkit.plan import Plan

__all__ = ["DryRun", "RankResult", "default_ranks", "dry_run"]


@dataclass
class RankResult:
    """One simulated rank: what it measured and what the estimator predicts for it."""

    run: RankRun
    estimate: RankEstimate

    @property
    def collective_differences(self) -> list[str]:
        """Every (axis, kind) whose bytes differ from the estimator's (single scalars left out)."""
        return collective_differences(self.run.measured.collectives(SCALAR_BYTES + 1), self.estimate.collectives)

    def as_dict(self) -> dict:
        """The rank's entry in the JSON report."""
        m = self.run.measured
        return {"rank": self.run.rank, "coords": self.run.coords, **m.peak.as_dict(),
                "estimate_peak_bytes": self.estimate.peak_bytes, "estimate_parts": self.estimate.parts,
                "in_flight": self.estimate.in_flight, "collectives": m.collectives(),
                "estimate_collectives": self.estimate.collectives,
                "collective_differences": self.collective_differences, "axes": m.axes,
                "compared_collectives": m.collectives(SCALAR_BYTES + 1),
                "unknown_reads": self.run.unknown_reads, "seconds": round(self.run.seconds, 2),
                "cpu_seconds": round(self.run.cpu_seconds, 2)}


@dataclass
class DryRun:
    """A dry run: the plan, the step, every simulated rank, and how long it took."""

    plan: Plan
    world: int
    workload: Workload
    ranks: list[RankResult]
    seconds: float
    extra: dict = field(default_factory=dict)  # e.g. "checkpoint": the checkpoint plan's metadata

    def as_dict(self) -> dict:
        """The JSON report: one object with a `ranks` list and `seconds`."""
        w = self.workload
        return {"plan": self.plan.describe(), "world": self.world, "seq": w.seq, "mbs": w.mbs,
                "microbatches": w.microbatches, "ranks": [r.as_dict() for r in self.ranks],
                **self.extra, "seconds": round(self.seconds, 2)}


def dry_run(config: Any, plan: Plan, world: int, workload: Workload, ranks: Sequence[int] | None = None, *,
            jobs: int = 1, progress: Callable[[str], None] | None = None) -> DryRun:
    """Simulate `ranks` (default: one of every distinct role, `roles.default_ranks`) of a `world`-rank
    fake world running one training step of `plan`, each beside the estimator's figures."""
    start = time.perf_counter()
    plan = plan.resolve(world).validate(config, world, workload.seq)  # here, not in every rank's process
    ranks = list(default_ranks(plan) if ranks is None else ranks)
    for r in ranks:
        if not 0 <= r < world:
            raise ValueError(f"--rank {r}: not a rank of a world of {world}; fix: a rank in [0, {world})")
    done: list[int] = []

    def report(run: RankRun) -> None:
        done.append(run.rank)
        if progress is not None:
            progress(f"dry run: rank {run.rank} done in {run.seconds:.0f} s ({run.cpu_seconds:.0f} s of CPU) "
                     f"({len(done)}/{len(ranks)})")

    if progress is not None:
        progress(f"dry run: {plan.describe()} on a fake world of {world}, ranks {ranks}, {jobs} at a time")
    runs = run_ranks(config, plan, world, workload, ranks, jobs=jobs, done=report)
    results = [RankResult(run, estimate_rank(config, plan, world, workload, run.coords, run.measured.axes))
               for run in runs]
    return DryRun(plan, world, workload, results, time.perf_counter() - start)
