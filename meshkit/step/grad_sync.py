"""Gradient sums meshkit issues itself after backward, beside FSDP's reduce-scatter.

Three kinds of weights are held whole by several ranks that each see different tokens, so each rank's
gradient is a partial sum: MoE layers under tensor parallelism (every TP rank routes its own
sequence shard through the same router and experts), a tied embedding under pipelining (stage
0 holds the embedding, the last stage a copy as the LM head), and every weight under DualPipe (pp
ranks r and pp-1-r hold the same two chunks of layers, each copy running half the microbatches).
Their gradients are summed over the ranks sharing them once per `forward_backward` call.

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

from meshkit.local_tensor import local_tensor


@contextlib.contextmanager
def summed_per_call(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None) -> Iterator[None]:
    """Around one forward/backward: on a normal exit, sum the gradients it produced over `group`."""
    if not params or group is None:
        yield
        return
    with _this_call_only(params):
        yield
        for p in params:
            if p.grad is not None:
                dist.all_reduce(local_tensor(p.grad), group=group)


@contextlib.contextmanager
def copies_summed_per_call(copies: Sequence[nn.Parameter]) -> Iterator[None]:
    """Around one forward/backward: every local copy of one weight ends with the sum of the call's
    gradients of all of them (earlier accumulated gradients kept as they were).

    The case of a tied embedding under a V-shaped pipeline: the first and the last stage are both on
    pp rank 0, each with its own copy (they are different FSDP roots, which cannot share a
    parameter), so the sum that `summed_per_call` makes over ranks is made here, without traffic.
    The copies are sharded alike, so their local shards add up elementwise.
    """
    if len(copies) < 2:
        yield
        return
    with _this_call_only(copies):
        yield
        grads = [p.grad for p in copies if p.grad is not None]
        if grads:
            total = local_tensor(grads[0]).clone()
            for grad in grads[1:]:
                total.add_(local_tensor(grad))
            for p in copies:
                if p.grad is None:
                    p.grad = grads[0].clone()
                local_tensor(p.grad).copy_(total)


@contextlib.contextmanager
def mirror_summed_per_call(params: Sequence[nn.Parameter], group: dist.ProcessGroup | None) -> Iterator[None]:
    """Around one forward/backward: sum the call's gradients of `params` over `group` in ONE all-reduce.

    DualPipe's mirror pair holds every weight twice, so every gradient is summed: flattened into one
    fp32 buffer (plus one presence flag per tensor), so the step pays one collective's latency, not one
    per tensor. `params` must come in the same order and local shapes on both ranks (sorted by name;
    the pair shares every other mesh coordinate, so FSDP, TP and EP shard them alike). A gradient
    missing on one copy travels as zeros and one missing on both stays missing, as on one device.
    Called after FSDP's reduce-scatter and after `copies_summed_per_call` (a tied embedding's two local
    copies), so it adds whole local gradients.
    """
    if not params or group is None:
        yield
        return
    with _this_call_only(params):
        yield
        locals_ = [local_tensor(p.grad) if p.grad is not None else None for p in params]
        sizes = [local_tensor(p).numel() for p in params]
        device = local_tensor(params[0]).device
        flat = torch.cat([*(g.reshape(-1).float() if g is not None else torch.zeros(n, device=device)
                            for g, n in zip(locals_, sizes)),
                          torch.tensor([float(g is not None) for g in locals_], device=device)])
        dist.all_reduce(flat, group=group)
        pieces = flat[: sum(sizes)].split(sizes)
        present = flat[sum(sizes):].tolist()
        for p, piece, flag in zip(params, pieces, present):
            if flag == 0:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local_tensor(p.grad).copy_(piece.view_as(local_tensor(p.grad)))


def summed_in_place(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Replace each tensor by its sum over `group`, in one all-reduce (one dtype; the same order and
    shapes on every rank): DualPipe's two copies of a router's load counts before its bias update."""
    if not tensors or group is None:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(piece.view_as(t))


@contextlib.contextmanager
def every_sum_of_a_call(mirror: tuple, tp_summed: tuple, tied: tuple) -> Iterator[None]:
    """All of meshkit's own sums around one forward/backward, each a (params, group) pair, in the order
    they compose: a tied weight's local copies first, then the sums over ranks, DualPipe's mirror
    pair last (it adds whole local gradients)."""
    (tied_params, tied_group) = tied
    with mirror_summed_per_call(*mirror), summed_per_call(*tp_summed), summed_per_call(tied_params, tied_group), \
            copies_summed_per_call(tied_params if tied_group is None else []):
        yield


@contextlib.contextmanager
def _this_call_only(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """Set the earlier accumulated gradients of `params` aside for the call and add them back after it
    (also when it raises), so that only the call's own contribution is summed."""
    earlier = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, old in zip(params, earlier):
            if old is None:
                continue
            if p.grad is None:
                p.grad = old
            else:
                local_tensor(p.grad).add_(local_tensor(old))
