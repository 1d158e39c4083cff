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

import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves

from meshkit._compat.checkpointing import in_backward
from meshkit._compat.dispatch import dispatch_mode_base
from meshkit._compat.fake import is_fake

PARTS = ("parameters", "gradients", "optimizer", "activations", "fsdp_buffers", "temporaries")
_FSDP_CODE = "/torch/distributed/fsdp/"
# Allocations that are not the run's memory: DTensor derives an op's output shape by running it on
# global-shape fake tensors, reusing an active FakeTensorMode (a dry run's); a process-group backend
# works in buffers of its own (gloo reduce-scatters through an all-reduced copy; NCCL's buffers live
# outside PyTorch's allocator), which run below c10d's Python functions.
_NOT_THE_RUNS = ("/torch/distributed/tensor/_sharding_prop.py", "/torch/distributed/distributed_c10d.py")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class Peak:
    """The peak of the measured window: total live bytes, by part, and where it happened."""

    bytes: int
    parts: dict[str, int]
    phase: str         # "forward", "backward" or "optimizer"

    def as_dict(self) -> dict:
        """Plain data for the JSON report."""
        return {"peak_bytes": self.bytes, "parts": dict(self.parts), "peak_phase": self.phase}


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
        self._peak = 0
        self._peak_at = 0
        self._peak_phase = ""

    # ---------------------------------------------------------------------------- the mode
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs first; its local tensors' ops come back here
        out = func(*args, **(kwargs or {}))
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
        if key in self._live:
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
            if self._total > self._peak:
                self._peak, self._peak_at = self._total, len(self._log)
                self._peak_phase = self.phase if self.phase != "step" else ("backward" if in_backward() else "forward")

    def _part_now(self) -> str | None:
        """The part of an allocation made now, or None for one that is not memory of the run."""
        fsdp, frame = False, sys._getframe()
        while frame is not None:
            name = frame.f_code.co_filename
            if name.endswith(_NOT_THE_RUNS):
                return None
            fsdp = fsdp or _FSDP_CODE in name
            frame = frame.f_back
        if self.phase != "step":
            return self.phase
        if fsdp:
            return "fsdp_buffers"
        return "temporaries" if in_backward() else "activations"

    # ------------------------------------------------------------------------ measuring
    def adopt(self, tensors: Iterable[torch.Tensor], part: str) -> None:
        """Register storages that exist already (a model materialised before tracking began)."""
        for t in tensors:
            self._see(_local(t).untyped_storage(), part=part)

    @property
    def live_bytes(self) -> int:
        """Bytes alive now."""
        return self._total

    def begin_window(self) -> None:
        """Start the measured window: what is alive now is its baseline, the peak starts here."""
        self._baseline = {e[0]: (e[1], e[2]) for e in self._live.values()}
        self._log, self._parts = [], {}
        self._measuring = True
        self._peak, self._peak_at, self._peak_phase = self._total, 0, self.phase

    def end_window(self, *, parameters: Iterable[torch.Tensor], gradients: Iterable[torch.Tensor],
                   optimizer_state: Iterable[torch.Tensor]) -> Peak:
        """Stop measuring; split the peak by part, correcting parts by what storages turned out to be
        (call while the parameters, gradients and optimizer state named here are still alive)."""
        self._measuring = False
        known = {}
        for part, tensors in (("optimizer", optimizer_state), ("gradients", gradients), ("parameters", parameters)):
            for t in tensors:
                entry = self._live.get(_local(t).untyped_storage()._cdata)
                if entry is not None:
                    known[entry[0]] = part
        sizes = {i: b for i, (b, _) in self._baseline.items()}
        for i, delta in self._log[:self._peak_at]:
            sizes[i] = sizes.get(i, 0) + delta
        parts = dict.fromkeys(PARTS, 0)
        for i, nbytes in sizes.items():
            part = known.get(i) or self._parts.get(i) or self._baseline[i][1]
            if part == "optimizer" and i not in known:
                part = "temporaries"  # allocated by the optimizer step, not kept as its state
            parts[part] += nbytes
        return Peak(self._peak, parts, self._peak_phase)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
