"""Collectives under names that changed between torch versions, the functional (traceable) ones,
point-to-point without per-call checks, and the process groups' store and timeouts.

Private or version-gated torch APIs (see `meshkit._compat`).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d


def all_to_all_autograd(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 whose backward is the same all-to-all (functional collectives)."""

    out = funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)
    return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """All-gather into one tensor (ranks' inputs concatenated on dim 0): torch 2.13 renamed
    `all_gather_into_tensor` to `all_gather_single` and deprecates the old name; 2.11 has only that.
    Returns the work handle when `async_op`."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    """Reduce-scatter of one tensor (dim 0 split over ranks; a sum unless `op`), under either torch's name."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, op=op, group=group)


def functional_reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum-reduce-scatter `x` over `group` along dim 0 as the functional collective DTensor issues.

    Selective activation checkpointing recognises that op (`_c10d_functional.reduce_scatter_tensor`)
    and keeps its output, so a recomputed block does not communicate again; a c10d call would be
    re-issued. The op namespace is private in torch 2.11-2.13.
    """
    ops = torch.ops._c10d_functional
    out = ops.reduce_scatter_tensor(x, "sum", dist.get_world_size(group), group.group_name)
    return ops.wait_tensor(out)


def p2p_send(group, tensor: torch.Tensor, group_peer: int, tag: int):
    """Start a point-to-point send on `group` to its rank `group_peer`; returns the Work.

    `dist.isend` is this call behind per-call Python checks (group lookup, global-to-group rank
    translation, tensor checks) that the pipeline runtime, which checked its peers and tensors once
    per schedule, pays on the critical path for every message. `ProcessGroup.send` is the bound c10d
    method `dist.isend` ends in, in 2.11 through 2.13.
    """
    return group.send([tensor], group_peer, tag)


def p2p_recv(group, tensor: torch.Tensor, group_peer: int, tag: int):
    """Start a point-to-point receive into `tensor` from `group`'s rank `group_peer` (see `p2p_send`)."""
    return group.recv([tensor], group_peer, tag)


def default_store():
    """The store the default process group rendezvoused with (the heartbeat's channel), or None."""
    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def default_group_timeout_s() -> float | None:
    """The default process group's collective timeout in seconds as its CPU backend holds it, or None.

    Read back (not taken from the config) so a log line shows the timeout really in force.
    """
    try:
        backend = distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _group_timeout(group) -> timedelta | None:
    """A process group's collective timeout as its first backend holds it, or None."""
    for device in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def set_default_group_timeout(timeout: timedelta) -> None:
    """Set the default process group's collective timeout after it was formed (`_set_pg_timeout` is
    private in 2.11-2.13), so forming it may wait longer than a collective may (see mesh.ensure_process_group)."""
    distributed_c10d._set_pg_timeout(timeout, distributed_c10d._get_default_group())


def align_group_timeouts() -> None:
    """Give every process group made without a timeout the default group's (`[train] timeout_s`).

    torch gives a group made by `new_group(timeout=None)`, as `init_device_mesh` and
    `DeviceMesh._flatten` make the mesh's axes, its backend's stock timeout (30 min for gloo, 10 for
    NCCL), not the default group's: a collective hung on a mesh axis (FSDP, TP, the gradient norm)
    ignored `init_process_group(timeout=...)`. Groups whose timeout someone set (not the stock one)
    are left alone. `_set_pg_timeout` and the world's group map are private (2.11-2.13).
    """
    if not dist.is_initialized():
        return
    default = distributed_c10d._get_default_group()
    target = _group_timeout(default)
    stock = {getattr(distributed_c10d, name, None) for name in ("default_pg_timeout", "default_pg_nccl_timeout")}
    if target is None or target in stock:
        return
    for group in list(distributed_c10d._world.pg_map):
        if group is default or _group_timeout(group) not in stock:
            continue
        try:
            distributed_c10d._set_pg_timeout(target, group)
        except (AssertionError, RuntimeError, ValueError):  # a group without a backend on this rank
            continue


def group_timeout_s(group) -> float | None:
    """A process group's collective timeout in seconds, or None where its backend does not say."""
    timeout = _group_timeout(group)
    return timeout.total_seconds() if timeout is not None else None
