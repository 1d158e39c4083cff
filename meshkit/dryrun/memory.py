"""Live bytes of one rank, tracked at allocation, with the peak split into what each byte is for.

`AllocationTracker` is a dispatch mode: every storage an op creates is registered with its size and
the part it was allocated for, and unregistered when it is freed (a weak reference on the storage);
FSDP2's resizes of gathered parameters (`UntypedStorage.resize_`, which no dispatch mode sees) are
followed too. It works alike on fake tensors (the dry run) and on real ones (the gloo runs the dry
run is checked against), so both sides are measured by one instrument.

The part of a storage is decided when it is allocated:

- `parameters`: while the model is materialised (module buffers included);
- `activations`: by a forward (a stage, a block, the loss), recompute excepted;
- `temporaries`: by backward (gradients of activations, recomputed activations, weight gradients
  before FSDP reduces them), or by the optimizer step without being kept;
- `fsdp_buffers`: by FSDP2's own code (gathered parameters, all-gather and reduce-scatter buffers);
- `optimizer`: by the optimizer step.

and corrected once the step is over by what the storages turned out to be: the local shards of the
parameters, their gradients (FSDP2 creates the sharded gradients in its reduce-scatter) and the
optimizer's state. The peak is the largest live total of the measured window; its split is rebuilt
from an allocation log, so the per-part bytes are those of the peak moment, not of the end.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from meshkit._compat.checkpointing import in_backward
from meshkit._compat.dispatch import dispatch_mode_base
from meshkit._compat.fake import allocating_on_host, is_fake
from meshkit._compat.subclasses import flatten, is_wrapper_subclass
from meshkit.transport.shared_memory import mapped_buffers

LARGEST = 12  # allocations listed with the peak (the largest live ones)
HOST = "host"  # activation offload's copies (`_compat.fake.host_allocations`): never the device's bytes
PARTS = ("parameters", "gradients", "optimizer", "activations", "fsdp_buffers", "temporaries")
_FSDP_CODE = "/torch/distributed/fsdp/"
# Allocations that are not the run's memory: DTensor derives an op's output shape by running it on
# global-shape fake tensors, reusing an active FakeTensorMode (a dry run's); a process-group backend
# works in buffers of its own (gloo reduce-scatters through an all-reduced copy; NCCL's buffers live
# outside PyTorch's allocator), which run below c10d's Python functions.
_NOT_THE_RUNS = ("/torch/distributed/tensor/_sharding_prop.py", "/torch/distributed/distributed_c10d.py")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _transport_storages() -> set[int]:
    """The storages of the shared-memory channels TP and FSDP open among CPU ranks of one host: a transport's own buffers,
    held for the process's life, like gloo's (which the dry run's fake world has no counterpart of)."""
    return {t.untyped_storage()._cdata for t in mapped_buffers()}


@dataclass(frozen=True)
class Peak:
    """The peak of the measured window: total live bytes, by part, and where it happened."""

    bytes: int
    parts: dict[str, int]
    phase: str         # "forward", "backward" or "optimizer"
    largest: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)  # (bytes, part, op) at the peak

    def as_dict(self) -> dict:
        """Plain data for the JSON report."""
        return {"peak_bytes": self.bytes, "parts": dict(self.parts), "peak_phase": self.phase,
                "largest": [list(x) for x in self.largest]}


