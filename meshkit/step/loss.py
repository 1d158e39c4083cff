"""Loss semantics: the single-device loss of the global batch, whatever the plan.

`sum(token losses) / count(labels != -100)` over every data-parallel rank, context shard and
microbatch. Labels are shifted once, on the full sequence, before anything shards it; the
denominator is counted globally before the forward, so no rank ever averages a mean (per-rank means
averaged across ranks are wrong as soon as ranks hold different numbers of valid tokens).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


class LossParts(NamedTuple):
    """A step's loss and its two terms, each detached and identical on every rank."""

    loss: torch.Tensor  # ce + aux: what the gradients are of
    ce: torch.Tensor  # the single-device cross-entropy of the global batch
    aux: torch.Tensor  # router auxiliary terms as they entered the gradients (0 without any)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets aligned with the inputs: position t predicts labels[t+1]; the last predicts nothing."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def local_valid_tokens(shifted: torch.Tensor) -> torch.Tensor:
    """Valid targets this rank holds, as an int64 scalar on its device."""
    return (shifted != IGNORE_INDEX).sum(dtype=torch.int64)


def global_valid_tokens(shifted: torch.Tensor, group: dist.ProcessGroup | None) -> int:
    """Valid targets over the ranks of `group` (the data-parallel ranks): the loss denominator."""
    count = local_valid_tokens(shifted)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return int(count.item())


def summed_cross_entropy(logits: torch.Tensor, shifted: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies; works on vocab-sharded DTensor logits under `loss_parallel`."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), shifted.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def global_loss(share: torch.Tensor, groups: list[dist.ProcessGroup]) -> torch.Tensor:
    """Every rank's share of the loss (each already divided by the global denominator) summed over
    `groups` (size-1 groups skipped): detached, fp32, identical on every rank."""
    total = share.detach()
    if isinstance(total, DTensor):
        total = total.full_tensor()
    total = total.float().clone()
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return total
