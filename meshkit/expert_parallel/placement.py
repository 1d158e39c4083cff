"""Which experts each expert-parallel rank holds: the divisibility rule, and the in-place split."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from meshkit.expert_parallel.moe import MoE


def _group_of(ep: ProcessGroup | DeviceMesh) -> tuple[ProcessGroup, DeviceMesh | None]:
    if isinstance(ep, DeviceMesh):
        if ep.ndim != 1:
            raise ValueError(f"the expert-parallel mesh must be 1D, got axes {ep.mesh_dim_names}")
        return ep.get_group(), ep
    return ep, None


def expert_split_problem(ep: int, num_experts: int) -> str | None:
    """Why `ep` ranks cannot each hold num_experts/ep whole experts, with the fix, or None.

    The one statement of the rule: the Plan (from the config), `parallelize` (from the model's
    layers), the estimator and `apply_expert_parallel` all ask it.
    """
    if num_experts % ep == 0:
        return None
    return (f"ep={ep}: each expert-parallel rank holds num_experts/ep experts, and {ep} does not divide "
            f"num_experts={num_experts}; fix: ep in {[d for d in range(1, num_experts + 1) if num_experts % d == 0]}")


def apply_expert_parallel(
    moe: MoE, ep: ProcessGroup | DeviceMesh | None, *, load_group: ProcessGroup | None = None,
    aux_loss_scale: float = 1.0,
) -> MoE:
    """Keep this rank's contiguous block of E/ep experts and route over `ep`, in place.

    `ep` is a process group or 1D mesh; with a mesh the expert weights become DTensors Shard(0) on it;
    None keeps every expert (ep = 1) and only sets the groups. `load_group` is where balancing
    statistics are summed; it defaults to the ep group, but must be every rank that splits the batch
    (and holds a copy of `expert_bias`), e.g. all data x context ranks, or biases drift apart and the
    aux loss is not the global batch's. `aux_loss_scale` multiplies the gradient of the attached
    auxiliary losses (1/microbatches: each microbatch's aux loss is a whole batch's worth).
    """
    moe.aux_loss_scale = aux_loss_scale
    if ep is None:
        moe.load_group = load_group
        return moe
    group, mesh = _group_of(ep)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    problem = expert_split_problem(size, moe.num_experts)
    if problem:
        raise ValueError(f"apply_expert_parallel: {problem}")
    if moe.num_local_experts != moe.num_experts:
        raise ValueError("apply_expert_parallel: this MoE's experts are already sharded")
    local = moe.num_experts // size
    for name, param in list(moe.experts.named_parameters(recurse=False)):  # experts on dim 0, biases too
        block = param.detach()[rank * local : (rank + 1) * local].clone()
        if mesh is not None:
            block = DTensor.from_local(block, mesh, [Shard(0)], run_check=False)
        setattr(moe.experts, name, nn.Parameter(block))
    moe.ep_group = group
    moe.load_group = group if load_group is None else load_group
    return moe
