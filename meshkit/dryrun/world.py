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
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
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
    return in_processes(run_rank, [(config, plan, world, workload, r) for r in ranks], jobs=jobs, done=done)


def in_processes(fn: Callable[..., Any], calls: Sequence[tuple], *, jobs: int = 1,
                 done: Callable[[Any], None] | None = None) -> list[Any]:
    """`fn(*args)` for each `args` of `calls`, each in a fresh process (at most `jobs` at a time);
    results in `calls`' order, `done(result)` called here as each finishes."""
    context = mp.get_context("forkserver" if sys.platform != "win32" else "spawn")
    if context.get_start_method() == "forkserver":
        context.set_forkserver_preload(_PRELOAD)
    results: dict[int, Any] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(calls)))) as pool:
        futures = {pool.submit(_in_a_fresh_process, context, fn, args): i for i, args in enumerate(calls)}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            if done is not None:
                done(results[futures[future]])
    return [results[i] for i in range(len(calls))]


def _in_a_fresh_process(context: Any, fn: Callable[..., Any], args: tuple) -> Any:
    """`fn(*args)` in a child of its own (Python 3.10 has no `max_tasks_per_child`)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as one:
        return one.submit(fn, *args).result()
