"""One data rank's batch -> what this rank's stage runs: checked, shifted once, counted, cut for cp.

Order matters for the loss semantics: labels are shifted on the full sequence (position t predicts
labels[t+1]) before any context sharding, and valid targets are counted over every data rank before
the forward, so the loss denominator is the global batch's. Checks run first, on every rank, and end
in one all-or-none collective: a bad batch raises on every rank, naming the failing ones.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshkit.context_parallel import sharding as cp_sharding
from meshkit.mesh import axis
from meshkit.plan import Plan
from meshkit.step import loss as loss_lib
from meshkit.step.consensus import sum_unless_any


class LocalBatch(NamedTuple):
    """What this rank feeds its stage: its context shard of ids, shifted targets, positions, documents."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor | None
    valid_tokens: int


def prepare(input_ids, labels, position_ids, *, plan: Plan, mesh: DeviceMesh, config: Any, device: torch.device,
            check: bool = True) -> LocalBatch:
    """Check (unless `check` is False), shift once on the full sequence, count globally, then cut
    this rank's context shard. Collective: the count over the data ranks; when checking, the verdict
    and the count in one world all-reduce, after the peers' batch comparison."""
    problem = None
    if check:
        problem = input_problem(input_ids, labels, position_ids, plan, config)
        # Every rank joins the same collectives whatever it found locally, or the peers hang.
        if plan.pp * plan.tp * plan.cp > 1:
            disagreement = peer_agreement_problem(input_ids if problem is None else None, mesh, device)
            problem = problem or disagreement
    if problem is None:
        input_ids = input_ids.to(device)
        targets = loss_lib.shift_labels(labels.to(device))
    if check:
        # The pp/cp/tp peers of a data rank hold its batch (compared above): the world's sum counts
        # each data rank's tokens pp*cp*tp times.
        count = torch.zeros(1, dtype=torch.int64, device=device) if problem else \
            loss_lib.local_valid_tokens(targets).view(1)
        valid = int(sum_unless_any(problem, count).item()) // (plan.pp * plan.cp * plan.tp)
    else:
        valid = loss_lib.global_valid_tokens(targets, axis(mesh, "dp").get_group())
    batch, seq = input_ids.shape
    doc_ids = None
    if position_ids is None:
        position_ids = torch.arange(seq, device=device).unsqueeze(0)
    else:
        position_ids = position_ids.to(device).expand(batch, seq)
        docs = cp_sharding.document_ids(position_ids)
        doc_ids = docs if bool(docs.max() > 0) else None
    if plan.cp > 1:
        cut = functools.partial(cp_sharding.shard, layout=plan.cp_layout, cp=plan.cp,
                                rank=axis(mesh, "cp").get_local_rank(), dim=1, ulysses=plan.ulysses_degree)
        input_ids, targets = cut(input_ids), cut(targets)
        position_ids = cut(position_ids.expand(batch, seq)) if doc_ids is not None else cut(position_ids)
        doc_ids = cut(doc_ids) if doc_ids is not None else None
    return LocalBatch(input_ids, targets, position_ids, doc_ids, valid)


def input_problem(input_ids, labels, position_ids, plan: Plan, config: Any) -> str | None:
    """What is wrong with this rank's batch for `plan` and the model `config`, or None (no collective)."""
    vocab = config.vocab_size
    if not isinstance(input_ids, torch.Tensor) or not isinstance(labels, torch.Tensor):
        return "input_ids and labels must be torch.Tensor [batch, seq]"
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        return f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} {tuple(input_ids.shape)}"
    if labels.shape != input_ids.shape:
        return f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}"
    batch, seq = input_ids.shape
    if batch < 1 or seq < 2:
        return f"input_ids {tuple(input_ids.shape)}: need a batch of at least one sequence of at least 2 tokens"
    if plan.pp > 1 and batch % plan.microbatches:
        return (f"batch of {batch} sequences does not split into pp_microbatches={plan.microbatches}; "
                f"fix: a local batch that is a multiple of {plan.microbatches}")
    seq_problem = plan.seq_len_problem(seq)
    if seq_problem:
        return f"sequence length {seq}: {seq_problem}"
    targets = labels.masked_fill(labels == loss_lib.IGNORE_INDEX, 0)
    lo, hi, t_lo, t_hi = torch.stack([input_ids.min(), input_ids.max(), targets.min(), targets.max()]).tolist()
    if lo < 0 or hi >= vocab:
        return f"input_ids hold token ids in [{lo}, {hi}], outside the vocabulary [0, {vocab})"
    if t_lo < 0 or t_hi >= vocab:
        return (f"labels hold ids in [{t_lo}, {t_hi}]; each must be in [0, {vocab}) "
                f"or {loss_lib.IGNORE_INDEX} (ignored)")
    if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[1] != seq
                                     or position_ids.shape[0] not in (1, batch)):
        return f"position_ids {tuple(position_ids.shape)} must be [1 or {batch}, {seq}]"
    return None


def peer_agreement_problem(input_ids: torch.Tensor | None, mesh: DeviceMesh, device: torch.device) -> str | None:
    """TP and CP peers split one batch; different batches would silently mix. Compare cheaply.

    A rank whose input is already known bad (None) still joins, with a signature that disagrees.
    """
    peers = axis(mesh, "pp_cp_tp")
    if input_ids is None:
        signature = torch.full((3,), -1, dtype=torch.int64, device=device)
    else:
        ids = input_ids.to(device, torch.int64)
        weights = torch.arange(1, ids.numel() + 1, device=device, dtype=torch.int64).view_as(ids)
        signature = torch.stack([torch.tensor(ids.shape[0], device=device),
                                 torch.tensor(ids.shape[1], device=device),
                                 (ids * weights).sum() % 1_000_000_007])
    both = torch.cat([signature, -signature])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=peers.get_group())
    smallest = -both[3:]
    if input_ids is None or bool((smallest == -1).all()) or torch.equal(both[:3], smallest):
        return None  # agreement, or a peer already failed and will report its own reason
    return ("pipeline/tensor/context-parallel peers received different batches (shape or content); ranks with the "
            "same pm.dp_rank must load identical input_ids and labels")
