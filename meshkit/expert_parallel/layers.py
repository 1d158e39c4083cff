"""What a model's MoE layers do together: found, their DeepSeek-V3 biases stepped in one all-reduce
per load group, their attached aux losses summed for logging, their router statistics popped."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from meshkit.expert_parallel.balancing import RouterStats
from meshkit.expert_parallel.moe import MoE


def moe_layers(module: nn.Module) -> list[MoE]:
    """Every meshkit MoE layer under `module`."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def update_expert_biases(module: nn.Module) -> None:
    """`update_bias` on every MoE under `module`, with one all-reduce per distinct load group."""
    layers = [m for m in moe_layers(module) if m.load_counts_E is not None and m.selection_bias is not None]
    by_group: dict[int, list[MoE]] = {}
    for m in layers:
        by_group.setdefault(id(m.load_group), []).append(m)
    for group_layers in by_group.values():
        loads = torch.cat([m.load_counts_E for m in group_layers])
        group = group_layers[0].load_group
        if group is not None:
            dist.all_reduce(loads, group=group)
        for m, loads_E in zip(group_layers, loads.split([m.num_experts for m in group_layers])):
            m.update_bias(loads_E)


def aux_loss_value(module: nn.Module) -> Tensor | None:
    """Sum of the attached aux losses of the last forward (detached; this rank's share, for logging)."""
    losses = [m.aux_loss for m in moe_layers(module) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def pop_router_stats(module: nn.Module) -> list[RouterStats]:
    """The `router_stats` of every MoE with `keep_router_stats`, cleared so graphs are not kept alive."""
    stats = []
    for m in moe_layers(module):
        if m.router_stats is not None:
            stats.append(m.router_stats)
            m.router_stats = None
    return stats
