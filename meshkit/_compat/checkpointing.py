"""Activation checkpointing internals: selective checkpointing's dispatch modes and regions it must
not count, and whether a forward is a recompute.

Private or version-gated torch APIs (see `meshkit._compat`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch
from torch.utils import checkpoint as torch_checkpoint

_sac_hidden = threading.local()  # depth of `hidden_from_selective_checkpoint` regions on this thread


@contextlib.contextmanager
def hidden_from_selective_checkpoint() -> Iterator[None]:
    """A region whose ops selective activation checkpointing neither caches nor counts: they simply
    run, in the forward and in the recompute alike. Every other dispatch mode (communication and FLOP
    counters) still sees them.

    For work a recompute legitimately does differently from its forward: FSDP's hooks of a unit
    nested in the checkpointed block (the forward all-gathers, the recompute may find the weights
    prefetched and becomes FSDP's iteration root), or an MoE layer's routing, which the recompute
    replays instead of re-running. torch (through 2.13) counts every op under selective
    checkpointing and fails the recompute when one op runs more often than in the forward; ops that
    run less often shift nothing only while none of them is saved. Both sides of that hazard vanish
    for ops that are not counted at all (the idea of torch PR #185178, unmerged).
    """
    enter_hidden_from_selective_checkpoint()
    try:
        yield
    finally:
        exit_hidden_from_selective_checkpoint()


def enter_hidden_from_selective_checkpoint() -> None:
    """Open a `hidden_from_selective_checkpoint` region where no `with` fits (a pair of module hooks);
    regions nest, and each must be closed by `exit_hidden_from_selective_checkpoint` on this thread."""
    _sac_hidden.depth = getattr(_sac_hidden, "depth", 0) + 1


def exit_hidden_from_selective_checkpoint() -> None:
    """Close the innermost region opened by `enter_hidden_from_selective_checkpoint` on this thread."""
    _sac_hidden.depth = max(getattr(_sac_hidden, "depth", 0) - 1, 0)


def _profiler_ops() -> frozenset:
    """The record_function enter/exit ops: annotations, not computation, whose labels FSDP varies."""
    ops = set()
    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        if packet is not None:
            ops.update(getattr(packet, o) for o in packet.overloads())
    return frozenset(ops)


@functools.cache
def _sac_mode_letting_through(base: type) -> type:
    """A subclass of one of torch's two private SAC dispatch modes that runs profiler ops and ops of
    `hidden_from_selective_checkpoint` regions untracked, and everything else as `base` does."""
    through = _profiler_ops()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(_sac_hidden, "depth", 0) or func in through:
            return func(*args, **(kwargs or {}))
        return base.__torch_dispatch__(self, func, types, args, kwargs)

    # Higher-order ops find their handlers by the mode's exact type, registered for `base`; this
    # routes them through __torch_dispatch__ as those handlers do.
    return type(f"Untracking{base.__name__}", (base,), {"__torch_dispatch__": __torch_dispatch__,
                                                       "supports_higher_order_operators": True})


def selective_checkpoint_contexts(policy_fn: Callable) -> tuple:
    """torch's `create_selective_checkpoint_contexts(policy_fn)`, whose two dispatch modes let
    profiler annotations and `hidden_from_selective_checkpoint` regions through untracked.

    The modes are torch's own objects with their class swapped for a subclass (built once per torch
    class), so their constructors, storage and replay stay torch's, whatever the version.
    """
    forward_mode, recompute_mode = torch_checkpoint.create_selective_checkpoint_contexts(policy_fn)
    for mode in (forward_mode, recompute_mode):
        mode.__class__ = _sac_mode_letting_through(type(mode))
    return forward_mode, recompute_mode


def in_backward() -> bool:
    """True while the autograd engine runs on this thread: a forward now is a checkpoint recompute.

    `torch._C._current_graph_task_id` is the only signal shared by reentrant, non-reentrant and
    selective checkpointing.
    """

    return torch._C._current_graph_task_id() != -1
