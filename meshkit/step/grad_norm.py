"""The global gradient norm over a mix of DTensor meshes and plain tensors.

After FSDP + TP a model's gradients live on different meshes (2D dp x tp for split weights, 1D dp for
weights TP leaves alone, plain tensors where nothing shards). torch's clip_grad_norm_ refuses such a
mix (transformers #36296). Here each gradient contributes its local sum of squares once, and partial
sums are all-reduced only over the mesh axes on which that gradient is *sharded*: a replicated axis
holds copies, which must not be counted twice.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.nn.utils import get_total_norm

from meshkit._compat.dispatch import foreach_scale_
from meshkit.local_tensor import local_tensor


def _sharded_axes(grad: DTensor) -> tuple[int, ...]:
    axes = []
    for i, placement in enumerate(grad.placements):
        if placement.is_partial():
            raise ValueError("gradient norm: a gradient is still Partial (unreduced); call after backward completes")
        if not isinstance(placement, Replicate):
            axes.append(i)
    return tuple(axes)


def total_grad_norm(params: list[torch.Tensor], norm_type: float = 2.0, extra_groups=()) -> torch.Tensor:
    """Norm of all gradients as one vector; `extra_groups` are process groups (e.g. pp) holding disjoint parameters."""
    norm_type = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    # The collectives' device: a DTensor's mesh names it even when host offload keeps the shards on the CPU.
    meshes_of = [g.device_mesh.device_type for g in grads if isinstance(g, DTensor)]
    device = torch.device(meshes_of[0]) if meshes_of else grads[0].device if grads else torch.device("cpu")
    is_inf = math.isinf(norm_type)
    buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    meshes = {}
    for g in grads:
        if isinstance(g, DTensor):
            key = (g.device_mesh.mesh_dim_names, _sharded_axes(g))
            meshes[key] = g.device_mesh
            buckets[key].append(g.to_local())
        else:
            buckets[("plain",)].append(g)
    total = torch.zeros((), dtype=torch.float32, device=device)
    # Same order on every rank: keys name axes, never rank lists, so peers issue matching collectives.
    for key in sorted(buckets, key=repr):
        part = _local_part(buckets[key], norm_type).to(device)
        if key != ("plain",):
            mesh = meshes[key]
            for dim in key[1]:
                group = mesh.get_group(dim)
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(part, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=group)
        total = torch.maximum(total, part) if is_inf else total + part
    for group in extra_groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=group)
    return total if is_inf else total ** (1.0 / norm_type)


def _local_part(local: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The local tensors' max (inf norm) or sum of |x|^p, in fp32: fp32 tensors through torch's foreach
    norms (one kernel per group, not one per tensor), others each cast to fp32 first (a bf16 norm would
    round the sum)."""
    local = [t.detach() for t in local if t.numel()]  # an uneven shard may hold nothing (no max to take)
    wide = [t for t in local if t.dtype == torch.float32]
    narrow = [t.float() for t in local if t.dtype != torch.float32]
    parts = [torch.zeros((), dtype=torch.float32, device=local[0].device if local else "cpu")]
    if math.isinf(norm_type):
        parts += [t.abs().max() for t in narrow] + ([get_total_norm(wide, norm_type)] if wide else [])
        return torch.stack(parts).max()
    parts += [t.norm(norm_type) ** norm_type for t in narrow]
    if wide:
        parts.append(get_total_norm(wide, norm_type) ** norm_type)
    return torch.stack(parts).sum()


@torch.no_grad()
def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0, extra_groups=(),
                    counted: list[torch.Tensor] | None = None, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale gradients in place so the global norm is at most `max_norm`; return the norm before clipping.

    `counted` (default `params`) are the parameters whose gradients make up the norm: a copy of a
    weight held elsewhere too is scaled with the others but counted once. `error_if_nonfinite`: a
    NaN or infinite norm raises ValueError before any gradient is touched; the norm is the global
    one, identical on every rank, so every rank raises (a NaN in one rank's shard included).
    """
    norm = total_grad_norm(params if counted is None else counted, norm_type, extra_groups)
    if error_if_nonfinite and not math.isfinite(float(norm)):
        raise ValueError(f"the global gradient norm is {float(norm)} (a NaN or inf gradient on some rank); "
                         "gradients left as they are; fix: skip optimizer.step() for this step "
                         "(meshkit.step.nonfinite.NonFiniteGuard), lower the learning rate, or check the data")
    coef = float(max_norm) / (float(norm) + 1e-6)
    if coef < 1.0:
        foreach_scale_([local_tensor(p.grad) for p in params if p.grad is not None], coef)
    return norm
