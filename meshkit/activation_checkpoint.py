"""Activation checkpointing per decoder block: full, or selective (keep matmul and attention outputs).

Full recompute keeps only each block's input (2sbh bytes per layer) and re-runs the whole block in
backward. Selective keeps the outputs of the expensive ops (matmuls, attention, and the reduce-scatter
that ends each SP region, so backward never re-communicates it) and recomputes the cheap elementwise
ops and norms that dominate activation memory for little compute.

Selective checkpointing replays by op count: the recompute's n-th call of an op gets the forward's
n-th output (or is re-run). Work a recompute legitimately does differently therefore runs outside
that bookkeeping (`_compat.hidden_from_selective_checkpoint`): the hooks of an FSDP unit nested in a
block (an MoE layer's experts, sharded over their own mesh: the forward all-gathers, the recompute
may find the weights prefetched and becomes FSDP's iteration root, with its own profiler labels) and
an MoE layer's routing (the recompute replays it, skipping the forward's top-k and dispatch
planning with their collectives). So every block, MoE or dense, is checkpointed selectively under
every plan.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from meshkit._compat.checkpointing import (
    enter_hidden_from_selective_checkpoint,
    exit_hidden_from_selective_checkpoint,
    selective_checkpoint_contexts,
)
from meshkit.context_parallel.kernels import ATTENTION_BLOCK_OP

# The activation_checkpointing values a Plan takes: nothing saved recomputed ("none"), the
# matmul / attention / collective outputs kept and the rest recomputed ("selective"), only each
# block's input kept ("full").
AC_MODES = ("none", "selective", "full")

def _saved_ops() -> set:
    aten = torch.ops.aten
    names = [
        "mm", "addmm", "bmm", "linear", "_grouped_mm",  # the last: MoE experts (aten op of torch._grouped_mm)
        "_scaled_mm", "max", "amax",  # float8: its matmul and the amax reductions its scales come from
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    ]
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    # meshkit's attention op (Ulysses' local kernel, packed documents without CP): recomputing it
    # re-ran the whole attention and, under Ulysses, its all-to-alls' inputs (found by the dry run)
    ops.add(ATTENTION_BLOCK_OP)
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
    return selective_checkpoint_contexts(_selective_policy)


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


def apply_activation_checkpointing(blocks: list[nn.Module], mode: str) -> list[nn.Module]:
    """Return the blocks wrapped for `mode` ("none" returns them unchanged)."""
    if mode == "none":
        return list(blocks)
    return [CheckpointedBlock(block, mode) for block in blocks]


def _enter_hidden(*_args) -> None:
    enter_hidden_from_selective_checkpoint()


def _exit_hidden(*_args) -> None:
    exit_hidden_from_selective_checkpoint()


def hide_hooks_from_selective_checkpoint(module: nn.Module) -> None:
    """Run the forward hooks already on `module` (FSDP's, for a unit nested in a checkpointed block)
    outside selective checkpointing's op bookkeeping; call it right after `fully_shard(module)`.

    Hooks registered around the existing ones open and close the region: one before the first
    pre-hook, one after the last; the same around the post-hooks (the closing one runs on errors too).
    """
    module.register_forward_pre_hook(_enter_hidden, prepend=True)
    module.register_forward_pre_hook(_exit_hidden)
    module.register_forward_hook(_enter_hidden, prepend=True)
    module.register_forward_hook(_exit_hidden, always_call=True)
