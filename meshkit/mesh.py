"""The one 5D device mesh, and every process group derived from it.

All of meshkit keys off a single `init_device_mesh` call with axes, outermost first,
`("pp", "dp_replicate", "dp_shard", "cp", "tp")`. Size-1 axes are kept so that names always resolve
and code never branches on which axes exist. Derived groups are flattened views of that mesh:

- `dp`          = dp_replicate x dp_shard: ranks that see different batches (data loading).
- `dp_shard_cp` = dp_shard x cp: ranks that hold the same weights and shard them (FSDP). Context
  ranks fold in here because they run the same weights on different parts of one sequence.
- `dp_cp`       = dp_replicate x dp_shard x cp: ranks whose losses add up to the global loss (loss
  denominator, gradient-norm reduction).
- `pp_cp_tp`    = pp x cp x tp: ranks that must receive the same batch (they split one model or
  one sequence).

- `dp_cp_tp`    = every rank of one pipeline stage: ranks that split the batch's tokens (MoE load
  statistics are summed over them).

The expert mesh folds ep over dp_shard x cp (`expert_axes`): experts reuse data/context ranks and
never multiply the world size. USP splits the cp axis once more into a ring part (outer) and a Ulysses part (inner); see
`usp_axes`.
"""

from __future__ import annotations

import atexit
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshkit import attempt_store
from meshkit._compat.collectives import align_group_timeouts, set_default_group_timeout
from meshkit._compat.mesh import concatenate_meshes, flatten_mesh, split_axis, submesh
from meshkit.heartbeat import stop_all as stop_heartbeats
from meshkit.plan import Plan, PlanError

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DERIVED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "pp_cp_tp": ("pp", "cp", "tp"),
    "dp_cp_tp": ("dp_replicate", "dp_shard", "cp", "tp"),
}


