"""A checkpoint of the whole fake world, planned by DCP: the size of its metadata at scale.

`meshkit.state.checkpoint.save` hands DCP a state dict keyed by HF names (parameters and AdamW state
as DTensors); every rank plans its items, rank 0 gathers every rank's plan, deduplicates replicated
items and builds the metadata every load reads first (`.metadata`: one chunk entry per distinct
shard of every tensor, and where each item's bytes are). At thousands of ranks this one object,
built and pickled by rank 0, grows with ranks x tensors.

Here one process per pipeline rank builds meshkit's real state dict on fake tensors and DCP's real
local plan for it; the items of every other rank of that pipeline rank are the same tensors, their
shards placed by DCP's own placement computation at that rank's mesh coordinates; DCP's
`create_global_plan` then deduplicates and builds the metadata as rank 0 would, and the storage
entries are those `FileSystemWriter` records (one file per rank).
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.tensor import DTensor

from meshkit._compat.dcp import chunk_at, file_storage_info
from meshkit._compat.dispatch import fake_tensor_mode
from meshkit._compat.fake import is_fake_world, join_fake_world
from meshkit.dryrun.rank import mesh_coords, parallelize_on_meta
from meshkit.dryrun.roles import global_rank
from meshkit.dryrun.values import HostValues
from meshkit.dryrun.world import in_processes
from meshkit.mesh import AXES, DERIVED
from meshkit.plan import Plan
from meshkit.state import checkpoint

_RANK_ITEM = checkpoint.RNG  # per-rank entries: "rng.rank<r>"


def checkpoint_metadata(config: Any, plan: Plan, world: int, *, jobs: int = 1) -> dict[str, Any]:
    """Plan a checkpoint of every rank of the fake world (model and AdamW state) and report its
    metadata: bytes pickled, tensors, chunk entries, write items before and after DCP's dedup, and
    the seconds rank 0's planning took."""
    plan = plan.resolve(world)
    stages = in_processes(_stage_plan, [(config, plan, world, global_rank(plan, {"pp": p})) for p in range(plan.pp)],
                          jobs=jobs)
    start = time.perf_counter()
    plans = [_rank_plan(stages[coords["pp"]], coords, plan, r)
             for r, coords in ((r, mesh_coords(plan, r)) for r in range(world))]
    # Rank 0 receives every plan, and later every write result, pickled (DCP gathers objects): each
    # arrives as objects of its own, which is what the metadata then holds and pickles.
    plans = [_as_gathered(p) for p in plans]
    planner = checkpoint.save_planner()
    planner.set_up_planner({}, is_coordinator=True)
    global_plans, metadata = planner.create_global_plan(plans)
    metadata.storage_data = {k: v for rank, p in enumerate(global_plans)
                             for k, v in _as_gathered(_storage_data(rank, p)).items()}
    metadata_bytes = len(pickle.dumps(metadata))
    seconds = time.perf_counter() - start
    chunks = sum(len(getattr(m, "chunks", ())) for m in metadata.state_dict_metadata.values())
    return {"metadata_bytes": metadata_bytes, "tensors": len(metadata.state_dict_metadata), "chunks": chunks,
            "items": sum(len(p.items) for p in plans), "items_after_dedup": sum(len(p.items) for p in global_plans),
            "planning_seconds": round(seconds, 2)}


@dataclasses.dataclass
class _StagePlan:
    """One pipeline rank's local plan and, per DTensor item, how to place it on another rank."""

    rank: int
    plan: SavePlan
    dtensors: dict[str, tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...], tuple]]  # fqn -> shape, dims, mesh, placements


def _stage_plan(config: Any, plan: Plan, world: int, rank: int) -> _StagePlan:
    """In a process of its own: meshkit's state dict for `rank` on fake tensors, and DCP's local plan."""
    join_fake_world(world, rank)
    try:
        pm = parallelize_on_meta(config, plan)
        with fake_tensor_mode(), HostValues():
            pm.materialise()
            optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
            for p in pm.parameters():  # AdamW creates its state at its first step
                p.grad = torch.zeros_like(p)
            optimizer.step()
            state = checkpoint.state_dict(pm, optimizer, step=1, check_finite=False)
            planner = checkpoint.save_planner()
            planner.set_up_planner(state, is_coordinator=rank == 0)
            local = planner.create_local_plan()
        dtensors = {fqn: (tuple(t.shape), tuple(t.device_mesh.mesh_dim_names), tuple(t.device_mesh.shape),
                          tuple(t.placements)) for fqn, t in state.items() if isinstance(t, DTensor)}
        return _StagePlan(rank, local, dtensors)
    finally:
        if is_fake_world():
            dist.destroy_process_group()


def _rank_plan(stage: _StagePlan, coords: dict[str, int], plan: Plan, rank: int) -> SavePlan:
    """Rank `rank`'s local plan: its pipeline rank's items, each DTensor shard placed at its coordinates."""
    items = []
    for item in stage.plan.items:
        fqn = item.index.fqn
        if fqn.startswith(_RANK_ITEM):
            fqn = f"{_RANK_ITEM}{rank}"
        elif rank != stage.rank and item.type == WriteItemType.BYTE_IO and stage.rank == 0:
            continue  # rank 0's own entries (param groups, meshkit's metadata)
        if fqn in stage.dtensors:
            shape, dims, mesh_shape, placements = stage.dtensors[fqn]
            coordinate = [_index(d, coords, plan) for d in dims]
            sizes, offsets = chunk_at(shape, mesh_shape, coordinate, placements)
            chunk = dataclasses.replace(item.tensor_data.chunk, offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            item = dataclasses.replace(item, index=MetadataIndex(fqn, offsets),
                                       tensor_data=dataclasses.replace(item.tensor_data, chunk=chunk))
        elif fqn != item.index.fqn:
            item = dataclasses.replace(item, index=MetadataIndex(fqn, item.index.offset, item.index.index))
        items.append(item)
    return SavePlan(items)


def _index(dim: str, coords: dict[str, int], plan: Plan) -> int:
    """A rank's index on one named mesh dim: a base axis, a flattened one, or an expert axis."""
    if dim in AXES:
        return coords[dim]
    fsdp = coords["dp_shard"] * plan.cp + coords["cp"]
    if dim == "ep":
        return fsdp % plan.ep
    if dim == "dp_shard_mod_ep":
        return fsdp // plan.ep
    if dim in DERIVED:
        index = 0
        for axis_name in DERIVED[dim]:
            index = index * getattr(plan, axis_name) + coords[axis_name]
        return index
    raise ValueError(f"a checkpointed DTensor lies on mesh dim {dim!r}, which the dry run cannot place")


def _as_gathered(obj: Any) -> Any:
    """`obj` as another rank's object arrives on rank 0: pickled and loaded (shared objects become its own)."""
    return pickle.loads(pickle.dumps(obj))


def _storage_data(rank: int, plan: SavePlan) -> dict:
    """What `FileSystemWriter` records for one rank's items: all of them in one file of its own."""
    out, offset = {}, 0
    for item in plan.items:
        length = 0
        if item.tensor_data is not None:
            length = item.tensor_data.chunk.sizes.numel() * item.tensor_data.properties.dtype.itemsize
        out[item.index] = file_storage_info(f"__{rank}_0.distcp", offset, length)
        offset += length
    return out
