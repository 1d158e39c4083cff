"""`ParallelModel`: the handle a training loop holds after `parallelize`.

It owns no parameters of its own: the HF model keeps them (now DTensors) under their original names,
and `model_parts` are the stage modules this rank runs. It knows how to turn a data-parallel rank's
batch into the single-device loss of the global batch, and how to reduce things (gradient norms,
state dicts) across every axis of the mesh.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from meshkit import loss as loss_lib
from meshkit.consensus import raise_if_any
from meshkit.context_parallel import sharding as cp_sharding
from meshkit.data_parallel import DTYPES, reshard_fsdp
from meshkit.expert_parallel import update_expert_biases
from meshkit.grad_norm import clip_grad_norm_, total_grad_norm
from meshkit.grad_sync import summed_per_call
from meshkit.mesh import axis
from meshkit.models import llama
from meshkit.models import moe as moe_models
from meshkit.pipeline.p2p import TensorMeta
from meshkit.pipeline.runtime import run_schedule
from meshkit.pipeline.schedules import build_schedule, forward_only
from meshkit.plan import Plan
from meshkit.tensor_parallel import dtensor_params, loss_context, place_grads_like_params

MESHKIT_ONLY_BUFFERS = (".expert_bias", ".load_counts_E")


class LocalBatch(NamedTuple):
    """What this rank feeds its stage: its context shard of ids, shifted targets, positions, documents."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor | None
    valid_tokens: int


