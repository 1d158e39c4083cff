"""Activation and gradient transfers between pipeline ranks, with the ordering that cannot deadlock.

Why it cannot deadlock (gloo): `meshkit.pipeline.simulate.check` proves that running each rank's
action list in order, with sends that never block and receives that block until their send was
issued, finishes on every rank. The runtime issues the same actions in the same order and differs
only by being more eager: the transfers between two computes are posted as one batch (a send may go
out before an earlier receive of the batch completed), a receive is posted one compute before the
compute that consumes it (gloo moves a message only once the receiver has posted it, so this takes
a round trip off the critical path), or on gloo up to `RECEIVE_WINDOW` computes earlier where the
rank waits anyway (`program.compile_rank`), and it is waited on only just before that consumer. No send is
ever issued later than in the proven execution and no wait moves, so every wait is for a send the
proof shows is issued. On gloo an `isend` returns at once and the
transport's own threads finish it, so a pending send never needs its rank to make progress, which
is exactly the model `check` assumes. Each message carries a tag unique within a step (boundary,
microbatch, direction), so receives match by identity, not by posting order, even when several
transfers between the same two ranks are in flight.

NCCL ignores tags and matches per peer in posting order, and a send may hold its stream until the
peer's receive is posted. Posting each run of consecutive transfers as one `batch_isend_irecv`
group is how torch's own schedules avoid the send/send cross between neighbours; the ordering
argument above does not cover NCCL's in-order matching and has not been checked on GPUs. On gloo,
where tags do the matching and nothing is coalesced, each transfer is posted by itself on the
process group (the `send`/`recv` that `dist.isend`/`irecv` end in, without their per-call Python
checks): the batch path's checks and coalescing manager cost ~50-80 us of CPU per op, `isend` ~36
us (measured on this project's 2-core machine), and every microsecond of it sits between one
rank's compute and the next rank's whenever the message is on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshkit._compat.collectives import p2p_recv, p2p_send


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of the activation crossing one stage boundary (its gradient has the same)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorMeta:
        """The metadata of an existing tensor."""
        return cls(tuple(tensor.shape), tensor.dtype)


def wire_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What actually travels: this rank's local, contiguous, autograd-free data."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return tensor.detach().contiguous()


class Transfer(NamedTuple):
    """One message: `send` or receive of `tensor` with pipeline rank `peer` under `tag`.

    A tuple rather than a frozen dataclass: the runtime builds one per message on the critical path.
    """

    send: bool
    peer: int
    tag: int
    tensor: torch.Tensor


class Transfers:
    """Posts transfers on the pipeline group and keeps them alive until they complete.

    Send buffers are held until they complete: on gloo until `finish` (the transport reads them
    asynchronously, and a gloo work reports completion only once waited on, which a send cannot be
    mid-step: a wait would let a send block, which the deadlock proof rules out); on NCCL until a
    later batch finds them complete. Receive buffers are handed out by tag once waited on.
    """

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self._global = [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
        #: NCCL: one group per batch (see the module doc); gloo: each transfer posted by itself.
        self.batched = dist.get_backend(group) != "gloo"
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        self._receives: dict[int, tuple[list[dist.Work], torch.Tensor]] = {}

    def post_one(self, t: Transfer) -> None:
        """Start one transfer on a non-coalescing backend (gloo), straight on the group (see `p2p_send`)."""
        if t.send:
            self._sends.append((p2p_send(self.group, t.tensor, t.peer, t.tag), t.tensor))
        else:
            if t.tag in self._receives:
                raise RuntimeError(f"receive with tag {t.tag} posted twice")
            self._receives[t.tag] = ([p2p_recv(self.group, t.tensor, t.peer, t.tag)], t.tensor)

    def post(self, batch: list[Transfer]) -> None:
        """Start every transfer of `batch` at once (one `batch_isend_irecv` group on a coalescing backend)."""
        if not batch:
            return
        if not self.batched:
            for t in batch:
                self.post_one(t)
            return
        ops = [dist.P2POp(dist.isend if t.send else dist.irecv, t.tensor, self._global[t.peer], self.group, t.tag)
               for t in batch]
        works = list(dist.batch_isend_irecv(ops))
        # A coalescing backend (NCCL) returns one work for the whole batch instead of one per op.
        per_op = [[w] for w in works] if len(works) == len(batch) else [works] * len(batch)
        for t, op_works in zip(batch, per_op):
            if t.send:
                self._sends.extend((w, t.tensor) for w in op_works)
            else:
                if t.tag in self._receives:
                    raise RuntimeError(f"receive with tag {t.tag} posted twice")
                self._receives[t.tag] = (op_works, t.tensor)
        # NCCL's works report completion as the stream passes them: free those send buffers now.
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def take(self, tag: int) -> torch.Tensor:
        """Block until the receive posted under `tag` has arrived; return its buffer."""
        try:
            works, tensor = self._receives.pop(tag)
        except KeyError:
            raise RuntimeError(f"receive with tag {tag} consumed before it was posted") from None
        for work in works:
            work.wait()
        return tensor

    def finish(self) -> None:
        """Wait for every send, so no buffer is freed or reused while the peer still reads it."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        if self._receives:
            raise RuntimeError(f"receives posted but never consumed (tags): {sorted(self._receives)}")
