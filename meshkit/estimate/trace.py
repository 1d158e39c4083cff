"""Recording what a forward keeps for backward, attributed to the layer part that was running.

The one measuring instrument of the estimator, shared by the dense block trace (`activations`, under
FakeTensorMode) and the MoE layer measurement (`moe`, on small real tensors):

- `saved_tensors_hooks` see every tensor autograd saves (what AC "none" keeps);
- a dispatch mode sees every op output, and keeps those meshkit's selective policy marks MUST_SAVE
  (what AC "selective" keeps);
- forward pre/post hooks on the modules of interest say which part is running.

Storages are deduplicated (a view saved twice costs once) and parameter storages are excluded:
parameters are model state, not activations.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from meshkit._compat.dispatch import dispatch_mode_base
from meshkit._compat.subclasses import storage_key, storage_nbytes
from meshkit.activation_checkpoint import is_saved_op


class Recorder:
    """Attributes saved tensors and MUST_SAVE outputs to the part running when they appear."""

    def __init__(self, exclude: set[int]) -> None:
        self.exclude = exclude  # parameter storages
        self.stack: list[str] = []
        self.saved: dict[int, tuple[str, int]] = {}
        self.cached: dict[int, tuple[str, int]] = {}
        self.keep: list[torch.Tensor] = []  # keeps storages alive so their keys stay unique

    def part(self, default: str) -> str:
        """The innermost part running now, or `default` between parts."""
        return self.stack[-1] if self.stack else default

    def on_saved(self, tensor: torch.Tensor, default: str) -> None:
        """Count a tensor autograd saves, once per storage."""
        key = storage_key(tensor)
        if key not in self.exclude and key not in self.saved:
            self.saved[key] = (self.part(default), storage_nbytes(tensor))
            self.keep.append(tensor)

    def on_output(self, func: Any, out: Any, default: str) -> None:
        """Count the outputs of an op selective checkpointing keeps, once per storage."""
        if not is_saved_op(func):
            return
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                key = storage_key(t)
                if key not in self.cached:
                    self.cached[key] = (self.part(default), storage_nbytes(t))
                    self.keep.append(t)


@contextmanager
def recording(recorder: Recorder, module_parts: dict[nn.Module, str], default: str) -> Iterator[None]:
    """Feed `recorder` while the body runs; `module_parts` name the part each module's forward is."""
    def enter(part: str) -> Any:
        def hook(*_: Any) -> None:
            recorder.stack.append(part)

        return hook

    def leave(*_: Any) -> None:  # returns None: a forward hook's return value would replace the output
        recorder.stack.pop()

    handles = []
    for module, part in module_parts.items():
        handles.append(module.register_forward_pre_hook(enter(part)))
        handles.append(module.register_forward_hook(leave))

    class _Outputs(dispatch_mode_base()):  # type: ignore[misc]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            recorder.on_output(func, out, default)
            return out

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        recorder.on_saved(tensor, default)
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Outputs():
            yield
    finally:
        for handle in handles:
            handle.remove()


def by_part(entries: dict[int, tuple[str, int]], skip: set[int]) -> dict[str, int]:
    """Recorded bytes summed by part, leaving out the storages in `skip`."""
    out: dict[str, int] = defaultdict(int)
    for key, (part, nbytes) in entries.items():
        if key not in skip:
            out[part] += nbytes
    return dict(out)
