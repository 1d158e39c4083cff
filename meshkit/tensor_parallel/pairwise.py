"""Sequence parallelism's all-gather and reduce-scatter as pairwise messages, on gloo.

gloo has no reduce-scatter of its own: torch's `reduce_scatter_tensor` on gloo clones the input,
all-reduces the clone and copies this rank's chunk out, so it costs more than the all-reduce it
replaces; its `all_gather_into_tensor` gathers into a temporary and copies each chunk out. With
sequence parallelism each block boundary pays one of each where tensor parallelism without it pays
one all-reduce, which made SP 13-24% dearer in CPU than no SP on 2 gloo ranks (issue #34). Here
each rank sends every peer the part that peer needs and receives its own, straight from and into
the [B, S, ...] activation where the layout allows (no rank-major staging copy): an all-gather sends
its shard to each peer, a reduce-scatter sends each peer that peer's sequence chunk of its partial
and sums what arrives in rank order. Each rank sends (size-1)/size of the full buffer, as a ring
does; a [2, 256, 256] fp32 boundary on this project's 2-core machine costs ~0.2 ms of CPU per call
either way, against 0.5 ms (all-gather) and 0.9 ms (reduce-scatter) through c10d's collectives.

Only CPU tensors on a gloo group take this path (`applies`); NCCL and the fake backend of the dry
run keep the collectives. The messages count as the collective they implement
(`comm_counter.counted_as`), so bytes compare with the estimator as before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from meshkit._compat.collectives import p2p_recv, p2p_send
from meshkit.comm_counter import counted_as

# Tags of their own: the tp group can be the default group when tp spans the world.
_GATHER_TAG, _SCATTER_TAG = 0x5A01, 0x5A02


def applies(x: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether `x` on `group` goes through pairwise messages (a CPU tensor on a gloo group)."""
    # asked each call, not cached by group name: a process that tears its world down may reuse the
    # name for a group of another backend (the dry run's fake one)
    return x.device.type == "cpu" and "gloo" in str(dist.get_backend(group))


def _sequence_slot(t: torch.Tensor, index: int, s: int) -> torch.Tensor:
    return t[:, index * s:(index + 1) * s]


def all_gather(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """[B, s, ...] -> [B, size*s, ...]: every rank's sequence shard in rank order on dim 1."""
    x = x.contiguous()
    rank, s = group.rank(), x.shape[1]
    out = x.new_empty((x.shape[0], size * s, *x.shape[2:]))
    with counted_as("all_gather", group, out.numel() * out.element_size()):
        sends = [p2p_send(group, x, peer, _GATHER_TAG) for peer in range(size) if peer != rank]
        receives = []
        for peer in range(size):
            if peer != rank:
                slot = _sequence_slot(out, peer, s)
                into = slot if slot.is_contiguous() else torch.empty_like(x)  # B == 1: straight into place
                receives.append((p2p_recv(group, into, peer, _GATHER_TAG), slot, into))
        _sequence_slot(out, rank, s).copy_(x)
        for work, slot, into in receives:
            work.wait()
            if into is not slot:
                slot.copy_(into)
        for work in sends:
            work.wait()
    return out


def reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    """Partial [B, S, ...] -> [B, S/size, ...]: this rank's sequence chunk summed over ranks, in rank order."""
    rank, s = group.rank(), x.shape[1] // size
    with counted_as("reduce_scatter", group, x.numel() * x.element_size()):
        sends, received = [], {}
        for peer in range(size):
            if peer != rank:
                chunk = _sequence_slot(x, peer, s).contiguous()
                sends.append((p2p_send(group, chunk, peer, _SCATTER_TAG), chunk))
        own = _sequence_slot(x, rank, s)
        for peer in range(size):
            if peer != rank:
                into = torch.empty_like(own, memory_format=torch.contiguous_format)
                received[peer] = (p2p_recv(group, into, peer, _SCATTER_TAG), into)
        parts = []
        for peer in range(size):
            if peer == rank:
                parts.append(own)
            else:
                work, into = received[peer]
                work.wait()
                parts.append(into)
        out = parts[0] + parts[1]  # a new tensor: `own` is a view of the caller's
        for part in parts[2:]:
            out.add_(part)
        for work, _ in sends:
            work.wait()
    return out