class ParallelModel:
    """A model sharded by a Plan: `forward_backward`, `clip_grad_norm_`, state dicts, weight init."""

    def __init__(self, model: nn.Module, plan: Plan, mesh: DeviceMesh, stages: dict[int, nn.Module],
                 device: torch.device, reduce_tp_grads: bool = False, tp_summed_params: list | None = None,
                 tied_copy: Mapping[str, str] | None = None, tied_group: dist.ProcessGroup | None = None):
        self.model = model
        self.plan = plan
        self.mesh = mesh
        self.model_parts = [stages[s] for s in sorted(stages)]
        self.device = device
        self._stages = stages
        self._pp = axis(mesh, "pp")
        self._schedule = (build_schedule(plan.pp_schedule, plan.pp, plan.microbatches, plan.pp_virtual_stages)
                          if plan.pp > 1 else None)
        self._eval_schedule = forward_only(self._schedule) if self._schedule is not None else None
        self.check_inputs = True
        self._dp = axis(mesh, "dp")
        self._dp_cp = axis(mesh, "dp_cp")
        self._cp = axis(mesh, "cp")
        self._vocab = model.config.vocab_size
        self._reduce_tp_grads = reduce_tp_grads
        self._tp_summed_params = tp_summed_params or []
        self._tp_group = axis(mesh, "tp").get_group() if self._tp_summed_params else None
        # A tied embedding under pipelining: the head's copy answers to the embedding's name, the two
        # copies' gradients are summed, and the norm counts the weight once (the embedding's copy).
        self._aliases = dict(tied_copy or {})
        held = {id(p) for p in self.parameters()}
        named = dict(model.named_parameters())
        tied_names = [*self._aliases, *self._aliases.values()]
        self._tied_params = [named[n] for n in tied_names if id(named[n]) in held]
        self._tied_group = tied_group
        self._not_in_norm = {id(named[n]) for n in self._aliases if id(named[n]) in held}
        # HF MoE models add their load-balancing loss only when the config asks (output_router_logits).
        self._hf_aux = bool(getattr(model.config, "output_router_logits", False)) and moe_models.is_moe_model(model)

    @property
    def tied_aliases(self) -> dict[str, str]:
        """{head name: embedding name} when pipelining split a tied embedding into two copies, else {}."""
        return dict(self._aliases)

    # ---------------------------------------------------------------- data
    @property
    def dp_rank(self) -> int:
        """Which data shard this rank loads; tp peers share it and must receive identical batches."""
        return self._dp.get_local_rank()

    @property
    def dp_size(self) -> int:
        """How many distinct batches one step consumes."""
        return self._dp.size()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters (sharded DTensors where sharded), each once; give these to the optimizer."""
        seen = set()
        for part in self.model_parts:
            for p in part.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their HF names (a tied head's pipeline copy under the embedding's)."""
        mine = {id(p) for p in self.parameters()}
        for name, p in self.model.named_parameters():
            if id(p) in mine:
                yield self._aliases.get(name, name), p

    def train(self, mode: bool = True) -> ParallelModel:
        """Switch every part to training (or eval) mode."""
        for part in self.model_parts:
            part.train(mode)
        return self

    def eval(self) -> ParallelModel:
        """Switch every part to eval mode."""
        return self.train(False)

    # ------------------------------------------------------------ the step
    def count_valid_tokens(self, labels: torch.Tensor) -> int:
        """Global number of predicted tokens in `labels` (after the one-token shift), over all data ranks.

        For gradient accumulation, sum this over the window's batches and pass it as
        `loss_denominator` to each `forward_backward` call: the accumulated gradient is then exactly
        the gradient of the single-device loss of the whole window.
        """
        shifted = loss_lib.shift_labels(labels.to(self.device))
        return loss_lib.global_valid_tokens(shifted, self._dp.get_group())

    def forward_backward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        loss_denominator: int | float | None = None,
    ) -> torch.Tensor:
        """Forward and backward on this data rank's batch [B, S]; return the loss, gradients accumulated.

        The returned loss (detached, identical on every rank) is the single-device loss of the global
        batch: token losses summed over all data ranks divided by `loss_denominator`, which defaults
        to this call's global valid-token count. Labels are unshifted (HF convention, -100 ignored).
        `position_ids` that restart at 0 mark packed documents (block-diagonal causal attention).
        """
        batch = self._prepare(input_ids, labels, position_ids)
        denominator = float(max(batch.valid_tokens if loss_denominator is None else loss_denominator, 1))
        aux = None
        with summed_per_call(self._tp_summed_params, self._tp_group), \
                summed_per_call(self._tied_params, self._tied_group), \
                loss_context(self.plan.tp > 1, self.plan.loss_parallel):
            if self._schedule is not None:
                share = self._pipeline_step(self._schedule, batch, denominator)
            else:
                (stage,) = self.model_parts
                logits = stage(batch.input_ids, batch.position_ids, batch.doc_ids)
                share = loss_lib.summed_cross_entropy(logits, batch.targets) / denominator
                aux = moe_models.hf_aux_loss(self.model) if self._hf_aux else None
                if aux is None:
                    share.backward()
                else:
                    # HF adds coef * load-balancing loss per forward; weighted by this call's share of
                    # the window's tokens it stays the token-weighted mean under accumulation.
                    aux = aux * (batch.valid_tokens / denominator)
                    torch.autograd.backward([share, aux])
            if self._reduce_tp_grads:
                place_grads_like_params(dtensor_params(self.model_parts))
        loss = self._global_loss(share)
        if self._schedule is None and aux is not None:
            # Each rank's aux is its share of the global one, summed over every token-splitting rank.
            aux = aux.detach().float().clone()
            dist.all_reduce(aux, group=axis(self.mesh, "dp_cp_tp").get_group())
            loss = loss + aux
        return loss

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor, *,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The global-batch loss without touching gradients (eval mode is the caller's choice).

        Under pp > 1 the training schedule's forwards run alone, in its order, over the same
        `pp_microbatches`. FSDP units are resharded afterwards: a unit left gathered (the last one is
        never resharded after forward) would otherwise serve stale weights to the next forward if
        the optimizer stepped in between.
        """
        batch = self._prepare(input_ids, labels, position_ids)
        denominator = float(max(batch.valid_tokens, 1))
        with loss_context(self.plan.tp > 1, self.plan.loss_parallel):
            if self._eval_schedule is not None:
                share = self._pipeline_step(self._eval_schedule, batch, denominator)
            else:
                (stage,) = self.model_parts
                logits = stage(batch.input_ids, batch.position_ids, batch.doc_ids)
                share = loss_lib.summed_cross_entropy(logits, batch.targets) / denominator
        for part in self.model_parts:
            reshard_fsdp(part)
        return self._global_loss(share)

    def _pipeline_step(self, schedule, batch: LocalBatch, denominator: float) -> torch.Tensor:
        """Run this rank's part of `schedule` over `pp_microbatches` slices of the batch's rows."""
        m = self.plan.microbatches
        rows_total, seq = batch.input_ids.shape
        rows = [slice(i * rows_total // m, (i + 1) * rows_total // m) for i in range(m)]

        def per_row(t, r):
            return None if t is None else (t if t.shape[0] == 1 else t[r])

        def loss_fn(logits, mb):
            return loss_lib.summed_cross_entropy(logits, batch.targets[rows[mb]]) / denominator

        sp = self.plan.tp if self.plan.tp > 1 and self.plan.sequence_parallel else 1
        dtype = DTYPES[self.plan.param_dtype]
        shapes = TensorMeta((rows_total // m, seq // sp, self.model.config.hidden_size), dtype)
        kwargs = [{"position_ids": per_row(batch.position_ids, r), "doc_ids": per_row(batch.doc_ids, r)}
                  for r in rows]
        losses = run_schedule(schedule, self._stages, pp_group=self._pp.get_group(),
                              microbatch_inputs=[batch.input_ids[r] for r in rows], loss_fn=loss_fn,
                              shapes=shapes, stage_kwargs=kwargs, device=self.device)
        if not losses:
            return torch.zeros((), device=self.device)
        return sum(t.full_tensor() if isinstance(t, DTensor) else t for t in losses)

    def _global_loss(self, share: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's share of the loss (each already divided by the global denominator)."""
        total = share.detach()
        if isinstance(total, DTensor):
            total = total.full_tensor()
        total = total.float().clone()
        for group_mesh in (self._dp_cp, self._pp):
            if group_mesh.size() > 1:
                dist.all_reduce(total, group=group_mesh.get_group())
        return total

    def _prepare(self, input_ids, labels, position_ids) -> LocalBatch:
        """Check, shift once on the full sequence, count globally, then cut this rank's context shard."""
        if self.check_inputs:
            problem = self._input_problem(input_ids, labels, position_ids)
            # Every rank joins the same collectives whatever it found locally, or the peers hang.
            if self.plan.pp * self.plan.tp * self.plan.cp > 1:
                disagreement = self._peer_agreement_problem(input_ids if problem is None else None)
                problem = problem or disagreement
            raise_if_any(problem, device=self.device)
        input_ids = input_ids.to(self.device)
        targets = loss_lib.shift_labels(labels.to(self.device))
        valid = loss_lib.global_valid_tokens(targets, self._dp.get_group())
        batch, seq = input_ids.shape
        doc_ids = None
        if position_ids is None:
            position_ids = torch.arange(seq, device=self.device).unsqueeze(0)
        else:
            position_ids = position_ids.to(self.device).expand(batch, seq)
            docs = cp_sharding.document_ids(position_ids)
            doc_ids = docs if bool(docs.max() > 0) else None
        if self.plan.cp > 1:
            cut = functools.partial(cp_sharding.shard, layout=self.plan.cp_layout, cp=self.plan.cp,
                                    rank=self._cp.get_local_rank(), dim=1, ulysses=self.plan.ulysses_degree)
            input_ids, targets = cut(input_ids), cut(targets)
            position_ids = cut(position_ids.expand(batch, seq)) if doc_ids is not None else cut(position_ids)
            doc_ids = cut(doc_ids) if doc_ids is not None else None
        return LocalBatch(input_ids, targets, position_ids, doc_ids, valid)

    def _input_problem(self, input_ids, labels, position_ids) -> str | None:
        if not isinstance(input_ids, torch.Tensor) or not isinstance(labels, torch.Tensor):
            return "input_ids and labels must be torch.Tensor [batch, seq]"
        if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
            return f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} {tuple(input_ids.shape)}"
        if labels.shape != input_ids.shape:
            return f"labels {tuple(labels.shape)} must have the shape of input_ids {tuple(input_ids.shape)}"
        batch, seq = input_ids.shape
        if batch < 1 or seq < 2:
            return f"input_ids {tuple(input_ids.shape)}: need a batch of at least one sequence of at least 2 tokens"
        if self.plan.pp > 1 and batch % self.plan.microbatches:
            return (f"batch of {batch} sequences does not split into pp_microbatches={self.plan.microbatches}; "
                    f"fix: a local batch that is a multiple of {self.plan.microbatches}")
        seq_problem = self.plan.seq_len_problem(seq)
        if seq_problem:
            return f"sequence length {seq}: {seq_problem}"
        targets = labels.masked_fill(labels == loss_lib.IGNORE_INDEX, 0)
        lo, hi, t_lo, t_hi = torch.stack([input_ids.min(), input_ids.max(), targets.min(), targets.max()]).tolist()
        if lo < 0 or hi >= self._vocab:
            return f"input_ids hold token ids in [{lo}, {hi}], outside the vocabulary [0, {self._vocab})"
        if t_lo < 0 or t_hi >= self._vocab:
            return (f"labels hold ids in [{t_lo}, {t_hi}]; each must be in [0, {self._vocab}) "
                    f"or {loss_lib.IGNORE_INDEX} (ignored)")
        if position_ids is not None and (position_ids.dim() != 2 or position_ids.shape[1] != seq
                                         or position_ids.shape[0] not in (1, batch)):
            return f"position_ids {tuple(position_ids.shape)} must be [1 or {batch}, {seq}]"
        problems = llama.check_config(self.model.config, seq)
        return problems[0] if problems else None

    def _peer_agreement_problem(self, input_ids: torch.Tensor | None) -> str | None:
        """TP and CP peers split one batch; different batches would silently mix. Compare cheaply.

        A rank whose input is already known bad (None) still joins, with a signature that disagrees.
        """
        peers = axis(self.mesh, "pp_cp_tp")
        if input_ids is None:
            signature = torch.full((3,), -1, dtype=torch.int64, device=self.device)
        else:
            ids = input_ids.to(self.device, torch.int64)
            weights = torch.arange(1, ids.numel() + 1, device=self.device, dtype=torch.int64).view_as(ids)
            signature = torch.stack([torch.tensor(ids.shape[0], device=self.device),
                                     torch.tensor(ids.shape[1], device=self.device),
                                     (ids * weights).sum() % 1_000_000_007])
        both = torch.cat([signature, -signature])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=peers.get_group())
        smallest = -both[3:]
        if input_ids is None or bool((smallest == -1).all()) or torch.equal(both[:3], smallest):
            return None  # agreement, or a peer already failed and will report its own reason
        return ("pipeline/tensor/context-parallel peers received different batches (shape or content); ranks with the "
                "same pm.dp_rank must load identical input_ids and labels")

    def update_expert_biases(self) -> None:
        """DeepSeek-V3 router-bias step of every MoE layer (call after `optimizer.step()`; no-op if unused)."""
        for part in self.model_parts:
            update_expert_biases(part)

    # ------------------------------------------------------------ gradients
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so their global norm (over every axis, each shard counted once) is <= max_norm."""
        return clip_grad_norm_(list(self.parameters()), max_norm, norm_type, self._norm_groups(),
                               counted=self._norm_params())

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm without clipping."""
        return total_grad_norm(self._norm_params(), norm_type, self._norm_groups())

    def _norm_params(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if id(p) not in self._not_in_norm]

    def _norm_groups(self) -> list:
        """Pipeline ranks hold disjoint parameters: their partial norms add up over pp."""
        return [self._pp.get_group()] if self.plan.pp > 1 else []

    # --------------------------------------------------------- state dicts
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer as a plain CPU tensor under its HF name (on every rank).

        Under pipelining each rank gathers its stages' tensors and the pipeline ranks exchange them, so
        every rank ends with the whole model in CPU memory: meant for export and tests of small models.
        """
        out = {}
        for name, tensor in self.model.state_dict().items():
            if tensor.is_meta:
                continue  # another pipeline rank's layer
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            out[name] = tensor.detach().cpu().clone()
        if self.plan.pp > 1:
            pieces: list[dict | None] = [None] * self._pp.size()
            dist.all_gather_object(pieces, out, group=self._pp.get_group())
            out = {k: v for piece in pieces for k, v in piece.items()}
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy full (unsharded) tensors into this rank's shards; each rank slices what it holds, no traffic."""
        self.materialise()
        every = dict(self.model.named_parameters(remove_duplicate=False))  # tied weights under both names
        every.update(dict(self.model.named_buffers()))
        expected = set(every) - non_persistent_buffer_names(self.model)
        # meshkit's router-bias buffers are not in HF checkpoints: missing ones keep their zeros.
        missing = sorted(k for k in expected - set(state_dict)
                         if not k.endswith(MESHKIT_ONLY_BUFFERS) and self._aliases.get(k) not in state_dict)
        unexpected = sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise ValueError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")
        for name, target in every.items():
            source = name if name in state_dict else self._aliases.get(name)
            if source in state_dict and not target.is_meta:
                _copy_full_into(target, state_dict[source])

    def save_checkpoint(self, path, optimizer, **kwargs) -> None:
        """Save model, optimizer, scheduler, step and RNG with torch.distributed.checkpoint under HF names;
        see `meshkit.checkpoint.save` (every rank calls it)."""
        from meshkit import checkpoint

        checkpoint.save(path, self, optimizer, **kwargs)

    def load_checkpoint(self, path, optimizer, **kwargs) -> dict:
        """Resume from `save_checkpoint`, under this plan whatever the saving plan was; returns step and extra."""
        from meshkit import checkpoint

        return checkpoint.load(path, self, optimizer, **kwargs)

    def load_hf_checkpoint(self, directory, strict: bool = True) -> None:
        """Fill this rank's shards from a `save_pretrained` directory, reading only the slices it holds."""
        from meshkit import hf_io

        hf_io.load_hf_checkpoint(self, directory, strict=strict)

    def save_hf_checkpoint(self, directory, **kwargs) -> None:
        """Write a directory `from_pretrained` loads (rank 0 writes; every rank calls it)."""
        from meshkit import hf_io

        hf_io.save_hf_checkpoint(self, directory, **kwargs)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise as HF would (normal(0, initializer_range), norms 1, biases 0), shard by shard.

        Each parameter's values depend only on (seed, its HF name), never on the plan: the same seed
        gives the same model under any plan. Memory peak is one full parameter, never the whole model.
        """
        self.materialise()
        config = self.model.config
        for name, param in self.named_parameters():
            rule, std = llama.init_rule(name, config)
            shape = param.shape
            if rule == "ones":
                full = torch.ones(shape)
            elif rule == "zeros":
                full = torch.zeros(shape)
            else:
                gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
                full = torch.randn(shape, generator=gen) * std
                row = llama.padding_row(name, config)
                if row is not None:
                    full[row] = 0
            _copy_full_into(param, full)

    def materialise(self) -> None:
        """Give this rank's meta-device shards real (uninitialised) storage; other stages stay on meta.

        `init_weights`, `load_full_state_dict` and the checkpoint loaders call it; call it yourself
        only to fill the shards by other means.
        """
        if not any(t.is_meta for part in self.model_parts for t in [*part.parameters(), *part.buffers()]):
            return
        for part in self.model_parts:
            part.to_empty(device=self.device)
            moe_models.init_moe_buffers(part, self.device)  # balancing buffers are not parameters
        llama.reset_rotary(llama.parts(self.model).rotary, self.device)


def _copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    if tuple(full.shape) != tuple(target.shape):
        raise ValueError(f"shape mismatch: expected {tuple(target.shape)}, got {tuple(full.shape)}")
    if isinstance(target, DTensor):
        local = distribute_tensor(full.to(target.device, target.dtype), target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def non_persistent_buffer_names(model: nn.Module) -> set[str]:
    """Names of buffers a state dict leaves out (rotary caches): never expected from a checkpoint."""
    names = set()
    for prefix, module in model.named_modules():
        for buf in getattr(module, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{buf}" if prefix else buf)
    return names
