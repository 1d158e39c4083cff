"""Tensor subclasses taken apart into their inner tensors and rebuilt (DTensor, torchao's float8 tensors).

Activation offload copies what autograd saves to the host; a saved DTensor or float8 training tensor
is a wrapper around plain tensors (a local shard; float8 data and a scale). The wrapper-subclass
protocol torch.compile uses (`__tensor_flatten__` / `__tensor_unflatten__`) names those inner
tensors and rebuilds the wrapper from copies of them, whatever the subclass, so a copy never
gathers a sharded tensor. Private protocol (see `meshkit._compat`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor


def ready(t: torch.Tensor) -> torch.Tensor:
    """`t` with its values computed: a functional collective's result (`AsyncCollectiveTensor`) is a
    wrapper whose inner tensor is filled only once waited on, so it is waited on (and unwrapped) here."""
    return t.wait() if isinstance(t, AsyncCollectiveTensor) else t


def is_wrapper_subclass(t: torch.Tensor) -> bool:
    """Whether `t` is a subclass built on inner tensors (DTensor, float8 training tensors)."""
    return type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__")


def flatten(t: torch.Tensor) -> tuple[dict[str, torch.Tensor], Any]:
    """(inner values by attribute name, what rebuilding needs besides them) of a wrapper subclass. An inner
    tensor may be a wrapper itself; an inner value may be no tensor at all (torch 2.13's DTensor lists its
    mesh, an opaque object)."""
    names, ctx = t.__tensor_flatten__()
    return {name: getattr(t, name) for name in names}, (type(t), ctx, tuple(t.size()), tuple(t.stride()))


def unflatten(inner: dict[str, torch.Tensor], meta: Any) -> torch.Tensor:
    """The wrapper `flatten` took apart, rebuilt around `inner` (which may hold copies)."""
    cls, ctx, size, stride = meta
    return cls.__tensor_unflatten__(inner, ctx, size, stride)


def _holder(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `t`'s values: a wrapper's first inner tensor (a DTensor's local shard)."""
    while is_wrapper_subclass(t):
        t = next(v for v in flatten(t)[0].values() if isinstance(v, torch.Tensor))
    return t


def storage_key(t: torch.Tensor) -> int:
    """The identity of the storage holding `t`'s values (a wrapper's first inner tensor's: a DTensor's local
    shard), unique while it is alive: the address of its StorageImpl (`_cdata`), which, unlike the data's
    address, a fake tensor has and a storage FSDP2 freed by resizing keeps. Views and autograd's saved
    copies share it, so counting storages counts memory once."""
    return _holder(t).untyped_storage()._cdata


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes of the storage `storage_key` names."""
    return _holder(t).untyped_storage().nbytes()
