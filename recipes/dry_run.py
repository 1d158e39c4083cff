"""`train_llama.py --dry-run --world N`: the recipe's training step on a fake world of N ranks.

`meshkit.dryrun` runs meshkit's real step (this preset's model, plan, sequence length, local batch and
accumulation) as the first, middle and last pipeline rank of a world of N fake ranks, in one process
per rank, and prints each rank's peak memory by part and its collectives beside `meshkit.estimate`'s.
No GPU and no torchrun: `python recipes/train_llama.py --config recipes/configs/llama3_405b.toml
--dry-run --world 2048`.
"""

from __future__ import annotations

import sys

from train_config import RunConfig, TrainConfig, build_model_config

import meshkit
from meshkit.dryrun import dry_run
from meshkit.dryrun.report import render
from meshkit.estimate.spec import Workload


def workload(plan: meshkit.Plan, cfg: TrainConfig) -> Workload:
    """The step the recipe's loop runs, as the estimator and the dry run describe it: under pipelining
    the local batch splits into the plan's microbatches and grad_accum pipeline calls make a step."""
    pipelined = plan.pp > 1
    mbs = cfg.local_batch // plan.microbatches if pipelined else cfg.local_batch
    return Workload(cfg.seq_len, max(mbs, 1), cfg.grad_accum * (plan.microbatches if pipelined else 1))


def run(config: RunConfig, world: int | None, jobs: int = 1) -> int:
    """Dry-run the preset on a fake world of `world` ranks; print the report."""
    if not world:
        raise ValueError("--dry-run needs --world N, the number of ranks to simulate (e.g. --world 2048)")
    model_config, _, _ = build_model_config(config.model)
    plan = config.plan.resolve(world)
    result = dry_run(model_config, plan, world, workload(plan, config.train), jobs=jobs,
                     progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(render(result))
    return 0
