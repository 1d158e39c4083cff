"""Load balancing of the `MoE` router: the statistics one forward leaves and the losses built on them.

Counts are summed over the layer's `load_group` (the ranks that split the batch), probabilities are
this rank's, so every loss here is this rank's share: summed over the load group it is the global
batch's. `AttachLoss` trains the router through the layer's output rather than the model's loss, so
an auxiliary loss works on any pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class RouterStats:
    """One forward's balancing statistics; sums over `load_group` give the global batch's.

    `prob_sum_E` and `lse_sq_sum` are this rank's sums (with graph); `counts_E` (routed assignments,
    before capacity drops) and `num_tokens` are already summed over the load group (no graph).
    """

    prob_sum_E: Tensor
    lse_sq_sum: Tensor
    counts_E: Tensor
    num_tokens: Tensor
    top_k: int


def switch_aux_loss(stats: RouterStats) -> Tensor:
    """Switch load-balancing loss, Megatron's scale: E/(K T²) Σ_e count_e · Σ_t p_te = 1 when balanced.

    HF's `load_balancing_loss_func` for one layer is K times this (E Σ_e f_e P_e with f summing to K).
    """
    E = stats.prob_sum_E.numel()
    T = stats.num_tokens.clamp(min=1)
    return (stats.counts_E * stats.prob_sum_E).sum() * (E / (stats.top_k * T * T))


def router_z_loss(stats: RouterStats) -> Tensor:
    """ST-MoE z-loss: the mean over the global batch of logsumexp(logits)²."""
    return stats.lse_sq_sum / stats.num_tokens.clamp(min=1)


def hf_load_balancing_loss(stats: list[RouterStats]) -> Tensor:
    """HF's `load_balancing_loss_func` (Mixtral, Qwen3-MoE) over these layers, before its coefficient.

    HF pools counts and probabilities over all layers before the product, E Σ_e f̄_e P̄_e, which no
    per-layer loss reproduces; this is that pooled value (this rank's share, as everywhere here).
    """
    E = stats[0].prob_sum_E.numel()
    rows = sum(s.num_tokens for s in stats).clamp(min=1)
    counts_E = sum(s.counts_E for s in stats)
    prob_sum_E = sum(s.prob_sum_E for s in stats)
    return (counts_E * prob_sum_E).sum() * (E / (rows * rows))


class AttachLoss(torch.autograd.Function):
    """Identity on `out`; in backward, `loss` receives gradient `scale` as if added to the model loss."""

    @staticmethod
    def forward(ctx, out: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.meta = (loss.shape, loss.dtype, loss.device, scale)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        shape, dtype, device, scale = ctx.meta
        return grad, torch.full(shape, scale, dtype=dtype, device=device), None
