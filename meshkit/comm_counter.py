"""`CommCounter`: every collective a region issues, by kind and group, in one unit.

The unit is a collective's full logical buffer per call (all-gather output, reduce-scatter input,
all-reduce tensor, all-to-all input, P2P message), so counts compare with the estimator's
(`meshkit.estimate.comm`) byte for byte. It watches both c10d's ops (FSDP2, P2P, gloo collectives)
and the functional collectives DTensor issues, through a dispatch mode.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshkit._compat.dispatch import dispatch_mode_base
from meshkit.mesh import axis  # slices derived (flattened) axes without torch's deprecation warning

# op name -> (kind, index of the argument whose size is the collective's full buffer)
_C10D_OPS = {
    "_allgather_base_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "send": ("send", 0),
    "recv_": ("recv", 0),
}
_FUNCTIONAL_OPS = {
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


@dataclass
class _Composite:
    kind: str
    group: str
    size: int
    nbytes: int
    counted_by: set[int] = field(default_factory=set)


_composite = threading.local()
_active = threading.local()  # the counters entered on this thread, for collectives no op shows


def record_collective(kind: str, group: dist.ProcessGroup, nbytes: int) -> None:
    """Count one `kind` collective of `nbytes` on `group` in every counter active on this thread.

    For collectives carried without a c10d op the dispatch mode could see
    (`shared_memory`: a copy into memory a peer maps and a byte down a pipe)."""
    for counter in getattr(_active, "counters", ()):
        counter._record(kind, group.group_name, group.size(), nbytes)


@contextmanager
def counted_as(kind: str, group: dist.ProcessGroup, nbytes: int) -> Iterator[None]:
    """Count the point-to-point messages issued inside as one `kind` collective of `nbytes` on `group`.

    For collectives built from sends and receives (`tensor_parallel.pairwise` on gloo): a counter
    records the collective at the first message it sees and skips the messages, so its counts stay
    in the collective's unit whichever way it was carried out."""
    outer = getattr(_composite, "current", None)
    _composite.current = _Composite(kind, group.group_name, group.size(), nbytes)
    try:
        yield
    finally:
        _composite.current = outer


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _group_of(args: tuple) -> tuple[str | None, int | None]:
    """(group name, group size) from a c10d op's ProcessGroup argument."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                pg = dist.ProcessGroup.unbox(arg)
            except (RuntimeError, TypeError):
                continue  # a ReduceOp, not a group
            return pg.group_name, pg.size()
    return None, None


@dataclass
class CommStat:
    """Calls and bytes of one collective kind on one mesh axis."""
    count: int = 0
    bytes: int = 0  # sum of full buffer sizes: gathered output, scattered input, reduced tensor


class CommCounter:
    """Counts collectives and their bytes on this rank while active (`with CommCounter(mesh) as c:`).

    Bytes are the collective's full logical buffer (all-gather output, reduce-scatter input,
    all-reduce tensor), the unit the Playbook's volume formulas use; a ring moves (n-1)/n of it per
    rank for all-gather/reduce-scatter and 2(n-1)/n for all-reduce (see `wire_bytes`). Groups are
    named by the mesh axis they belong to when a mesh is given (derived axes included); FSDP's
    collectives are labelled `dp_shard_cp` under every plan, also where that axis is one process group
    with `dp_shard` or `cp` (`same_group` lists the axes a label stands for).

    Only collectives issued on this rank while the block runs are seen. On CPU backward runs on the
    calling thread, so its collectives count (tests/estimate/test_metrics.py); on CUDA, autograd's device
    threads should inherit the mode with the rest of the thread-local state (not yet checked on GPU).
    """

    def __init__(self, mesh: Any = None, axes: tuple[str, ...] = ()) -> None:
        self.stats: dict[tuple[str, str], CommStat] = defaultdict(CommStat)
        self.sizes: dict[str, int] = {}
        self.events: list[tuple[str, str, int]] = []  # (kind, axis, bytes) in issue order
        # label -> every axis name that is that label's process group (e.g. dp_shard_cp: dp_shard_cp, dp_shard, dp)
        self.same_group: dict[str, tuple[str, ...]] = {}
        self._groups: dict[str, tuple[str, int]] = {}
        if mesh is not None:
            self._groups, self.same_group = _axis_groups(mesh, axes)
        self._mode = _make_mode(self)

    def label(self, group: Any) -> str:
        """The label collectives on `group` (a ProcessGroup or its name) are counted under, so a reader
        can find a known group's traffic (FSDP's: `axis(mesh, "dp_shard_cp").get_group()`)."""
        name = group if isinstance(group, str) else group.group_name
        return self._groups.get(name, (f"group:{name}", None))[0]

    def _record(self, kind: str, group: str | None, size: int | None, nbytes: int) -> None:
        label, known_size = self._groups.get(group or "", (f"group:{group}", None))
        size = size or known_size
        stat = self.stats[(kind, label)]
        stat.count += 1
        stat.bytes += nbytes
        self.events.append((kind, label, nbytes))
        if size is not None:
            self.sizes[label] = size

    def __enter__(self) -> CommCounter:
        self._mode.__enter__()
        _active.counters = (*getattr(_active, "counters", ()), self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active.counters = tuple(c for c in getattr(_active, "counters", ()) if c is not self)
        self._mode.__exit__(*exc)

    def total_bytes(self) -> int:
        """Bytes over every collective counted so far."""
        return sum(s.bytes for s in self.stats.values())

    def wire_bytes(self, kind: str, axis: str) -> float:
        """Bytes one rank sends for (kind, axis) under ring algorithms."""
        n = self.sizes.get(axis, 1)
        factor = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n}
        return self.stats[(kind, axis)].bytes * factor.get(kind, 1.0)


# The axis FSDP shards over names its group before any other axis that is the same group: an axis
# spanning the whole world reuses the default group, so with cp = 1 (or dp_shard = 1) `dp_shard_cp` is
# one group with `dp_shard` (or `cp`), and FSDP's traffic, the heaviest, must carry one label under
# every plan, the one the estimator (`meshkit.estimate.comm`) uses.
_FIRST = ("dp_shard_cp",)
_DERIVED = ("dp", "dp_shard_cp", "dp_cp")


def _axis_groups(mesh: Any, axes: tuple[str, ...]) -> tuple[dict[str, tuple[str, int]], dict[str, tuple[str, ...]]]:
    """(group_name -> (axis label, size), label -> every axis name that is the same group).

    Where several axes are one process group, the label is `dp_shard_cp` when it is one of them, else
    the first base axis (outermost first), else the first derived axis."""
    names = list(mesh.mesh_dim_names or ()) + list(axes or _DERIVED)
    candidates = [n for n in _FIRST if n in names] + [n for n in names if n not in _FIRST]
    groups: dict[str, tuple[str, int]] = {}
    shared: dict[str, list[str]] = {}
    for name in candidates:
        try:
            group = axis(mesh, name).get_group()
        except (KeyError, RuntimeError, ValueError):
            continue
        label, _ = groups.setdefault(group.group_name, (name, group.size()))
        shared.setdefault(label, []).append(name)
    if dist.is_initialized():
        label, _ = groups.setdefault(dist.group.WORLD.group_name, ("world", dist.get_world_size()))
        shared.setdefault(label, []).append("world")
    return groups, {label: tuple(same) for label, same in shared.items()}


def _make_mode(counter: CommCounter) -> Any:
    base = dispatch_mode_base()

    class _CommMode(base):  # type: ignore[misc, valid-type]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            # Modes run before tensor subclasses; declining DTensor ops lets DTensor run first and
            # come back here with the plain-tensor ops it lowers to, collectives included.
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            kwargs = kwargs or {}
            name = func.__name__.split(".")[0]
            composite = getattr(_composite, "current", None)
            if composite is not None and func.namespace == "c10d" and name in ("send", "recv_"):
                if id(counter) not in composite.counted_by:
                    composite.counted_by.add(id(counter))
                    counter._record(composite.kind, composite.group, composite.size, composite.nbytes)
            elif func.namespace == "c10d" and name in _C10D_OPS:
                kind, idx = _C10D_OPS[name]
                group, size = _group_of(args)
                counter._record(kind, group, size, _nbytes(args[idx]))
            elif func.namespace == "_c10d_functional" and name in _FUNCTIONAL_OPS:
                kind = _FUNCTIONAL_OPS[name]
                group = args[-1] if isinstance(args[-1], str) else kwargs.get("group_name")
                nbytes = _nbytes(args[0])
                size = None
                if kind == "all_gather":  # args: input(s), group_size, group_name
                    size = int(args[1])
                    nbytes *= size
                counter._record(kind, group, size, nbytes)
            return func(*args, **kwargs)

    return _CommMode()

