"""The routing an MoE forward decided, kept for its activation-checkpoint recompute to replay.

Recompute runs forward again inside backward; re-running top-k there can pick other experts (a bias
update in between, non-deterministic kernels, near ties) and silently corrupt gradients. So each
forward that builds a graph records its decision in a `Routing` owned by the graph (a `KeepAlive`
identity on the router logits); the layer keeps weak references in forward order and a recompute
takes the oldest live one. A record retires when backward passes the router (after any recompute of
the layer) or when its graph is freed, so nothing accumulates. Backward must visit a layer's forwards
in forward order, as a plain loop, gradient accumulation and every pipeline schedule do.
"""

from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from meshkit.expert_parallel.dispatch import DispatchPlan


@dataclass(eq=False)
class Routing:
    """One forward's routing decision, replayed by its recompute."""

    num_tokens: int = 0
    expert_TK: Tensor | None = None
    plan: DispatchPlan | None = None
    counts_E: Tensor | None = None  # routed counts summed over the load group (for stats)
    num_tokens_global: Tensor | None = None
    retired: bool = False


class KeepAlive(torch.autograd.Function):
    """Identity whose graph node owns a `Routing`: it lives as long as the graph and retires when
    backward reaches the router logits, which is after any recompute of the layer."""

    @staticmethod
    def forward(ctx, x: Tensor, routing: Routing) -> Tensor:
        ctx.routing = routing
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.routing is not None:
            ctx.routing.retired = True
            ctx.routing = None
        return grad, None


def remember(records: deque[weakref.ref[Routing]], routing: Routing) -> deque[weakref.ref[Routing]]:
    """`records` without the retired or freed ones, and `routing` appended (the newest forward)."""
    kept = deque(r for r in records if (live := r()) is not None and not live.retired)
    kept.append(weakref.ref(routing))
    return kept


def pop_oldest(records: deque[weakref.ref[Routing]], num_tokens: int) -> Routing | None:
    """The oldest live record, retired now (a recompute of `num_tokens` tokens replays it), or None."""
    while records:
        routing = records.popleft()()
        if routing is None or routing.retired:
            continue
        if routing.num_tokens != num_tokens:
            raise RuntimeError(
                f"MoE recompute saw {num_tokens} tokens but the oldest pending forward routed "
                f"{routing.num_tokens}: backward must visit this layer's forwards in forward order"
            )
        routing.retired = True
        return routing
    return None
