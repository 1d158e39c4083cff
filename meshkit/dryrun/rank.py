"""One simulated rank of a fake world: meshkit's real code, as rank R of W, on fake tensors.

The process joins torch's fake process group as rank R of a world of W ranks (collectives return at
once, no data moves), builds the model on the meta device, lets `meshkit.parallelize` build the real
mesh and shard it, materialises this rank's shards as fake tensors (shapes without storage), and
measures one training step (`measure`) under `FakeTensorMode`, with `values.HostValues` answering
the host reads the step makes (token checks, counts, MoE split sizes).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import transformers

import meshkit
from meshkit._compat.dispatch import fake_tensor_mode
from meshkit._compat.fake import is_fake_world, join_fake_world
from meshkit.dryrun.measure import Batches, Measured, measure_step
from meshkit.dryrun.values import HostValues
from meshkit.estimate.spec import Workload
from meshkit.integrations.peft import model as peft_model
from meshkit.mesh import AXES, axis
from meshkit.plan import Plan


@dataclass
class RankRun:
    """One simulated rank's step: where it sits on the mesh, what it held and moved, how long it took."""

    rank: int
    coords: dict[str, int]   # the rank's index on every base axis, and fsdp (its dp_shard x cp index)
    measured: Measured
    unknown_reads: int        # host reads of values computed from fake weights, answered 0.0
    seconds: float            # wall-clock
    cpu_seconds: float = 0.0  # this process's CPU time (a loaded machine inflates the wall-clock)


def mesh_coords(plan: Plan, rank: int) -> dict[str, int]:
    """Index of global `rank` on every base axis of the plan's mesh (tp innermost)."""
    coords, rest = {}, rank
    for name in reversed(AXES):
        size = getattr(plan, name)
        coords[name] = rest % size
        rest //= size
    return {name: coords[name] for name in AXES}


def run_rank(config: Any, plan: Plan, world: int, workload: Workload, rank: int, *, lr: float = 1e-4) -> RankRun:
    """Simulate `rank` of a fake world of `world` ranks: one measured training step under `plan`.

    The process must not be in a process group already (a fake one is made and destroyed here).
    """
    if dist.is_initialized():
        raise RuntimeError("run_rank builds a fake world of its own: call it in a process without a process "
                           "group (`python -m meshkit.dryrun` starts one per simulated rank)")
    plan = plan.resolve(world)
    start, cpu = time.perf_counter(), time.process_time()
    join_fake_world(world, rank)
    try:
        pm = parallelize_on_meta(config, plan)
        with fake_tensor_mode(), HostValues() as values, warnings.catch_warnings():
            # FSDP2 notes, every step, that the embedding unit hands back a view: known, and not the run's
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            pm.materialise()
            optimizer = torch.optim.AdamW(pm.parameters(), lr=lr, foreach=True)
            measured = measure_step(pm, optimizer, batches(config, plan, workload))
        return RankRun(rank, {**mesh_coords(plan, rank), "fsdp": axis(pm.mesh, "dp_shard_cp").get_local_rank()},
                       measured, values.unknown_reads, time.perf_counter() - start, time.process_time() - cpu)
    finally:
        if is_fake_world():
            dist.destroy_process_group()


def parallelize_on_meta(config: Any, plan: Plan) -> meshkit.ParallelModel:
    """`config`'s model built on the meta device and parallelized as this rank of the fake world: the
    real mesh and shards, no storage yet (`materialise` under fake tensors gives it shapes)."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft_model.wrap(transformers.AutoModelForCausalLM.from_config(config), config)  # --lora-r
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # offload on a CPU run: "saves nothing here"
        return meshkit.parallelize(model, plan)


def batches(config: Any, plan: Plan, workload: Workload) -> Batches:
    """The step's forward_backward inputs on this data rank: `workload.calls` batches of random token
    ids (labels = ids: every target counts), each of `mbs` rows, times `pp_microbatches` under pp."""
    rows = workload.mbs * (plan.microbatches if plan.pp > 1 else 1)
    out = []
    for _ in range(workload.calls(plan)):
        ids = torch.randint(0, config.vocab_size, (rows, workload.seq))
        out.append((ids, ids))
    return out
