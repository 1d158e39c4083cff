"""Where meshkit's pipeline executor spends its own time: a CPU-time breakdown per action.

    python -m benchmarks.pipeline.profile [--pp 4] [--microbatches 8] [--steps 20]

Each schedule runs on the benchmark's sleep stages with zero sleeps, so what is left is the
runtime's own work: every rank profiles `--steps` steps with `cProfile` on `time.process_time`
(CPU time, which a loaded shared machine distorts far less than wall time; waiting in gloo blocks
and costs none) and splits it by the executor's functions:

- forward dispatch: `_RankRun._forward` (stage call, autograd graph recording, loss on the last stage)
- backward (B / BW): `_RankRun._backward` (the autograd engine, hooks, the deferred-W bookkeeping)
- W: `PendingWeightGrads.run` (the deferred weight-gradient matmuls and their accumulation)
- P2P post: `_RankRun.post` (taking the tensors, checking them, posting each on gloo or as one batch)
- P2P wait: `Transfers.take` and `Transfers.finish` (waits on receives and on the last sends)
- checks: `_validate` (argument and schedule checks at every call)
- the rest of `run_schedule`: the action loop itself and the FSDP/weight-grad context managers.

Numbers are microseconds of CPU per compute action (F, B, W or BW), median over ranks; the
benchmark's section 5 prints the same table. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.launch import run_ranks
from benchmarks.pipeline.ranks import SleepStage, sleep_loss
from benchmarks.pipeline.sections import runnable
from benchmarks.report import table
from meshkit.pipeline import split as pp_split
from meshkit.pipeline.runtime import TensorMeta, run_schedule
from meshkit.pipeline.schedules import build_schedule, compute_only, stage_placement

#: category -> (function name, file suffix) whose cumulative CPU time it is.
CATEGORIES: dict[str, tuple[str, str]] = {
    "forward dispatch": ("_forward", "pipeline/runtime.py"),
    "backward (B/BW)": ("_backward", "pipeline/runtime.py"),
    "W": ("run", "pipeline/weight_grad.py"),
    "P2P post": ("post", "pipeline/runtime.py"),
    "P2P wait": ("take", "pipeline/p2p.py"),
    "P2P finish": ("finish", "pipeline/p2p.py"),
    "checks": ("_validate", "pipeline/runtime.py"),
}
TOTAL = ("run_schedule", "pipeline/runtime.py")


def _cumulative(stats: pstats.Stats, name: str, suffix: str) -> float:
    """Cumulative seconds of the function `name` defined in a file ending with `suffix`."""
    total = 0.0
    for (filename, _, function), (_, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if function == name and filename.replace("\\", "/").endswith(suffix):
            total += cumulative
    return total


def profile_rank(spec: dict) -> dict[str, Any]:
    """One rank: CPU seconds per category over `steps` steps of each schedule, and its compute actions."""
    pp, m, rank = dist.get_world_size(), spec["microbatches"], dist.get_rank()
    rows, dim = 4, 16
    torch.manual_seed(0)
    inputs = list(torch.randn(m * rows, dim).chunk(m))
    target = torch.zeros(rows, dim)
    meta = TensorMeta((rows, dim), torch.float32)
    out: dict[str, Any] = {}
    for name, v in spec["schedules"]:
        schedule = build_schedule(name, pp, m, v)
        modules = {s: SleepStage(dim, (0.0, 0.0, 0.0)) for s in
                   pp_split.stages_of_rank(rank, stage_placement(name, pp, v))}

        def step(schedule=schedule, modules=modules) -> None:
            run_schedule(schedule, modules, pp_group=dist.group.WORLD, microbatch_inputs=inputs,
                         loss_fn=lambda y, mb: sleep_loss(y, target) / m, shapes=meta)

        step()  # warm-up: caches, first autograd graphs
        dist.barrier()
        profiler = cProfile.Profile(time.process_time)
        profiler.enable()
        for _ in range(spec["steps"]):
            step()
        profiler.disable()
        dist.barrier()
        stats = pstats.Stats(profiler)
        cpu = {category: _cumulative(stats, *where) / spec["steps"] for category, where in CATEGORIES.items()}
        cpu["total"] = _cumulative(stats, *TOTAL) / spec["steps"]
        out[name] = {"cpu": cpu, "actions": len(compute_only(schedule).ranks[rank])}
    return out


def breakdown_table(per_rank: list[dict[str, Any]], schedules: Sequence[tuple[str, int]]) -> list[str]:
    """Microseconds of CPU per compute action, by category; median over ranks."""
    rows = []
    for name, v in schedules:
        def per_action(category: str, name: str = name) -> float:
            return statistics.median(r[name]["cpu"][category] / r[name]["actions"] * 1e6 for r in per_rank)

        named = [per_action(c) for c in CATEGORIES]
        total = per_action("total")
        rows.append([f"{name} (v={v})" if v > 1 else name, *(f"{x:.0f}" for x in named),
                     f"{max(total - sum(named), 0.0):.0f}", f"{total:.0f}"])
    return table(["schedule", *CATEGORIES, "rest of the loop", "total per action (us CPU)"], rows)


def run(pp: int, m: int, steps: int, schedules: Sequence[tuple[str, int]]) -> list[str]:
    """The breakdown table for every runnable schedule at (pp, m)."""
    spec = {"microbatches": m, "steps": steps, "schedules": [list(s) for s in schedules]}
    return breakdown_table(run_ranks(profile_rank, pp, spec), schedules)


def main(argv: list[str] | None = None) -> int:
    """Print the breakdown for the schedules the main benchmark runs."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    schedules, notes = runnable(args.pp, args.microbatches)
    print("\n".join(run(args.pp, args.microbatches, args.steps, schedules) + [f"- {n}" for n in notes]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
