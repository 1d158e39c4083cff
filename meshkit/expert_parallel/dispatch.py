"""Token dispatch: every (token, expert) assignment travels to the rank holding its expert and back.

The path, for A = T*K assignments on a rank of an expert-parallel group of size R, each rank holding
a contiguous block of E/R experts:

1. per-expert counts with `bincount`; one stable argsort of the assignments by expert, which is also
   by destination rank because expert blocks are contiguous;
2. counts exchanged with an all-to-all, then ONE host sync brings every split size to the host;
3. the rows go out with an uneven `all_to_all_single` (autograd: backward is the same collective with
   the splits swapped) and arrive source-rank-major; a stable argsort regroups them expert-major;
4. after the experts: the inverse regrouping, the all-to-all back, and a scatter-add per token of the
   rows weighted by their routing weights, in fp32.

Everything derived from the routing lives in a `DispatchPlan`, so activation-checkpoint recompute can
reuse it: no second count exchange, no second host sync, and the same split sizes by construction.
A rank with no tokens, or whose experts receive none, still joins every collective with empty tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


def _all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all along dim 0 whose backward is the same collective with the splits swapped.

    A Function of our own rather than the functional collective: its context holds two lists of ints
    and the group, nothing tensor-sized, so nothing outlives the graph under activation checkpointing
    (the notes' AC + autograd all-to-all leak), and it runs on every torch version meshkit supports.
    """

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> Tensor:
        ctx.splits = (out_splits, in_splits)
        ctx.group = group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup) -> Tensor:
    """Differentiable uneven `all_to_all_single`: rows `in_splits[r]` go to rank r, `out_splits[r]` come back."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def count_per_expert(expert_A: Tensor, num_bins: int) -> Tensor:
    """Exact int64 count of each value in [0, num_bins).

    `bincount` rather than `histc` (float bins, inexact past 2**24 and unsupported for ints on CPU).
    CUDA's bincount reads the input's max back to the host, which would be a second sync per layer,
    so accelerators count with a scatter-add instead (integer adds: exact and order-free).
    """
    if expert_A.device.type == "cpu":
        return torch.bincount(expert_A, minlength=num_bins)
    counts = torch.zeros(num_bins, dtype=torch.int64, device=expert_A.device)
    return counts.scatter_add_(0, expert_A, torch.ones_like(expert_A))


def capacity_mask(expert_TK: Tensor, score_TK: Tensor, num_experts: int, capacity_factor: float) -> Tensor:
    """Which assignments survive a capacity of ceil(cf·T·K/E) per expert: each expert keeps its
    highest-scoring ones, ties in token order. On this rank's tokens, so it needs no communication
    and a rank's drops do not depend on what other ranks route."""
    T, K = expert_TK.shape
    capacity = math.ceil(capacity_factor * T * K / num_experts)
    expert_A, score_A = expert_TK.reshape(-1), score_TK.reshape(-1)
    by_score = torch.argsort(-score_A, stable=True)
    order_A = by_score[torch.argsort(expert_A[by_score], stable=True)]  # expert-major, best first
    counts_E = count_per_expert(expert_A, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    rank_in_expert_A = torch.arange(order_A.numel(), device=order_A.device) - starts_E[expert_A[order_A]]
    keep_A = torch.empty_like(expert_A, dtype=torch.bool)
    keep_A[order_A] = rank_in_expert_A < capacity
    return keep_A.view(T, K)


@dataclass
class DispatchPlan:
    """Where each kept assignment goes and how the rows come back; computed once per routing.

    `order_A` lists kept assignments (flat indices t*K + k) expert-major; `token_A` their tokens.
    Split lists are per ep rank; `regroup_G` / `ungroup_G` permute received rows between
    source-rank-major and expert-major (None when the order is already expert-major).
    """

    num_tokens: int
    order_A: Tensor
    token_A: Tensor
    send_splits: list[int]
    recv_splits: list[int]
    tokens_per_local_expert: list[int]
    local_counts_E: Tensor  # the same on the device (the grouped GEMM's offsets)
    regroup_G: Tensor | None
    ungroup_G: Tensor | None
    counts_E: Tensor  # this rank's kept assignments per (global) expert, on device
    dropped: int  # assignments this rank dropped for capacity, from the same host sync
    group: ProcessGroup | None


def plan_dispatch(
    expert_TK: Tensor, num_experts: int, group: ProcessGroup | None = None, keep_TK: Tensor | None = None
) -> DispatchPlan:
    """Plan the dispatch of routing `expert_TK` (global expert ids) over the expert-parallel `group`.

    `keep_TK` (bool) marks assignments that survived a capacity limit; dropped ones get the sentinel
    id E, which sorts after every real expert and is counted in the same `bincount`, so the drop count
    reaches the host in the one sync. The only host sync of the layer happens here.
    """
    T, K = expert_TK.shape
    ep = 1 if group is None else dist.get_world_size(group)
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {ep}")
    local = num_experts // ep
    expert_A = expert_TK.reshape(-1).long()
    if keep_TK is not None:
        expert_A = torch.where(keep_TK.reshape(-1), expert_A, num_experts)
    counts_E1 = count_per_expert(expert_A, num_experts + 1)
    order_A = torch.argsort(expert_A, stable=True)  # expert-major, token order within an expert
    if ep == 1:
        host = counts_E1.tolist()  # the one host sync
        kept = sum(host[:num_experts])
        order_A = order_A[:kept]
        counts_E = counts_E1[:num_experts]
        return DispatchPlan(T, order_A, order_A // K, [kept], [kept], host[:num_experts], counts_E, None, None,
                            counts_E, host[num_experts], None)
    # recv_RE[r, e]: rows source rank r sends to this rank's local expert e.
    recv_RE = _all_to_all(counts_E1[:num_experts], [local] * ep, [local] * ep, group)
    host = torch.cat([counts_E1, recv_RE]).tolist()  # the one host sync
    counts, dropped, recv = host[:num_experts], host[num_experts], host[num_experts + 1 :]
    send_splits = [sum(counts[r * local : (r + 1) * local]) for r in range(ep)]
    recv_splits = [sum(recv[r * local : (r + 1) * local]) for r in range(ep)]
    tokens_per_local_expert = [sum(recv[e::local]) for e in range(local)]
    order_A = order_A[: sum(send_splits)]
    regroup_G = ungroup_G = None
    if local > 1:
        local_expert_G = torch.repeat_interleave(
            torch.arange(local, device=recv_RE.device).repeat(ep), recv_RE, output_size=sum(recv_splits)
        )
        regroup_G = torch.argsort(local_expert_G, stable=True)  # expert-major, source rank within
        ungroup_G = torch.empty_like(regroup_G)
        ungroup_G[regroup_G] = torch.arange(regroup_G.numel(), device=regroup_G.device)
    local_counts_E = recv_RE.view(ep, local).sum(0)
    return DispatchPlan(T, order_A, order_A // K, send_splits, recv_splits, tokens_per_local_expert,
                        local_counts_E, regroup_G, ungroup_G, counts_E1[:num_experts], dropped, group)


def dispatch(x_TH: Tensor, plan: DispatchPlan) -> Tensor:
    """This rank's tokens -> the rows of this rank's local experts, expert-major ([G, H])."""
    rows = x_TH.index_select(0, plan.token_A)
    if plan.group is not None:
        rows = all_to_all(rows, plan.recv_splits, plan.send_splits, plan.group)
    if plan.regroup_G is not None:
        rows = rows.index_select(0, plan.regroup_G)
    return rows


def combine(y_GH: Tensor, plan: DispatchPlan, weights_TK: Tensor) -> Tensor:
    """Expert outputs -> per-token outputs [T, H]: rows return home and are summed with their weights.

    The weighting and the sum run in fp32 (bf16 expert outputs included), then cast back once.
    """
    if plan.ungroup_G is not None:
        y_GH = y_GH.index_select(0, plan.ungroup_G)
    if plan.group is not None:
        y_GH = all_to_all(y_GH, plan.send_splits, plan.recv_splits, plan.group)
    weights_A = weights_TK.reshape(-1).float().index_select(0, plan.order_A)
    out_TH = torch.zeros(plan.num_tokens, y_GH.shape[-1], dtype=torch.float32, device=y_GH.device)
    out_TH = out_TH.index_add(0, plan.token_A, y_GH.float() * weights_A[:, None])
    return out_TH.to(y_GH.dtype)
