"""What one rank of a 4-rank estimator test holds and moves: its model-state bytes after a step and
the bytes CommCounter counts in a step, keyed `kind@axis` as the estimate labels them.

The first step is counted: on every plan of tests/estimate its collectives carry the same bytes as a
later step's (compared once, plan by plan), except each rank's share of the MoE all-to-alls, which
moves with the routing while their total over the ranks, what the tests check, does not."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from meshkit.comm_counter import CommCounter
from meshkit.mesh import axis, expert_axes
from tests.data_parallel.estimate_mesh import coordinates, local_bytes

AXES = ("tp", "cp", "pp", "dp_shard_cp", "dp_replicate")


def state_bytes(pm, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters, gradients and optimizer state this rank holds (local shards)."""
    return {"params": local_bytes(pm.parameters()), "grads": local_bytes(p.grad for p in pm.parameters()),
            "optimizer": local_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))}


def counted_step(pm, plan, ids: torch.Tensor) -> dict:
    """One forward_backward under CommCounter: bytes per `kind@axis` (scalars of 8 bytes or fewer, the
    loss and token counts the estimate leaves out, dropped) and this rank's mesh coordinates."""
    pm.check_inputs = False  # its few-byte agreement checks are not part of the estimate
    with CommCounter(pm.mesh) as counter:
        pm.forward_backward(ids, ids)
    experts = {}
    if plan.ep > 1:  # with ep = 1 the expert-FSDP group is the FSDP group itself
        ep_mesh, outer = expert_axes(pm.mesh, plan.ep)  # the groups parallelize made (the mesh caches them)
        experts = {"ep": ep_mesh.get_group(), "ep_fsdp": outer.get_group()}
    comm: dict[str, int] = {}
    for kind, label, nbytes in counter.events:
        if nbytes > 8:
            key = f"{kind}@{axis_label(label, pm.mesh, experts)}"
            comm[key] = comm.get(key, 0) + nbytes
    return {"comm": comm, **coordinates(pm)}


def axis_label(label: str, mesh, experts: dict) -> str:
    """CommCounter's label, with a group it could not name matched to a mesh axis by its ranks.

    A pool worker runs several plans; DTensor's sharding cache can hand a later mesh the redistribute
    plans (and process groups) of an earlier mesh over the same ranks, which CommCounter cannot name.
    """
    if not label.startswith("group:"):
        return label
    ranks = dist.get_process_group_ranks(_resolve_process_group(label[len("group:"):]))
    named = {name: axis(mesh, name).get_group() for name in AXES}
    for name, group in {**named, **experts}.items():
        if dist.get_process_group_ranks(group) == ranks:
            return name
    return label
