"""torch's composable `replicate` (DDP's C++ reducer without the wrapper module), summing gradients.

Private API (`torch.distributed._composable.replicate`), present with the same surface in torch 2.11
and 2.13: `replicate(module, **ddp_kwargs)` keeps the module's class and parameter names (a wrapped
`DistributedDataParallel` would prefix every name with `module.`, which checkpoints and HF export
would see), and the module gains `set_requires_gradient_sync` and `register_comm_hook`.
"""

from __future__ import annotations

import inspect

import torch.distributed as dist
from torch import nn
from torch.distributed._composable.replicate import DDP, replicate
from torch.nn.parallel import DistributedDataParallel

from meshkit._compat.fake import is_fake_world


def _sum_hook(group, bucket):  # unannotated: DDP compares annotations with its own objects, not strings
    """All-reduce a bucket as a plain SUM. DDP's own hook divides by the group's size, and meshkit's loss
    already carries the global valid-token denominator: averaging would scale gradients twice."""
    buffer = bucket.buffer()  # reduced in place: the future hands the same tensor back
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda _: buffer)


# torch 2.13 renamed DDP's `broadcast_buffers` (deprecated there) to `forward_sync_buffers`; 2.11 has only the old.
_NO_BUFFER_SYNC_EACH_FORWARD = ({"forward_sync_buffers": False}
                                if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                                else {"broadcast_buffers": False})


def replicate_summing(module: nn.Module, group: dist.ProcessGroup, bucket_cap_mb: float) -> nn.Module:
    """Make `module` data parallel over `group`: gradients all-reduced (summed) in buckets of at most
    `bucket_cap_mb` as backward produces them. Gradients are views into the buckets (no second copy);
    buffers are not broadcast each forward (meshkit's are deterministic: rotary tables)."""
    # The dry run's fake world has no values for what DDP's C++ reads from tensors: the set-up's shape
    # check and broadcast (the dry run measures the step, which set-up precedes), and the broadcast of
    # bucket indices when the buckets are rebuilt in gradient order after the first step (never done
    # while DDP looks for unused parameters; the buckets' total, and so the memory and bytes, are alike).
    setup = {"init_sync": False, "find_unused_parameters": True} if is_fake_world() else {}
    replicate(module, process_group=group, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True,
              **_NO_BUFFER_SYNC_EACH_FORWARD, **setup)
    module.register_comm_hook(group, _sum_hook)
    return module


def start_replicating(module: nn.Module) -> None:
    """Build DDP's reducer now (torch builds it lazily, at the first forward): it broadcasts rank 0's
    parameters over the group and checks their shapes agree, collectives that belong to set-up, not
    to the first training step. Only once the parameters are materialised (not on the meta device)."""
    state = replicate.state(module)
    if state._init_args or state._init_kwargs:
        state.lazy_init()


def is_replicated(module: nn.Module) -> bool:
    """Whether `replicate_summing` (torch's composable replicate) manages `module`."""
    return isinstance(module, DDP)