def default_device_type() -> str:
    """CUDA when this process can see a GPU, else CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


FORMING_TIMEOUT_S = 300.0  # the least time ranks get to find each other, whatever the collective timeout


def ensure_process_group(device_type: str | None = None, timeout_s: float = 600.0) -> int:
    """Initialise the default process group from torchrun's environment if nobody has; return world size.

    A single process started without torchrun gets a private one-rank group, so a plan whose degrees
    are all 1 runs from a plain `python` script or notebook. Under torchrun's shared rendezvous store
    each restart attempt forms its group in a namespace of its own (`meshkit.attempt_store`).
    """
    if dist.is_initialized():
        return dist.get_world_size()
    close_at_exit()
    device_type = device_type or default_device_type()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # Forming the group waits for the slowest rank's start-up (imports: seconds on a loaded machine),
        # which a short collective timeout must not bound: gloo's connect would fail the whole job.
        forming_s = max(timeout_s, FORMING_TIMEOUT_S)
        # Under torchrun's shared store, a namespace of this attempt's own: a restart must never read
        # the killed attempt's addresses (meshkit.attempt_store).
        store = attempt_store.for_this_attempt(timedelta(seconds=forming_s))
        if store is None:
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=forming_s))
        else:
            dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=forming_s))
        if forming_s != timeout_s:
            set_default_group_timeout(timedelta(seconds=timeout_s))
    else:
        store = dist.HashStore()
        dist.init_process_group(backend=backend, store=store, rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout_s))
    return dist.get_world_size()


_EXIT_HOOK: list[bool] = []


def close_at_exit() -> None:
    """Tear this process's distributed state down at interpreter exit, before finalization starts.

    A process whose script ends without `destroy_process_group` reaches finalization with meshkit's
    daemon threads (heartbeat) and gloo's worker threads alive. A thread that needs the GIL then
    (to finish a store call, or to free the last reference to a collective's tensors) is ended by
    CPython inside a C++ frame, and the process aborts with "terminate called without an active
    exception" after all its work is done (torchrun then reports rc=1). At exit this stops the
    heartbeats, forgets meshkit's cached meshes and destroys the default gloo process group and its
    subgroups while the interpreter is whole, so no such thread outlives it. Registered once, by
    `init_mesh` and `ensure_process_group`; a no-op when the script destroyed the group itself.
    NCCL groups are left to the script: destroying one while a peer still runs can hang.
    """
    if not _EXIT_HOOK:
        _EXIT_HOOK.append(True)
        atexit.register(_close_process_groups)


def _close_process_groups() -> None:
    stop_heartbeats()
    _MESHES.clear()
    _MESHES_WORLD.clear()
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()
    gc.collect()  # groups nothing else holds are freed now, their threads joined, interpreter alive


def world_size_from_env() -> int:
    """World size of the running job without touching any process group (1 outside torchrun)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def require_launcher(plan: Plan) -> None:
    """Outside torchrun only a one-process plan can run; say which command would run this one."""
    if dist.is_initialized() or "RANK" in os.environ:
        return
    resolved = plan.resolve(1) if plan.dp_shard == -1 else plan
    if resolved.world_size != 1:
        raise PlanError.of(
            f"this process was not started by torchrun, but the plan ({resolved.describe()}) needs "
            f"{resolved.world_size} processes; fix: run `torchrun --nproc-per-node {resolved.world_size} your_script.py`"
        )


# Meshes built in this process, by (device type, axis sizes), for the default group in _MESHES_WORLD.
# Every `init_device_mesh` creates its process groups anew (gloo: threads and sockets each) and torch
# frees none of them before the process ends, so a second model under the same layout (an evaluation
# copy, a notebook re-run, a test suite's hundreds of plans) reuses the first one's mesh instead.
_MESHES: dict[tuple[str, tuple[int, ...]], DeviceMesh] = {}
_MESHES_WORLD: list[object] = []


def init_mesh(plan: Plan, device_type: str | None = None) -> DeviceMesh:
    """THE mesh for `plan`: one `init_device_mesh` call, then the flattened `dp`, `dp_shard_cp`, `dp_cp`.

    The plan is validated against the world size before any collective, so a mismatch raises the same
    ValueError on every rank. Outside torchrun, a plan that needs more than one process raises with
    the `torchrun` command that would run it. A later call with the same axis sizes in the same
    process group returns the same mesh (every rank calls in the same order, so every rank agrees).
    """
    require_launcher(plan)
    world = world_size_from_env()
    plan = plan.validate(world_size=world)
    device_type = device_type or default_device_type()
    ensure_process_group(device_type)
    close_at_exit()
    shape = tuple(getattr(plan, axis) for axis in AXES)
    key = (device_type, shape)
    default_group = dist.group.WORLD
    if _MESHES and _MESHES_WORLD[0] is not default_group:  # a new default group: the old meshes' are gone
        _MESHES.clear()
    _MESHES_WORLD[:] = [default_group]
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
        for name, axes in DERIVED.items():
            flatten_mesh(mesh[axes], name)
        _MESHES[key] = mesh
    align_group_timeouts()  # the axes' groups get the default group's collective timeout, not torch's 30 min
    return mesh


def check_mesh(mesh: DeviceMesh, plan: Plan) -> None:
    """Raise PlanError unless `mesh` is the one `init_mesh(plan)` builds (axis names and sizes)."""
    names = tuple(mesh.mesh_dim_names or ())
    expected = tuple(getattr(plan, axis) for axis in AXES)
    if names != AXES or tuple(mesh.shape) != expected:
        raise PlanError.of(f"mesh {dict(zip(names, mesh.shape))} does not match the plan {dict(zip(AXES, expected))}; "
                           f"fix: pass mesh=meshkit.init_mesh(plan) or mesh=None")


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on for `mesh` (its current CUDA device, or the CPU)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards over: `dp_shard_cp`, or the 2D HSDP mesh when dp_replicate > 1."""
    if mesh["dp_replicate"].size() > 1:
        return submesh(mesh, ("dp_replicate", "dp_shard_cp"))
    return submesh(mesh, "dp_shard_cp")


def axis(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """The 1D mesh of a named axis, base (`tp`) or derived (`dp_cp`)."""
    return submesh(mesh, name)


def axis_size(mesh: DeviceMesh, name: str) -> int:
    """Size of a named axis, base or derived."""
    return submesh(mesh, name).size()


def usp_axes(mesh: DeviceMesh, ulysses: int) -> tuple:
    """(Ulysses group, ring group) of 2D context parallelism: cp rank = ring_rank * ulysses + ulysses_rank."""
    cp = mesh["cp"].size()
    return split_axis(mesh, "cp", (cp // ulysses, ulysses), ("cp_ring", "cp_ulysses"))


def expert_axes(mesh: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh]:
    """(ep mesh, expert-FSDP mesh): dp_shard_cp split into an outer part that shards expert weights
    with FSDP and an inner part of `ep` neighbouring ranks that each hold 1/ep of the experts."""
    size = submesh(mesh, "dp_shard_cp").size()
    inner, outer = split_axis(mesh, "dp_shard_cp", (size // ep, ep), ("dp_shard_mod_ep", "ep"))
    return inner, outer


def expert_fsdp_mesh(mesh: DeviceMesh, outer: DeviceMesh) -> DeviceMesh:
    """What FSDP shards expert weights over: the expert-FSDP axis, 2D with dp_replicate under HSDP."""
    if mesh["dp_replicate"].size() == 1:
        return outer
    return concatenate_meshes([submesh(mesh, "dp_replicate"), outer])


def first_last_stage_group(mesh: DeviceMesh):
    """The group of this rank's first- and last-stage peers (equal coordinates on every other axis),
    where the two copies of a tied embedding meet; None on the middle stages.

    Collective: every rank of the mesh must call it (pp = 2 reuses the pp group).
    """
    if mesh["pp"].size() == 2:
        return mesh["pp"].get_group()
    grid = mesh.mesh
    pairs = torch.stack([grid[0].flatten(), grid[-1].flatten()], dim=1).tolist()
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


def mirror_pair_group(mesh: DeviceMesh):
    """The group of this rank and its pipeline mirror (pp rank r with pp-1-r, equal coordinates on every
    other axis): under DualPipe the two hold copies of the same two chunks of layers.

    Collective: every rank of the mesh must call it (pp = 2 reuses the pp group).
    """
    pp = mesh["pp"].size()
    if pp == 2:
        return mesh["pp"].get_group()
    grid = mesh.mesh
    pairs = [pair for r in range(pp // 2)
             for pair in torch.stack([grid[r].flatten(), grid[pp - 1 - r].flatten()], dim=1).tolist()]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group
