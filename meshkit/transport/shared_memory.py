"""Collectives through shared memory, for CPU ranks on one host: TP's activations and FSDP's units.

gloo has only network transports: on one host every message still crosses the loopback TCP stack
and gloo's transport thread, which charges per message (~1-2 ms of CPU per collective inside a
training step on this project's 2-core machine), and its reduce-scatter is a full all-reduce of a
clone. Sequence parallelism issues two collectives per block boundary (an all-gather and a
reduce-scatter) where tensor parallelism without it issues one all-reduce of the same bytes, so on
gloo SP cost ~10% more CPU than no SP, all of it in that thread (issue #34,
`benchmarks/sp_overhead.py`). NCCL carries intra-node traffic through shared memory or NVLink for the
same reason; this is the CPU ranks' equivalent, used by TP's local path (`tensor_parallel.local`)
and FSDP's units (`data_parallel.host_comms`).

Each rank owns a file in /dev/shm holding two slots, maps every peer's, and reads one named pipe
per peer. A collective is: copy this rank's part into its slot, write one byte to every peer's
pipe, wait for a byte from every peer, read their parts straight from their slots (sums in rank
order, so every rank holds the same bits). The slots alternate: a rank refills a slot only after
every peer has reached the next collective, and so has finished reading this one; one wait per
collective, no second barrier. No thread, no socket, and the waiting rank sleeps in poll().

- Failure: a peer whose process exits closes its pipes and a waiting rank reads end-of-file at
  once and raises; a peer that stalls raises after the group's timeout. The files are unlinked as
  soon as every rank has mapped them, so a crash leaves nothing in /dev/shm.
- Memory: a slot reserves pages (fallocate) up to the largest collective it carried (TP: twice the
  largest [B, S, H] activation per rank; FSDP: its largest unit's flat buffer). A collective larger
  than a slot, or one tmpfs has no room for, goes through gloo on every rank (the status byte
  carries the vote).
- Scope: CPU tensors on a gloo group whose ranks all map one /dev/shm (`open_for` checks by doing
  it); `MESHKIT_SHARED_MEMORY=0` on any rank keeps gloo. The collectives count as what they
  implement (`comm_counter.record_collective`), bytes unchanged.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import uuid
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshkit._compat.collectives import group_timeout_s
from meshkit.comm_counter import record_collective

_ROOT = "/dev/shm"
SLOT_BYTES = 1 << 30  # address space only: pages are reserved as collectives need them
_OK = 0x80  # the vote bit of a status byte

# channels by the group their collectives run on (the hot path's lookup), and by the processes
# they join: every group over the same processes reuses one channel (a test pool makes many)
_by_group: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_by_members: dict[tuple[int, ...], Channel] = {}


class Channel:
    """One rank's end of a shared-memory channel among a group's ranks (see the module docstring)."""

    def __init__(self, token: str, rank: int, own_fd: int, regions: list[mmap.mmap], slots: list[torch.Tensor],
                 readers: dict[int, int], writers: dict[int, int], timeout_s: float) -> None:
        self.token, self.rank, self.size = token, rank, len(slots)
        self._own_fd, self._regions, self._slots = own_fd, regions, slots  # slots[r]: rank r's [2, SLOT_BYTES]
        self._readers, self._writers = readers, writers  # peer -> the pipe it writes to us / we write to it
        self._pollers = {peer: _poller(fd) for peer, fd in readers.items()}
        self._timeout_s = timeout_s
        self._reserved = [0, 0]
        self._count = 0
        self.broken = False  # a collective raised half-way: the peers' bytes are no longer in step
        weakref.finalize(self, _close_all, [own_fd, *readers.values(), *writers.values()])

    def all_gather(self, x: torch.Tensor, group: dist.ProcessGroup, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """[B, s, ...] -> [B, size*s, ...], every rank's shard in rank order on dim 1 (into `out` when
        given; `x` may already be this rank's part of it, as FSDP's flat [1, k] shard is); None where
        a rank could not use its slot (the caller then takes gloo on every rank)."""
        x = x.contiguous()
        slot = self._exchange(_nbytes(x), lambda own: _view(own, x.dtype, x.shape).copy_(x))
        if slot is None:
            return None
        s = x.shape[1]
        out = x.new_empty((x.shape[0], self.size * s, *x.shape[2:])) if out is None else out
        for r in range(self.size):
            part = x if r == self.rank else _view(self._slots[r][slot], x.dtype, x.shape)
            destination = out[:, r * s:(r + 1) * s]
            if part.data_ptr() != destination.data_ptr():
                destination.copy_(part)
        record_collective("all_gather", group, _nbytes(out))
        return out

    def reduce_scatter(self, x: torch.Tensor, group: dist.ProcessGroup,
                       out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Partial [B, S, ...] -> [B, S/size, ...], this rank's sequence chunk summed over ranks in
        rank order (into `out` when given); None as in `all_gather`."""
        b, s = x.shape[0], x.shape[1] // self.size
        ranked = (self.size, b, s, *x.shape[2:])  # peer p's chunk at [p]: the slot is rank-major

        def fill(own: torch.Tensor) -> None:
            chunks = _view(own, x.dtype, ranked)
            for peer in range(self.size):
                if peer != self.rank:
                    chunks[peer].copy_(x[:, peer * s:(peer + 1) * s])

        slot = self._exchange(_nbytes(x), fill)
        if slot is None:
            return None
        parts = [x[:, r * s:(r + 1) * s] if r == self.rank else _view(self._slots[r][slot], x.dtype, ranked)[self.rank]
                 for r in range(self.size)]
        record_collective("reduce_scatter", group, _nbytes(x))
        return _sum_in_order(parts, out)

    def all_reduce(self, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor | None:
        """The sum over ranks of `x`, in rank order, as a new tensor; None as in `all_gather`."""
        x = x.contiguous()
        slot = self._exchange(_nbytes(x), lambda own: _view(own, x.dtype, x.shape).copy_(x))
        if slot is None:
            return None
        parts = [x if r == self.rank else _view(self._slots[r][slot], x.dtype, x.shape) for r in range(self.size)]
        record_collective("all_reduce", group, _nbytes(x))
        return _sum_in_order(parts)

    def _exchange(self, nbytes: int, fill: Callable[[torch.Tensor], None]) -> int | None:
        """Publish this rank's part and wait for every peer's: the slot they are in, or None where a
        rank refused (too large, or no pages); every rank sees the same votes.

        The byte each rank sends is its vote (bit 7) and the collective's number mod 128: a rank
        that missed a collective (an error between its send and its wait) is caught at the next one
        instead of reading a slot its peer has not filled."""
        if self.broken:
            raise RuntimeError("meshkit: this shared-memory channel failed in an earlier collective; "
                               "parallelize the model again in a fresh world")
        number = self._count % 128
        slot = self._count % 2
        self._count += 1
        self.broken = True  # until every peer's byte is in
        ok = self._reserve(slot, nbytes)
        if ok:
            fill(self._slots[self.rank][slot])
        for peer, fd in self._writers.items():
            try:
                os.write(fd, bytes([number | (_OK if ok else 0)]))
            except BrokenPipeError:
                raise RuntimeError(f"meshkit: rank {peer} of a shared-memory group closed its channel before "
                                   f"rank {self.rank}'s collective: its process exited (see its own error)") from None
        for peer in self._readers:
            byte = self._wait(peer)
            if byte & 127 != number:
                raise RuntimeError(f"meshkit: ranks {self.rank} and {peer} of a shared-memory group are out of step on their "
                                   f"channel (collective {number} against {byte & 127}, mod 128): "
                                   "one of them skipped a collective the other ran")
            ok = ok and bool(byte & _OK)
        self.broken = False
        return slot if ok else None

    def _reserve(self, slot: int, nbytes: int) -> bool:
        if nbytes > SLOT_BYTES:
            return False
        if nbytes > self._reserved[slot]:
            try:  # pages now, so a full tmpfs refuses here instead of faulting (SIGBUS) on the copy
                os.posix_fallocate(self._own_fd, slot * SLOT_BYTES, nbytes)
            except OSError:
                return False
            self._reserved[slot] = nbytes
        return True

    def _wait(self, peer: int) -> int:
        fd = self._readers[peer]
        try:
            byte = os.read(fd, 1)
        except BlockingIOError:  # not there yet: sleep until it is (or the peer's end closes)
            byte = None
        if byte is None:
            if not self._pollers[peer].poll(self._timeout_s * 1000):
                raise RuntimeError(f"meshkit: rank {peer} of a shared-memory group did not reach the collective within "
                                   f"{self._timeout_s:.0f} s (shared-memory channel, rank {self.rank} waiting)")
            byte = os.read(fd, 1)
        if not byte:
            raise RuntimeError(f"meshkit: rank {peer} of a shared-memory group closed its channel while rank "
                               f"{self.rank} waited in a collective: its process exited (see its own error)")
        return byte[0]


def channel_of(group: dist.ProcessGroup, x: torch.Tensor) -> Channel | None:
    """The channel for `x`'s collectives on `group`, or None (not a CPU tensor, or no channel)."""
    return _by_group.get(group) if x.device.type == "cpu" else None


def try_collective(kind: str, x: torch.Tensor, group: dist.ProcessGroup, **out) -> torch.Tensor | None:
    """`kind` ("all_gather", "reduce_scatter" or "all_reduce", see `Channel`) of `x` through `group`'s
    channel; None where it has none or a rank refused: the caller then takes gloo, as every rank does."""
    channel = channel_of(group, x)
    return getattr(channel, kind)(x, group, **out) if channel is not None else None


def mapped_buffers() -> list[torch.Tensor]:
    """Every open channel's mapped slots: memory held for the process's life, not per step, so a
    measurement of live activations leaves it out (its pages: twice the largest collective)."""
    return [slots for channel in _by_members.values() for slots in channel._slots]


def enabled() -> bool:
    """Whether this rank lets `open_for` open channels (`MESHKIT_SHARED_MEMORY=0` on any rank
    keeps the whole group on gloo)."""
    return os.environ.get("MESHKIT_SHARED_MEMORY", "1") != "0"


def open_for(group: dist.ProcessGroup, device_type: str) -> Channel | None:
    """Open (or reuse) the channel among `group`'s ranks; None unless they are CPU ranks (`device_type`
    of their mesh) on gloo that can all map one /dev/shm.

    Collective over a CPU gloo `group` (parallelize calls it on the tp and FSDP shard groups before
    the first step). Ranks on different hosts see different /dev/shm: creating and opening each
    other's files fails there, which every rank learns, and the group keeps gloo."""
    if device_type != "cpu" or "gloo" not in str(dist.get_backend(group)):
        return None
    rank, size = group.rank(), group.size()
    members = [None] * size
    dist.all_gather_object(members, (socket.gethostname(), os.getpid(), enabled()), group=group)
    if not all(on for _, _, on in members):  # every rank decides alike, whatever its environment says
        _by_group.pop(group, None)  # a mesh reused from an earlier parallelize keeps its group
        return None
    held = _by_members.get(tuple(members))
    usable = (held.token, held._count) if held is not None and not held.broken else None
    states = [None] * size
    dist.all_gather_object(states, usable, group=group)
    if usable is not None and len(set(states)) == 1:  # the same processes, joined and in step
        _by_group[group] = held
        return held
    fresh = [None] * size
    dist.all_gather_object(fresh, uuid.uuid4().hex, group=group)
    channel = _open(group, f"{_ROOT}/meshkit-shm-{fresh[0]}", fresh[0], rank, size)
    if channel is not None:
        _by_members[tuple(members)] = channel
        _by_group[group] = channel
    return channel


def _open(group: dist.ProcessGroup, prefix: str, token: str, rank: int, size: int) -> Channel | None:
    """Create, then map and open, then connect, each step once every rank finished the one before
    (a pipe opens for writing only once its reader holds it); unlink whatever this rank created."""
    made: list[str] = []
    fds: list[int] = []
    regions: list[mmap.mmap] = []
    readers: dict[int, int] = {}
    writers: dict[int, int] = {}
    try:
        ok = _all(_create(prefix, rank, size, made, fds), group)
        ok = _all(ok and _map_and_listen(prefix, rank, size, fds, regions, readers), group)
        ok = _all(ok and _connect(prefix, rank, size, fds, writers), group)
    finally:
        for path in made:
            _unlink(path)
    if not ok:
        _close_all(fds)
        return None
    slots = [torch.frombuffer(region, dtype=torch.uint8).view(2, SLOT_BYTES) for region in regions]
    return Channel(token, rank, fds[0], regions, slots, readers, writers, group_timeout_s(group) or 600.0)


def _create(prefix: str, rank: int, size: int, made: list[str], fds: list[int]) -> bool:
    """This rank's slot file and the pipes its peers will write to it."""
    try:
        path = f"{prefix}-r{rank}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        made.append(path)
        fds.append(fd)
        os.ftruncate(fd, 2 * SLOT_BYTES)
        for peer in range(size):
            if peer != rank:
                pipe = f"{prefix}-p{peer}to{rank}"
                os.mkfifo(pipe, 0o600)
                made.append(pipe)
        return True
    except OSError:
        return False


def _map_and_listen(prefix: str, rank: int, size: int, fds: list[int], regions: list, readers: dict) -> bool:
    """Map every rank's slot file; open this rank's pipes for reading."""
    try:
        for r in range(size):
            fd = fds[0] if r == rank else os.open(f"{prefix}-r{r}", os.O_RDWR)
            try:
                regions.append(mmap.mmap(fd, 2 * SLOT_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
            finally:
                if r != rank:
                    os.close(fd)  # the mapping keeps the pages; only our own fd reserves them
        for peer in range(size):
            if peer != rank:
                readers[peer] = os.open(f"{prefix}-p{peer}to{rank}", os.O_RDONLY | os.O_NONBLOCK)
                fds.append(readers[peer])
        return True
    except OSError:
        return False


def _connect(prefix: str, rank: int, size: int, fds: list[int], writers: dict[int, int]) -> bool:
    """Open every peer's pipe from this rank for writing (their readers are open by now)."""
    try:
        for peer in range(size):
            if peer != rank:
                writers[peer] = os.open(f"{prefix}-p{rank}to{peer}", os.O_WRONLY | os.O_NONBLOCK)
                fds.append(writers[peer])
        return True
    except OSError:
        return False


def _all(ok: bool, group: dist.ProcessGroup) -> bool:
    votes = [None] * group.size()
    dist.all_gather_object(votes, bool(ok), group=group)
    return all(votes)


def _poller(fd: int) -> select.poll:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    return poller


def _view(region: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    numel = 1
    for n in shape:
        numel *= n
    return region[:numel * dtype.itemsize].view(dtype).view(shape)


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _sum_in_order(parts: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    # a new tensor (or the caller's `out`): the parts are the caller's and the peers' memory
    out = torch.add(parts[0], parts[1], out=out) if out is not None else parts[0] + parts[1]
    for part in parts[2:]:
        out.add_(part)
    return out


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