class AllocationTracker(dispatch_mode_base()):  # type: ignore[misc]
    """Registers every storage ops create (see the module docstring); enter it above FakeTensorMode
    and every other mode, so it sees each op's outputs last."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "parameters"   # "parameters", "step" or "optimizer": set by the driver
        self._live: dict[int, list] = {}   # storage cdata -> [allocation id, bytes now, part, weak reference]
        self._next = 0
        self._total = 0
        self._log: list[tuple[int, int]] = []   # (allocation id, change in bytes), measured window only
        self._baseline: dict[int, tuple[int, str]] = {}  # allocation id -> (bytes, part) when measuring began
        self._parts: dict[int, str] = {}         # allocation id -> part, for the log's allocations
        self._measuring = False
        self._phases: dict[int, str] = {}
        self._window_phase = ""
        self._op: object = "resize_"              # the op whose outputs are being registered
        self._ops: dict[int, object] = {}          # allocation id -> that op, for the log's allocations

    # ---------------------------------------------------------------------------- the mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs first; its local tensors' ops come back here
        out = func(*args, **(kwargs or {}))
        self._op = func
        for t in tree_leaves(out):
            if type(t) in _PLAIN or is_fake(t):  # a wrapper subclass's own storage holds no data
                self._see(t.untyped_storage())
        return out

    def on_resize(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """`UntypedStorage.resize_` is about to give `storage` `nbytes` (FSDP2 freeing or re-gathering)."""
        entry = self._live.get(storage._cdata)
        if entry is None:
            self._see(storage, nbytes, part="fsdp_buffers")
            return
        self._change(entry, nbytes - entry[1])

    def _see(self, storage: torch.UntypedStorage, nbytes: int | None = None, part: str | None = None) -> None:
        key = storage._cdata
        if key in self._live or key in _transport_storages():
            return
        part = part or self._part_now()
        if part is None:
            return
        entry = [self._next, 0, part, None]
        self._next += 1
        self._live[key] = entry
        entry[3] = weakref.ref(storage, lambda _, key=key, entry=entry: self._freed(key, entry))
        if self._measuring:
            self._parts[entry[0]] = entry[2]
            self._ops[entry[0]] = self._op
        self._change(entry, storage.nbytes() if nbytes is None else nbytes)

    def _freed(self, key: int, entry: list) -> None:
        if self._live.get(key) is entry:
            del self._live[key]
            self._change(entry, -entry[1])

    def _change(self, entry: list, delta: int) -> None:
        if not delta:
            return
        entry[1] += delta
        self._total += delta
        if self._measuring:
            self._log.append((entry[0], delta))
            if delta > 0:  # where a later peak could be: the phase of each growth (1 + log index -> phase)
                self._phases[len(self._log)] = self.phase if self.phase != "step" else \
                    ("backward" if in_backward() else "forward")

    def _part_now(self) -> str | None:
        """The part of an allocation made now, or None for one that is not memory of the run."""
        fsdp, frame = False, sys._getframe()
        while frame is not None:
            name = frame.f_code.co_filename
            if name.endswith(_NOT_THE_RUNS):
                return None
            fsdp = fsdp or _FSDP_CODE in name
            frame = frame.f_back
        if allocating_on_host():
            return HOST
        if self.phase != "step":
            return self.phase
        if fsdp:
            return "fsdp_buffers"
        return "temporaries" if in_backward() else "activations"

    # ------------------------------------------------------------------------ measuring
    def adopt(self, tensors: Iterable[torch.Tensor], part: str) -> None:
        """Register storages that exist already (a model materialised before tracking began)."""
        for t in tensors:
            for inner in _data(t):
                self._see(inner.untyped_storage(), part=part)

    @property
    def live_bytes(self) -> int:
        """Bytes alive now."""
        return self._total

    def begin_window(self) -> None:
        """Start the measured window: what is alive now is its baseline, the peak starts here."""
        self._baseline = {e[0]: (e[1], e[2]) for e in self._live.values()}
        self._log, self._parts, self._phases, self._ops = [], {}, {}, {}
        self._measuring = True
        self._window_phase = self.phase

    def end_window(self, *, parameters: Iterable[torch.Tensor], gradients: Iterable[torch.Tensor],
                   optimizer_state: Iterable[torch.Tensor], host: tuple[str, ...] = ()) -> Peak:
        """Stop measuring; return the window's peak split by part, parts corrected by what storages
        turned out to be (call while the parameters, gradients and optimizer state named here are
        alive). Parts named in `host` live in host memory (`Plan.offload`): they are left out of the
        peak, which is then the device's."""
        self._measuring = False
        known = {}
        for part, tensors in (("optimizer", optimizer_state), ("gradients", gradients), ("parameters", parameters)):
            for t in tensors:
                for inner in _data(t):
                    entry = self._live.get(inner.untyped_storage()._cdata)
                    if entry is not None:
                        known[entry[0]] = part
        parts_of = {i: p for i, (_, p) in self._baseline.items()} | self._parts
        for i, part in parts_of.items():
            if i in known:
                parts_of[i] = known[i]
            elif part == "optimizer":
                parts_of[i] = "temporaries"  # allocated by the optimizer step, not kept as its state
        counted = {i for i, part in parts_of.items() if part not in host and part != HOST}
        sizes = {i: b for i, (b, _) in self._baseline.items()}
        total = sum(b for i, b in sizes.items() if i in counted)
        peak, peak_at = total, 0
        for n, (i, delta) in enumerate(self._log, 1):
            if i in counted:
                total += delta
                if total > peak:
                    peak, peak_at = total, n
        for i, delta in self._log[:peak_at]:
            sizes[i] = sizes.get(i, 0) + delta
        parts = dict.fromkeys(PARTS, 0)
        for i, nbytes in sizes.items():
            if i in counted:
                parts[parts_of[i]] += nbytes
        largest = sorted(((b, parts_of[i], str(self._ops.get(i, "before the window"))) for i, b in sizes.items()
                          if i in counted and b), reverse=True)[:LARGEST]
        return Peak(peak, parts, self._phases[peak_at] if peak_at else self._window_phase, largest)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _data(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding `t`'s values: a wrapper subclass's inner ones (float8 training wraps each
    projection weight's shard; its own storage holds nothing, and the dry run missed the shards)."""
    t = _local(t)
    if not is_wrapper_subclass(t) or is_fake(t):
        return [t]
    return [x for inner in flatten(t)[0].values() if isinstance(inner, torch.Tensor) for x in _data(inner)]
