"""The whole model on rank 0 alone: each chunk travels once, point to point, from one holder.

`DTensor.full_tensor()` is an all-gather: every rank of the tensor's mesh ends up with the whole
tensor, so an export built on it needs the whole model's memory on every rank (and torch's
redistribution warning prints once per rank). Here rank 0 is the only one that assembles:

1. every rank lists the chunks it holds (name, global shape, dtype, and the chunk's offsets and
   sizes in the global tensor: DCP's own chunk list, so every placement, `_StridedShard` included,
   is described by torch itself); a tensor held whole is one chunk at offset 0;
2. rank 0 gathers the lists (metadata only), picks one holder per distinct chunk (the lowest rank:
   replicas over dp_replicate, tp peers of a replicated norm... send nothing) and scatters to each
   rank the ordered list of chunks it sends;
3. each sender sends its chunks in that order; rank 0 receives them in the same global order into
   the full CPU tensors. Messages from one sender arrive in order, so the order is the protocol.

A non-zero rank's memory grows by nothing but the chunk in flight (none when its shard is already
contiguous); rank 0 holds the full CPU state plus one chunk on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshkit._compat.dcp import dtensor_chunks
from meshkit.local_tensor import local_tensor

if TYPE_CHECKING:
    from meshkit.parallel_model import ParallelModel

__all__ = ["full_state_dict_on_rank0"]


class _Chunk(NamedTuple):
    """One box of one tensor that a rank holds; `names` are every state-dict name of that tensor."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _local_chunks(pm: ParallelModel) -> tuple[list[_Chunk], list[torch.Tensor]]:
    """This rank's chunks (metadata) and their tensors, tied names merged onto one entry."""
    by_tensor: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, tensor in pm.model.state_dict().items():
        if tensor.is_meta:
            continue  # another pipeline rank's layer
        by_tensor.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    chunks, data = [], []
    for key, names in by_tensor.items():
        tensor = tensors[key]
        local = local_tensor(tensor)
        if isinstance(tensor, DTensor):
            (box,) = dtensor_chunks(tensor)
            offsets, sizes = tuple(box.offsets), tuple(box.sizes)
        else:
            offsets, sizes = (0,) * tensor.dim(), tuple(tensor.shape)
        if local.numel() == 0 and tensor.numel() > 0:
            continue  # an uneven shard left this rank nothing
        chunks.append(_Chunk(tuple(names), tuple(tensor.shape), tensor.dtype, offsets, sizes))
        data.append(local)
    return chunks, data


def _assign(lists: list[list[_Chunk]]) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """(global order of (rank, chunk index) pairs, each rank's chunk indices in that order).

    The lowest rank holding a chunk sends it; the order is by first name, then offsets.
    """
    holder: dict[tuple, tuple[int, int]] = {}
    for rank, chunks in enumerate(lists):
        for i, c in enumerate(chunks):
            holder.setdefault((c.names, c.offsets), (rank, i))
    order = [holder[k] for k in sorted(holder)]
    per_rank: list[list[int]] = [[] for _ in lists]
    for rank, i in order:
        per_rank[rank].append(i)
    return order, per_rank


def _place(full: dict[str, torch.Tensor], c: _Chunk, values: torch.Tensor) -> None:
    target = full.get(c.names[0])
    if target is None:
        target = torch.empty(c.shape, dtype=c.dtype)
        for name in c.names:
            full[name] = target
    box = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))
    target[box].copy_(values)


@torch.no_grad()
def full_state_dict_on_rank0(pm: ParallelModel) -> dict[str, torch.Tensor] | None:
    """Every parameter and persistent buffer as a plain CPU tensor under its HF name, on rank 0 only
    (None elsewhere). Collective over the world: every rank calls it."""
    chunks, data = _local_chunks(pm)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        full: dict[str, torch.Tensor] = {}
        for c, values in zip(chunks, data):
            _place(full, c, values.cpu())
        return full
    rank, world = dist.get_rank(), dist.get_world_size()
    lists: list[list[_Chunk]] | None = [None] * world if rank == 0 else None  # type: ignore[list-item]
    dist.gather_object(chunks, lists, dst=0)
    mine: list[list[int] | None] = [None]
    if rank == 0:
        order, per_rank = _assign(lists)
        dist.scatter_object_list(mine, per_rank, src=0)
    else:
        dist.scatter_object_list(mine, None, src=0)
    if rank != 0:
        for i in mine[0]:
            dist.send(data[i].contiguous(), dst=0)
        return None
    full = {}
    for sender, i in order:
        c = lists[sender][i]
        if sender == 0:
            values = data[i]
        else:
            values = torch.empty(c.sizes, dtype=c.dtype, device=pm.device)
            dist.recv(values, src=sender)
        _place(full, c, values.cpu())
    return full
