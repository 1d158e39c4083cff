"""Fake worlds: torch's fake process group, fake-tensor internals and storage resizes, what the dry
run (`meshkit.dryrun`) builds a world of thousands of ranks in one process from.

Private or version-gated torch APIs (see `meshkit._compat`). Present in torch 2.11 through 2.13.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils.weak import WeakTensorKeyDictionary

#: What a fake tensor raises where an op's output depends on values it does not have.
VALUE_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException)


def join_fake_world(world_size: int, rank: int) -> None:
    """Make this process rank `rank` of a world of `world_size` ranks whose collectives return at once
    without moving data (torch's "fake" backend, registered by a module of torch's test suite, on an
    in-memory store): every process group, of any size, costs no thread and no socket."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def is_fake_world() -> bool:
    """Whether the default process group is the fake backend's."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def is_fake(tensor: object) -> bool:
    """Whether `tensor` is a FakeTensor (shapes, dtype and device without storage)."""
    return isinstance(tensor, FakeTensor)


def fake_constant(tensor: FakeTensor) -> torch.Tensor | None:
    """The real value a FakeTensor carries (a scalar built from a Python number, such as an optimizer's
    `step`), or None."""
    return tensor.constant


def fake_mode_of(tensor: FakeTensor) -> FakeTensorMode:
    """The FakeTensorMode a fake tensor belongs to."""
    return tensor.fake_mode


def forget_fake_memo(tensor: torch.Tensor) -> None:
    """Drop the weak reference a FakeTensorMode keeps to each fake tensor an op returned (its
    converter's memo), so that `torch.utils.swap_tensors`, which refuses weakly referenced tensors,
    can give a meta parameter a fake tensor's body. A no-op on real tensors."""
    if not isinstance(tensor, FakeTensor):
        return
    memo = tensor.fake_mode.fake_tensor_converter.meta_converter.tensor_memo
    for key in [k for k, v in memo.items() if v is tensor]:
        del memo[key]


def weak_tensor_dict() -> WeakTensorKeyDictionary:
    """A dict keyed by tensor identity that does not keep its keys alive (`torch.utils.weak`, whose
    lookup never calls a tensor's elementwise `==`)."""
    return WeakTensorKeyDictionary()


@contextlib.contextmanager
def storage_resizes(callback: Callable[[torch.UntypedStorage, int], None]) -> Iterator[None]:
    """Call `callback(storage, new_nbytes)` before every `UntypedStorage.resize_` while the body runs.

    FSDP2 frees a gathered parameter by resizing its storage to 0 and re-allocates it by resizing it
    back, through a method no dispatch mode sees; memory tracking must see both.
    """
    original = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int):
        callback(storage, int(size))
        return original(storage, size)

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]


def view_of_storage(storage: torch.UntypedStorage, dtype: torch.dtype, device: torch.device, like: torch.Tensor,
                    view: tuple | None = None) -> torch.Tensor:
    """A tensor of `dtype` over `storage` (`Tensor.set_`): all of it, or `view` = (offset, size, stride).

    Under fake tensors (`like` is one) the op bypasses the fake mode's dispatch cache, whose key holds
    the storage object itself: cached, a storage is never freed, and the dry run's tracker counted every
    storage activation offload copied as alive into the next step (a 1B model's peak 30.9 GiB, not 8.6).
    """
    empty = torch.empty(0, dtype=dtype, device=device)
    mode = like.fake_mode if isinstance(like, FakeTensor) else None
    cached = mode.cache_enabled if mode is not None else False
    if mode is not None:
        mode.cache_enabled = False
    try:
        return empty.set_(storage) if view is None else empty.set_(storage, *view)
    finally:
        if mode is not None:
            mode.cache_enabled = cached


_HOST = {"depth": 0}


@contextlib.contextmanager
def host_allocations() -> Iterator[None]:
    """Tensors allocated while the body runs are host memory standing apart from the device's (activation
    offload's copies): the dry run's tracker, which measures a device, leaves them out."""
    _HOST["depth"] += 1
    try:
        yield
    finally:
        _HOST["depth"] -= 1


def allocating_on_host() -> bool:
    """Whether a `host_allocations` body is running."""
    return _HOST["depth"] > 0


def process_group_arg(args: tuple) -> dist.ProcessGroup | None:
    """The ProcessGroup among a c10d op's arguments (they arrive boxed as ScriptObjects), or None."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg)
            except (RuntimeError, TypeError):
                continue
    return None


def group_by_name(group_name: str) -> dist.ProcessGroup:
    """The process group registered under `group_name` (`_resolve_process_group`)."""
    return _resolve_process_group(group_name)


def group_size_by_name(group_name: str) -> int:
    """Size of the process group a functional collective names."""
    return group_by_name(group_name).size()


def reduce_op_is_sum(op: object) -> bool:
    """Whether a c10d op's boxed ReduceOp argument is SUM (`ReduceOp.op()` returns its RedOpType code)."""
    return int(op.op()) == int(dist.ReduceOp.RedOpType.SUM)  # type: ignore[attr-defined]
