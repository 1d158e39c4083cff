"""Simulated ranks, each in a process of its own.

One process is one rank of one fake world: torch keeps caches keyed by meshes and process-group names
(DTensor's sharding and redistribution plans) that outlive a destroyed process group, so a second
world in the same process would reach the first one's groups. Each rank runs in a fresh child of a
fork server that has imported torch, transformers and meshkit once, so a rank costs its own work, not
the imports; `jobs` ranks run at a time.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from meshkit.dryrun.rank import RankRun, run_rank
from meshkit.estimate.spec import Workload
from meshkit.plan import Plan

# Stable modules only: the fork server stops on anything but an ImportError while preloading.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
            "transformers.models.llama.modeling_llama", "meshkit.dryrun.rank"]


def run_ranks(config: Any, plan: Plan, world: int, workload: Workload, ranks: Sequence[int], *, jobs: int = 1,
              done: Callable[[RankRun], None] | None = None) -> list[RankRun]:
    """Simulate each of `ranks` of a `world`-rank fake world in its own process; results in `ranks`' order.

    `done` is called in this process as each rank finishes (the CLI's progress line).
    """
    context = mp.get_context("forkserver" if sys.platform != "win32" else "spawn")
    if context.get_start_method() == "forkserver":
        context.set_forkserver_preload(_PRELOAD)
    results: dict[int, RankRun] = {}
    with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(ranks))), mp_context=context,
                             max_tasks_per_child=1) as pool:
        futures = {pool.submit(run_rank, config, plan, world, workload, r): r for r in ranks}
        for future in as_completed(futures):
            run = future.result()
            results[futures[future]] = run
            if done is not None:
                done(run)
    return [results[r] for r in ranks]
