"""ZeRO-1, -2 and -3 as three ways of driving the same FSDP2 units, set per `forward_backward` call.

Every stage keeps FSDP2's sharded fp32 parameters as the optimizer's parameters, so the optimizer
state is sharded over dp_shard x cp in all three and any torch.optim optimizer steps only its
rank's slice (FSDP2's sharding is per parameter, dim 0, torch.chunk's split). The stages differ in
what is replicated between the sharded steps:

- ZeRO-3: parameters gathered per unit for its forward and again for its backward; each unit's
  gradient reduce-scattered as soon as its backward ends (3 Psi moved per step).
- ZeRO-2: parameters gathered once, at the first forward of an accumulation window, and kept
  through every forward and backward of the window (`reshard_after_forward` off, resharding only
  after the window's last backward); each unit's gradient reduce-scattered as soon as its backward
  ends, so no full gradient persists (2 Psi per step).
- ZeRO-1: parameters as ZeRO-2; gradients are not reduced during backward: the full local gradient
  of every unit persists (replicated in shape on every rank) until the sync point, then one
  reduce-scatter hands each rank the slice it steps (2 Psi per step).

The gather "after the step" is the next forward's: the same bytes, once per window, and the optimizer
step runs without the full parameters in memory. `grad_sync` picks the sync point: every call
(`every_microbatch`) or only the window's last (`last_microbatch`, gradients accumulate unreduced).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule

from meshkit._compat.fsdp import fsdp_post_backward
from meshkit.data_parallel.replicate import replicated_call, replicated_roots


def data_parallel_roots(modules: list[nn.Module]) -> list[nn.Module]:
    """What `backward_call` drives: the stages `data_parallel.replicate` made data parallel, or else the
    outermost FSDP2 modules (`fsdp_roots`)."""
    return replicated_roots(modules) or fsdp_roots(modules)


def fsdp_roots(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The outermost FSDP2 modules inside `modules`; flags set on one reach its nested units."""
    roots: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, FSDPModule):
            roots.append(module)
            return
        for child in module.children():
            visit(child)

    for module in modules:
        visit(module)
    return roots


def defers_reduction(roots: list[nn.Module], zero: int) -> bool:
    """Whether gradients are reduced only after backward ends (ZeRO-1 over FSDP units; DDP's replicas
    finish their reduction inside backward, whatever the zero stage says)."""
    return zero == 1 and any(isinstance(root, FSDPModule) for root in roots)


def syncs_now(grad_sync: str, last_microbatch: bool) -> bool:
    """Whether this call's gradients cross ranks: every call, or only the accumulation window's last."""
    return grad_sync == "every_microbatch" or last_microbatch


def reshards_now(zero: int, last_microbatch: bool) -> bool:
    """Whether gathered parameters are freed after this call's backward (ZeRO-1/2 keep them for the
    window's next call; ZeRO-3 never keeps them)."""
    return zero == 3 or last_microbatch


@contextlib.contextmanager
def backward_call(roots: list[nn.Module], zero: int, grad_sync: str, last_microbatch: bool) -> Iterator[None]:
    """Around one forward and backward (no pipelining): set FSDP2's flags for the stage and the policy,
    and under ZeRO-1 reduce-scatter the full accumulated gradients after backward when this call syncs.
    Replicated stages (`data_parallel.replicate`) reduce at the window's last call, whatever the zero
    stage and `grad_sync` say: with nothing sharded, reducing earlier calls would free nothing."""
    replicas = replicated_roots(roots)
    if replicas:
        with replicated_call(replicas, last_microbatch):
            yield
        return
    sync, reshard = syncs_now(grad_sync, last_microbatch), reshards_now(zero, last_microbatch)
    if not roots:
        yield
        return
    for root in roots:
        # ZeRO-1 defers every reduction past backward: FSDP accumulates unsharded gradients meanwhile.
        root.set_requires_gradient_sync(sync and zero >= 2)
        root.set_reshard_after_backward(reshard and zero >= 2)
    try:
        yield
        if zero == 1:
            for root in roots:
                root.set_reshard_after_backward(reshard)
                if sync:
                    root.set_requires_gradient_sync(True)
                    fsdp_post_backward(root)
    finally:
        for root in roots:
            root.set_requires_gradient_sync(True)
            root.set_reshard_after_backward(True)
