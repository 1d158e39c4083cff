"""Activation checkpointing per decoder block: full, or selective (keep matmul and attention outputs).

Full recompute keeps only each block's input (2sbh bytes per layer) and re-runs the whole block in
backward. Selective keeps the outputs of the expensive ops (matmuls, attention, and the reduce-scatter
that ends each SP region, so backward never re-communicates it) and recomputes the cheap elementwise
ops and norms that dominate activation memory for little compute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _saved_ops() -> set:
    aten = torch.ops.aten
    names = [
        "mm", "addmm", "bmm", "linear", "_grouped_mm",  # the last: MoE experts (aten op of torch._grouped_mm)
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ]
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    if functional is not None and hasattr(functional, "reduce_scatter_tensor"):
        ops.add(functional.reduce_scatter_tensor.default)
    return ops


@functools.lru_cache(maxsize=1)
def _saved_ops_cached() -> frozenset:
    return frozenset(_saved_ops())


def is_saved_op(op) -> bool:
    """Whether selective checkpointing keeps this op's output (the estimator counts exactly these)."""
    return op in _saved_ops_cached()


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if is_saved_op(op) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


class CheckpointedBlock(nn.Module):
    """Wraps a block so its forward runs under `torch.utils.checkpoint` (non-reentrant).

    A wrapper rather than a patched forward keeps FSDP's hooks outside the recomputed region when
    FSDP is applied to the wrapper, so recompute never triggers a second all-gather.
    """

    def __init__(self, block: nn.Module, mode: str):
        super().__init__()
        if mode not in ("full", "selective"):
            raise ValueError(f"activation_checkpointing={mode!r}: must be 'full' or 'selective' here")
        self.block = block
        self.mode = mode

    def forward(self, *args, **kwargs):
        """Run the wrapped block under checkpointing; arguments pass through unchanged."""
        extra = {"context_fn": _selective_context} if self.mode == "selective" else {}
        return checkpoint(self.block, *args, use_reentrant=False, preserve_rng_state=False, **extra, **kwargs)


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str,
                                   full_only: Callable[[nn.Module], bool] | None = None) -> list[nn.Module]:
    """Return the blocks wrapped for `mode` ("none" returns them unchanged).

    Blocks for which `full_only` (if given) is true get full checkpointing under "selective": selective
    checkpointing replays the forward's op sequence by position, which a block whose recompute
    legitimately skips ops (an MoE layer replaying its stored routing under TP or EP, where the
    forward's dispatch planning issues collectives the recompute does not) would break.
    """
    if mode == "none":
        return list(blocks)
    return [CheckpointedBlock(block, "full" if mode == "selective" and full_only and full_only(block) else mode)
            for block in blocks]


def moe_blocks_full(tp: int, ep: int) -> bool:
    """Whether "selective" checkpoints MoE blocks fully: with tp > 1 or ep > 1 their recompute replays
    the stored routing without the forward's dispatch planning, which SAC's op replay cannot follow."""
    return tp > 1 or ep > 1
