"""`pm.forward`: the logits of a data rank's batch under any plan, equal to the single-device model's.

Training never materialises logits outside the loss; using the trained model does. The same stages
run, with three differences from `forward_backward`:

- Any sequence length: a length the plan cannot split (cp's layout, SP's tp multiple) is padded on
  the right and the padding's logits dropped. Attention is causal, so a padded token never changes
  the logits of the tokens before it.
- Pipelining walks the stages in order, one batch at a time (no microbatches, so any batch size),
  sending hidden states from stage to stage; the last stage's logits are then broadcast over pp, so
  every rank gets them.
- The logits come back for the whole sequence of the local batch, in token order: context shards
  are gathered over cp (and put back in order from the zig-zag layout). The vocabulary stays split
  over tp (a DTensor, `Shard(2)`, so evaluation and sampling can stay sharded) unless `gather=True`.

The HF module's own `forward` and `generate` after `parallelize` are `inference.hf_forward`'s (the
stages run there with autograd, for trainers' losses).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from meshkit.context_parallel import sharding as cp_sharding
from meshkit.data_parallel.fsdp import reshard_fsdp
from meshkit.local_tensor import local_tensor
from meshkit.mesh import axis
from meshkit.pipeline.p2p import wire_tensor
from meshkit.pipeline.schedules import first_pipeline, stage_placement
from meshkit.plan import DTYPES
from meshkit.step.batch import peer_agreement_problem
from meshkit.step.consensus import raise_if_any

if TYPE_CHECKING:
    from meshkit.parallel_model import ParallelModel


class StageInputs(NamedTuple):
    """What this rank's first stage runs: its context shard of the (padded) ids, positions, documents."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor | None
    padded_len: int  # the sequence length after padding, before the cp cut


