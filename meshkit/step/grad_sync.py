"""Gradient sums meshkit issues itself after backward, beside FSDP's reduce-scatter.

Two kinds of weights are held whole by several ranks that each see different tokens, so each rank's
gradient is a partial sum: MoE layers under tensor parallelism (every TP rank routes its own
sequence shard through the same router and experts), and a tied embedding under pipelining (stage
0 holds the embedding, the last stage a copy as the LM head). Their gradients are summed over the
ranks sharing them once per `forward_backward` call.

Only the call's own contribution may be summed: under gradient accumulation `.grad` already holds
the window's earlier (summed) calls, and summing it again would count them once per sharing rank.
So the earlier gradient is set aside during the call and added back after the sum.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@contextlib.contextmanager
def summed_per_call(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None) -> Iterator[None]:
    """Around one forward/backward: on a normal exit, sum the gradients it produced over `group`."""
    if not params or group is None:
        yield
        return
    earlier = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
        for p in params:
            if p.grad is not None:
                dist.all_reduce(_local(p.grad), group=group)
    finally:
        for p, old in zip(params, earlier):
            if old is None:
                continue
            if p.grad is None:
                p.grad = old
            else:
                _local(p.grad).add_(_local(old))
