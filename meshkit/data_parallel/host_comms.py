"""FSDP's all-gathers and reduce-scatters through shared memory, for CPU ranks of one host.

gloo has no reduce-scatter: torch's `reduce_scatter_tensor` on gloo clones the input, all-reduces the
clone over loopback TCP (twice the bytes a reduce-scatter moves) and copies this rank's chunk out; its
all-gather goes through a temporary. On one host, FSDP2's units (ZeRO-1/2/3 alike) instead hand
their flat buffers to the shared-memory channel `shared_memory` opens among the shard
group's ranks, through FSDP2's custom-collective hooks (`_compat.fsdp.set_custom_comms`): an
all-gather copies this rank's shard into its slot and the peers' out of theirs, a reduce-scatter
copies each peer its chunk and sums its own chunk in rank order straight into FSDP's output buffer.
Same buffers, bytes and results as the collectives; a collective the channel refuses (larger than a
slot, no pages) or a reduction other than a sum (FSDP's is always a sum in meshkit,
`_compat.fsdp.fsdp_sum_gradients`) takes gloo on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshkit._compat.collectives import all_gather_single, reduce_scatter_single
from meshkit._compat.fsdp import set_custom_comms
from meshkit.transport import shared_memory


def route_through_shared_memory(modules: list[nn.Module], mesh: DeviceMesh) -> bool:
    """Give every FSDP unit in `modules` the channel's collectives when its shard group (the mesh's
    last axis: HSDP's is [replicate, shard]) is CPU ranks of one host on gloo; whether it did.

    Collective over the shard group (opening the channel); every rank decides alike."""
    if shared_memory.open_for(mesh.get_group(mesh.ndim - 1), mesh.device_type) is None:
        return False
    for module in modules:
        set_custom_comms(module[0] if isinstance(module, list) else module, _all_gather, _reduce_scatter)
    return True


# FSDP's flat buffers as one row: [k] shards gather into [1, size*k], a [1, size*k] input scatters into [1, k]
def _all_gather(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup, async_op: bool):
    if shared_memory.try_collective("all_gather", x.view(1, -1), group, out=out.view(1, -1)) is not None:
        return None  # done: FSDP2 treats a missing work handle as a finished collective
    return all_gather_single(out, x, group, async_op=async_op)


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup, op) -> None:
    if op == dist.ReduceOp.SUM and \
            shared_memory.try_collective("reduce_scatter", x.view(1, -1), group, out=out.view(1, -1)) is not None:
        return
    reduce_scatter_single(out, x, group, op)