def ids_problem(input_ids, position_ids, config, what: str = "input_ids") -> str | None:
    """What is wrong with token ids [batch, seq] (and optional position ids) for this model, or None."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int64,
                                                                                                torch.int32):
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        return f"{what} must be an integer tensor [batch, seq], got {shape}"
    batch, seq = input_ids.shape
    if batch < 1 or seq < 1:
        return f"{what} {tuple(input_ids.shape)}: need at least one sequence of at least one token"
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= config.vocab_size:
        return f"{what} hold token ids in [{lo}, {hi}], outside the vocabulary [0, {config.vocab_size})"
    if position_ids is not None and (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
                                     or position_ids.shape[1] != seq or position_ids.shape[0] not in (1, batch)):
        return f"position_ids must be [1 or {batch}, {seq}], got {getattr(position_ids, 'shape', position_ids)}"
    return None


def check_inputs(pm: ParallelModel, input_ids, problem: str | None) -> None:
    """Raise on every rank if any rank's input is bad or peers that must share a batch disagree.

    Every rank joins the same two small collectives whatever it found, as `forward_backward` does.
    """
    plan = pm.plan
    if plan.pp * plan.tp * plan.cp > 1:
        disagreement = peer_agreement_problem(input_ids if problem is None else None, pm.mesh, pm.device)
        problem = problem or disagreement
    raise_if_any(problem, device=pm.device)


def stage_inputs(pm: ParallelModel, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
                 past: int = 0) -> StageInputs:
    """Pad to the plan's sequence multiple and cut this rank's context shard.

    `past` tokens already sit in a KV cache: positions continue from there (no cp then).
    """
    plan = pm.plan
    ids = input_ids.to(pm.device)
    batch, seq = ids.shape
    multiple = plan.seq_multiple()
    padded = math.ceil(seq / multiple) * multiple
    ids = F.pad(ids, (0, padded - seq))
    doc_ids = None
    if position_ids is None:
        pos = torch.arange(past, past + padded, device=pm.device).unsqueeze(0)
    else:
        pos = position_ids.to(pm.device).expand(batch, seq)
        pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, padded - seq + 1, device=pm.device)], dim=1)
        docs = cp_sharding.document_ids(pos)
        doc_ids = docs if bool(docs.max() > 0) else None
    if plan.cp > 1:
        rank = axis(pm.mesh, "cp").get_local_rank()

        def cut(t):
            return cp_sharding.shard(t, plan.cp_layout, plan.cp, rank, dim=1, ulysses=plan.ulysses_degree)

        ids = cut(ids)
        pos = cut(pos.expand(batch, padded)) if doc_ids is not None else cut(pos)
        doc_ids = cut(doc_ids) if doc_ids is not None else None
    return StageInputs(ids, pos, doc_ids, padded)


def run_stages(pm: ParallelModel, inputs: StageInputs, cache=None) -> torch.Tensor | None:
    """This rank's stages on the whole local batch; the last stage's output (logits), None elsewhere.

    Under pp the stages of the schedule's first pipeline run in order (all stages; DualPipe's down
    pipeline), each rank receiving the previous stage's hidden states and sending its own on by
    point-to-point messages, or handing them on locally when the next stage is its own (the V's tip);
    with several stages per rank a rank runs several of them.
    """
    kwargs = {"doc_ids": inputs.doc_ids, "cache": cache}
    stages = pm.stages
    if pm.plan.pp == 1:
        (stage,) = stages.values()
        return stage(inputs.input_ids, inputs.position_ids, **kwargs)
    plan = pm.plan
    pp_axis = axis(pm.mesh, "pp")
    group, me = pp_axis.get_group(), pp_axis.get_local_rank()
    order = first_pipeline(plan.pp_schedule, plan.pp, plan.pp_virtual_stages)
    owner = stage_placement(plan.pp_schedule, plan.pp, plan.pp_stages_per_rank)
    batch, local_seq = inputs.input_ids.shape
    sp = plan.tp if plan.tp > 1 and plan.sequence_parallel else 1
    hidden_shape = (batch, local_seq // sp, pm.model.config.hidden_size)
    hidden = None
    for s in order:
        if owner[s] != me:
            continue
        if s > 0 and owner[s - 1] != me:
            hidden = torch.empty(hidden_shape, dtype=DTYPES[plan.param_dtype], device=pm.device)
            dist.recv(hidden, src=dist.get_global_rank(group, owner[s - 1]), group=group)
        out = stages[s](inputs.input_ids if s == 0 else hidden, inputs.position_ids, **kwargs)
        if s == order[-1]:
            return out
        if owner[s + 1] == me:
            hidden = wire_tensor(out)
        else:
            dist.send(wire_tensor(out), dst=dist.get_global_rank(group, owner[s + 1]), group=group)
    return None


def last_stage_rank(pm: ParallelModel) -> int:
    """The pp rank whose stage ends the first pipeline (the logits' source): pp-1, or 0 under a V."""
    plan = pm.plan
    order = first_pipeline(plan.pp_schedule, plan.pp, plan.pp_virtual_stages)
    return stage_placement(plan.pp_schedule, plan.pp, plan.pp_stages_per_rank)[order[-1]]


def vocab_sharded(pm: ParallelModel) -> bool:
    """Whether the LM head leaves each tp rank 1/tp of the vocabulary."""
    return pm.plan.tp > 1 and pm.plan.loss_parallel


def to_every_pp_rank(pm: ParallelModel, local: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """The last stage's fp32 tensor on every pipeline rank (the others allocate `shape` and receive)."""
    if pm.plan.pp == 1:
        return local
    pp_axis = axis(pm.mesh, "pp")
    if local is None:
        local = torch.empty(shape, dtype=torch.float32, device=pm.device)
    group = pp_axis.get_group()
    dist.broadcast(local, src=dist.get_global_rank(group, last_stage_rank(pm)), group=group)
    return local


def local_logits(out) -> torch.Tensor | None:
    """This rank's part of the logits as a plain fp32 tensor."""
    if out is None:
        return None
    return local_tensor(out).float().contiguous()


@torch.no_grad()
def forward(pm: ParallelModel, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, *,
            gather: bool = False) -> torch.Tensor:
    """Logits [B, S, V] (fp32) of this data rank's batch, on every rank; see the module docstring."""
    check_inputs(pm, input_ids, ids_problem(input_ids, position_ids, pm.model.config))
    plan = pm.plan
    batch, seq = input_ids.shape
    inputs = stage_inputs(pm, input_ids, position_ids)
    vocab = pm.model.config.vocab_size
    local_vocab = vocab // plan.tp if vocab_sharded(pm) else vocab
    logits = to_every_pp_rank(pm, local_logits(run_stages(pm, inputs)),
                              (batch, inputs.input_ids.shape[1], local_vocab))
    for part in pm.model_parts:
        reshard_fsdp(part)
    if plan.cp > 1:
        cp_axis = axis(pm.mesh, "cp")
        shards = [torch.empty_like(logits) for _ in range(plan.cp)]
        dist.all_gather(shards, logits, group=cp_axis.get_group())
        logits = cp_sharding.unshard(shards, plan.cp_layout, dim=1, ulysses=plan.ulysses_degree)
    logits = logits[:, :seq].contiguous()
    if not vocab_sharded(pm):
        return logits
    tp_mesh = axis(pm.mesh, "tp")
    if gather:
        parts = [torch.empty_like(logits) for _ in range(plan.tp)]
        dist.all_gather(parts, logits, group=tp_mesh.get_group())
        return torch.cat(parts, dim=-1)
    return DTensor.from_local(logits, tp_mesh, [Shard(2)], run_check=False)

