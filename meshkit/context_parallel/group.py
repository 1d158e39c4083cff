"""The process group a context-parallel op runs on: every CP kind accepts a 1D mesh or a group."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def as_group(group: DeviceMesh | dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The ProcessGroup of a 1D mesh or group (None: the default group)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"context-parallel attention needs a 1D mesh for its axis, got {group.ndim}D")
        return group.get_group()
    return group if group is not None else dist.group.WORLD
