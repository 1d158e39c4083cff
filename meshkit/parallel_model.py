"""`ParallelModel`: the handle a training loop holds after `parallelize`.

It owns no parameters of its own: the HF model keeps them (now DTensors) under their original names,
and `model_parts` are the stage modules this rank runs. It turns a data-parallel rank's batch into
the single-device loss of the global batch (`step/`: batch preparation, loss, gradient sums and
norm) and hands every state-dict path to `state/` (HF names, full state dicts, init, checkpoints).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshkit.data.loader import PackedLoader, check_fits_model
from meshkit.data.store import TokenStore
from meshkit.data_parallel import zero_stages
from meshkit.data_parallel.fsdp import reshard_fsdp
from meshkit.data_parallel.fused import FusedOptimizer
from meshkit.expert_parallel import update_expert_biases
from meshkit.inference import forward, generate
from meshkit.integrations.peft import export as peft_export
from meshkit.integrations.peft import model as peft_model
from meshkit.mesh import axis
from meshkit.pipeline.costs import PlanSchedules
from meshkit.pipeline.p2p import TensorMeta
from meshkit.pipeline.runtime import run_schedule
from meshkit.plan import DTYPES, Plan
from meshkit.state import checkpoint, full, hf_checkpoint, names
from meshkit.step import loss as loss_lib
from meshkit.step.batch import LocalBatch, prepare
from meshkit.step.grad_norm import clip_grad_norm_, total_grad_norm
from meshkit.step.grad_sync import every_sum_of_a_call, summed_in_place
from meshkit.step.router_aux import AuxLosses
from meshkit.tensor_parallel.styles import loss_context, tp_grads_of_a_call


@dataclass(frozen=True)
class Sharded:
    """What `parallelize` built beyond the plan and the mesh, as far as the training step needs it."""

    stages: dict[int, nn.Module]  # this rank's stage modules by global stage index
    device: torch.device
    reduce_tp_grads: bool = False  # TP without FSDP: place gradients like their parameters after backward
    tp_summed_params: tuple[nn.Parameter, ...] = ()  # MoE weights every TP rank holds whole: summed over tp
    tied_aliases: Mapping[str, str] = field(default_factory=dict)  # pp > 1: {LM head copy: embedding}
    tied_group: dist.ProcessGroup | None = None  # the first/last-stage pair holding the two copies (None: one rank)
    mirror_group: dist.ProcessGroup | None = None  # DualPipe: pp ranks r and pp-1-r, holding the same layers


class ParallelModel:
    """A model sharded by a Plan: `forward_backward`, `clip_grad_norm_`, state dicts, weight init."""

    def __init__(self, model: nn.Module, plan: Plan, mesh: DeviceMesh, sharded: Sharded):
        stages = sharded.stages
        self.model = model
        self.plan = plan
        self.mesh = mesh
        self.model_parts = [stages[s] for s in sorted(stages)]
        self.device = sharded.device
        self._stages = stages
        self._pp = axis(mesh, "pp")
        self._schedules = PlanSchedules(plan) if plan.pp > 1 else None  # zb_auto may rebuild after measuring
        self._dp_roots = zero_stages.data_parallel_roots(self.model_parts)
        self._window_open = False  # a forward_backward(last_microbatch=False) awaits its window's last call
        self._fused: FusedOptimizer | None = None  # set by meshkit.fuse_optimizer_into_backward
        self.check_inputs = True
        self.backward_context_open = False  # inside `backward_context`
        self._dp = axis(mesh, "dp")
        self._dp_cp = axis(mesh, "dp_cp")
        self._reduce_tp_grads = sharded.reduce_tp_grads
        self._tp_summed_params = list(sharded.tp_summed_params)
        self._tp_group = axis(mesh, "tp").get_group() if self._tp_summed_params else None
        # A tied embedding under pipelining: the head's copy answers to the embedding's name, the two
        # copies' gradients are summed, and the norm counts the weight once (the embedding's copy).
        self._aliases = dict(sharded.tied_aliases)
        held = {id(p) for p in self.parameters()}
        named = dict(model.named_parameters())
        tied_names = [*self._aliases, *self._aliases.values()]
        self._tied_params = [named[n] for n in tied_names if id(named[n]) in held]
        self._tied_group = sharded.tied_group
        self._not_in_norm = {id(named[n]) for n in self._aliases if id(named[n]) in held}
        # DualPipe: the mirror pp rank holds the same layers; their gradients are summed over the pair (one
        # all-reduce, parameters in name order) and the norm counts the down pipeline's copy only.
        self._mirror_group, self._mirror_params = sharded.mirror_group, []
        if self._mirror_group is not None:
            self._mirror_params = [p for _, p in sorted(model.named_parameters()) if id(p) in held and p.requires_grad]
            self._not_in_norm |= {id(p) for s, part in stages.items() if s >= plan.pp for p in part.parameters()}
        # Router auxiliary terms (meshkit MoE coefficients, HF's output_router_logits): weights and values.
        self._aux = AuxLosses(model, self.model_parts, mesh, plan.microbatches)

    @property
    def stages(self) -> dict[int, nn.Module]:
        """This rank's stage modules by global stage index (one per rank without virtual stages)."""
        return dict(self._stages)

    @property
    def tied_aliases(self) -> dict[str, str]:
        """{head name: embedding name} when pipelining split a tied embedding into two copies, else {}."""
        return dict(self._aliases)

    @property
    def sums_grads_after_backward(self) -> bool:
        """Whether meshkit itself sums some gradients once backward has returned (MoE weights every TP
        rank holds whole, over tp; a tied embedding's two pipeline copies): those are not final inside
        backward, which an optimizer fused into backward needs."""
        return bool(self._tp_summed_params or self._aliases)

    def attach_fused_optimizer(self, fused: FusedOptimizer) -> None:
        """Tell the step that `fused` steps parameters inside backward (accumulation windows and
        clipping are refused under it; its deferred steps run at the end of each call)."""
        self._fused = fused

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
        return names.named_parameters(self.model, self.parameters(), self._aliases)

    def train(self, mode: bool = True) -> ParallelModel:
        """Switch every part to training (or eval) mode."""
        for part in self.model_parts:
            part.train(mode)
        return self

    def eval(self) -> ParallelModel:
        """Switch every part to eval mode."""
        return self.train(False)

    def dataloader(self, store: TokenStore | Mapping[str, TokenStore], *, seq_len: int, global_batch: int,
                   **kwargs) -> PackedLoader:
        """A `meshkit.data.PackedLoader` feeding this model (dp rank and size from the mesh), after checking on
        every rank that the store's vocabulary fits the embedding and `seq_len` max_position_embeddings.
        `global_batch` counts rows over all dp ranks; other keywords (seed, split, pack...) go to the loader."""
        check_fits_model(store, seq_len, self.model.config)
        return PackedLoader(store, seq_len=seq_len, global_batch=global_batch, dp_rank=self.dp_rank,
                            dp_size=self.dp_size, **kwargs)

    # ------------------------------------------------------------ the step
    def count_valid_tokens(self, labels: torch.Tensor) -> int:
        """Global number of predicted tokens in `labels` (after the one-token shift), over all data ranks.
        Summed over an accumulation window and passed as `loss_denominator` to each `forward_backward`
        call, it makes the accumulated gradient exactly that of the single-device loss of the window."""
        shifted = loss_lib.shift_labels(labels.to(self.device))
        return loss_lib.global_valid_tokens(shifted, self._dp.get_group())

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                         loss_denominator: int | float | None = None, last_microbatch: bool = True,
                         parts: bool = False) -> torch.Tensor | loss_lib.LossParts:
        """Forward and backward on this data rank's batch [B, S]; return the loss, gradients accumulated.

        The returned loss (detached, identical on every rank) is the single-device loss of the global
        batch: token cross-entropies summed over all data ranks divided by `loss_denominator`, which
        defaults to this call's global valid-token count, plus the router auxiliary terms of MoE
        models (HF's `router_aux_loss_coef` term with `output_router_logits`, meshkit MoE layers'
        `aux_loss_coef`/`z_loss_coef`), weighted as they enter the gradients (`meshkit.step.router_aux`): for
        HF MoE models this is HF's own `loss`. `parts=True` returns `LossParts(loss, ce, aux)`, the two
        terms apart (aux 0 for a model without any). Labels are unshifted (HF convention, -100
        ignored). `position_ids` that restart at 0 mark packed documents (block-diagonal attention).

        Under gradient accumulation pass `last_microbatch=False` to every call of a window but its
        last: with `Plan(grad_sync="last_microbatch")` gradients then stay local until that call, and
        ZeRO-1/2 keep the gathered parameters for the next call (docs/data_parallel.md).
        """
        self._check_call("forward_backward", last_microbatch)
        batch = self._prepare(input_ids, labels, position_ids)
        denominator = float(max(batch.valid_tokens if loss_denominator is None else loss_denominator, 1))
        weight = batch.valid_tokens / denominator  # this call's share of the window (1 without accumulation)
        self._aux.begin(weight)
        hf_aux = None
        with self._gradient_call(last_microbatch), loss_context(self.plan.tp > 1, self.plan.loss_parallel):
            if self._schedules is not None:
                share = self._pipeline_step(self._schedules.train, batch, denominator, last_microbatch)
            else:
                share, hf_aux = self._step(batch, denominator, last_microbatch, weight)
        return self._loss(self._global_loss(share), self._aux.total(hf_aux, self.device), parts)

    @contextlib.contextmanager
    def backward_context(self, last_microbatch: bool = True) -> Iterator[None]:
        """Around the model's own forward (pp = 1) and the backward of a loss of the caller's: the plan's
        gradient policy, as `forward_backward` applies it (see `meshkit.inference.hf_forward`)."""
        self._check_call("backward_context", last_microbatch)
        self.backward_context_open = True
        try:
            with self._gradient_call(last_microbatch), zero_stages.backward_call(
                    self._dp_roots, self.plan.zero, self.plan.grad_sync, last_microbatch):
                yield
        finally:
            self.backward_context_open = False

    @property
    def finishes_grads_after_backward(self) -> bool:
        """Whether gradients are final only after meshkit's work past backward (ZeRO-1, TP without FSDP, sums)."""
        return bool(zero_stages.defers_reduction(self._dp_roots, self.plan.zero) or self._reduce_tp_grads
                    or self.sums_grads_after_backward)

    @property
    def has_router_aux_loss(self) -> bool:
        """Whether router auxiliary terms enter the loss (weighed by `forward_backward` only)."""
        return self._aux.active

    def _check_call(self, what: str, last_microbatch: bool) -> None:
        if not isinstance(last_microbatch, bool):
            raise ValueError(f"{what}: last_microbatch={last_microbatch!r} must be True or False")
        if self._fused is not None and not last_microbatch:
            raise ValueError(f"{what}: last_microbatch=False with the optimizer fused into backward (each call "
                             "steps the parameters: no window accumulates); fix: one call per step, or unfused")

    @contextlib.contextmanager
    def _gradient_call(self, last_microbatch: bool) -> Iterator[None]:
        """The gradient sums meshkit makes itself around one call, then TP placement and fused steps."""
        self._window_open = not last_microbatch
        with every_sum_of_a_call((self._mirror_params, self._mirror_group), (self._tp_summed_params, self._tp_group),
                                 (self._tied_params, self._tied_group)), \
                tp_grads_of_a_call(self.model_parts, self._reduce_tp_grads):
            yield
        if self._fused is not None:
            self._fused.after_call()

    def _step(self, batch: LocalBatch, denominator: float, last_microbatch: bool, weight: float):
        """One stage's forward and backward (no pipelining), under the zero stage's gradient policy;
        returns the CE share and HF's router auxiliary term (None without one), weighted by `weight`."""
        (stage,) = self.model_parts
        plan = self.plan
        with zero_stages.backward_call(self._dp_roots, plan.zero, plan.grad_sync, last_microbatch):
            logits = stage(batch.input_ids, batch.position_ids, batch.doc_ids)
            share = loss_lib.summed_cross_entropy(logits, batch.targets) / denominator
            del logits  # vocabulary-wide, alive through backward otherwise (found by the dry run)
            hf_aux = self._aux.hf_term(weight)
            if hf_aux is None:
                share.backward()
            else:
                torch.autograd.backward([share, hf_aux])
        return share, hf_aux

    @torch.no_grad()
    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor, *,
                 position_ids: torch.Tensor | None = None, parts: bool = False) -> torch.Tensor | loss_lib.LossParts:
        """The global-batch loss without touching gradients (eval mode is the caller's choice): what
        `forward_backward` returns on the batch (`parts=True`: `LossParts`). Under pp > 1 the training
        schedule's forwards run alone. FSDP units are resharded afterwards: the last one, left gathered
        after forward, would serve stale weights to the next forward once the optimizer stepped."""
        batch = self._prepare(input_ids, labels, position_ids)
        denominator = float(max(batch.valid_tokens, 1))
        self._aux.begin(1.0, measure=True)
        hf_aux = None
        with loss_context(self.plan.tp > 1, self.plan.loss_parallel):
            if self._schedules is not None:
                share = self._pipeline_step(self._schedules.evaluate, batch, denominator)
            else:
                (stage,) = self.model_parts
                logits = stage(batch.input_ids, batch.position_ids, batch.doc_ids)
                share = loss_lib.summed_cross_entropy(logits, batch.targets) / denominator
                hf_aux = self._aux.hf_term(1.0)
        for part in self.model_parts:
            reshard_fsdp(part)
        return self._loss(self._global_loss(share), self._aux.total(hf_aux, self.device), parts)

    @staticmethod
    def _loss(ce: torch.Tensor, aux: torch.Tensor | None, parts: bool) -> torch.Tensor | loss_lib.LossParts:
        loss = ce if aux is None else ce + aux
        if not parts:
            return loss
        return loss_lib.LossParts(loss, ce, torch.zeros_like(ce) if aux is None else aux)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, *,
                gather: bool = False) -> torch.Tensor:
        """Logits [B, S, vocab] (fp32, no gradients) of this data rank's batch, equal to the single-device
        model's, on every rank of every plan; any sequence length. Under tp with `loss_parallel` the
        vocabulary stays split (a DTensor `Shard(2)`) unless `gather=True`. Collective: every rank calls
        it. See `meshkit.inference.forward`."""
        return forward.forward(self, input_ids, position_ids, gather=gather)

    def generate(self, prompt_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int | None = None, do_sample: bool | None = None, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, repetition_penalty: float | None = None,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                 stop_strings: str | list[str] | None = None, tokenizer=None, seed: int = 0) -> torch.Tensor:
        """Continue this data rank's prompts [B, P]; return [B, P + n] token ids, n <= max_new_tokens.

        Options mean and default what they do in HF's `generate` (None: the model's generation_config,
        then HF's default), and greedy decoding is token for token HF's on the single-device model:
        eos/pad, left-padded prompts with their `attention_mask`, `repetition_penalty`, `stop_strings`
        (read with `tokenizer`); `do_sample=True` draws reproducibly for a `seed`. Collective: ranks
        agree on max_new_tokens and stopping conditions (tp/cp/pp peers on everything) or all raise.
        See `meshkit.inference.generate`.
        """
        return generate.generate(self, prompt_ids, attention_mask=attention_mask, tokenizer=tokenizer,
                                 max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                                 top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty,
                                 eos_token_id=eos_token_id, pad_token_id=pad_token_id, stop_strings=stop_strings,
                                 seed=seed)

    def _pipeline_step(self, schedule, batch: LocalBatch, denominator: float,
                       last_microbatch: bool = True) -> torch.Tensor:
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
        trace = self._schedules.trace_for(schedule)
        losses = run_schedule(schedule, self._stages, pp_group=self._pp.get_group(),
                              microbatch_inputs=[batch.input_ids[r] for r in rows], loss_fn=loss_fn,
                              shapes=shapes, stage_kwargs=kwargs, device=self.device,
                              reduce_grads=zero_stages.syncs_now(self.plan.grad_sync, last_microbatch),
                              reshard=zero_stages.reshards_now(self.plan.zero, last_microbatch), trace=trace)
        if trace is not None:  # zb_auto's profiling run: every rank agrees on the measured costs, then rebuilds
            self._schedules.measured(trace, self._pp.get_group(), shapes, self.device)
        if not losses:
            return torch.zeros((), device=self.device)
        return sum(t.full_tensor() if isinstance(t, DTensor) else t for t in losses)

    def _global_loss(self, share: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's share of the loss (each already divided by the global denominator)."""
        return loss_lib.global_loss(share, [self._dp_cp.get_group(), self._pp.get_group()])

    def _prepare(self, input_ids, labels, position_ids) -> LocalBatch:
        return prepare(input_ids, labels, position_ids, plan=self.plan, mesh=self.mesh, config=self.model.config,
                       device=self.device, check=self.check_inputs)

    def update_expert_biases(self) -> None:
        """DeepSeek-V3 router-bias step of every MoE layer (call after `optimizer.step()`; no-op if unused).

        Under DualPipe each copy of a router counted half the microbatches: the pair sums the counts first,
        so both copies take the same step."""
        if self._mirror_group is not None:
            counts = [b for n, b in sorted(self.model.named_buffers()) if n.endswith(".load_counts_E") and not b.is_meta]
            summed_in_place(counts, self._mirror_group)
        for part in self.model_parts:
            update_expert_biases(part)

    # ------------------------------------------------------------ gradients
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
        """Scale gradients so their global norm (over every axis, each shard counted once) is <= max_norm.

        Returns the norm before clipping, identical on every rank, so a loop that skips a step on a
        non-finite norm skips it on every rank. `error_if_nonfinite=True` raises ValueError on every
        rank instead (as torch's option), before any gradient is scaled.
        """
        self._check_window_closed("clip_grad_norm_")
        return clip_grad_norm_(list(self.parameters()), max_norm, norm_type, self._norm_groups(),
                               counted=self._norm_params(), error_if_nonfinite=error_if_nonfinite)

    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm without clipping."""
        self._check_window_closed("grad_norm")
        return total_grad_norm(self._norm_params(), norm_type, self._norm_groups())

    def _check_window_closed(self, what: str) -> None:
        """Gradients of an unfinished accumulation window may be unreduced: refuse to read them (every
        rank made the same calls, so every rank raises)."""
        if self._fused is not None:
            raise ValueError(f"{what}: the optimizer is fused into backward (meshkit.fuse_optimizer_into_backward), "
                             "so every gradient was consumed before a global norm could exist; the fused path does "
                             "not clip (docs/data_parallel.md); fix: train unfused to clip")
        if self._window_open:
            raise ValueError(f"{what}: the last forward_backward passed last_microbatch=False, so its window's "
                             "gradients may not be reduced yet; fix: pass last_microbatch=True to the window's "
                             "last call before clipping or stepping")

    def _norm_params(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if id(p) not in self._not_in_norm]

    def _norm_groups(self) -> list:
        """Pipeline ranks hold disjoint parameters: their partial norms add up over pp."""
        return [self._pp.get_group()] if self.plan.pp > 1 else []

    # --------------------------------------------------------- state dicts
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer as a plain CPU tensor under its HF name, on every rank
        (the whole model in CPU memory: for export and tests); see `meshkit.state.full`."""
        return full.full_state_dict(self)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy full (unsharded) tensors into this rank's shards; each rank slices what it holds, no traffic."""
        full.load_full_state_dict(self, state_dict, strict)

    def save_checkpoint(self, path, optimizer, **kwargs) -> None:
        """Save model, optimizer, scheduler, step and RNG with torch.distributed.checkpoint under HF names;
        see `meshkit.state.checkpoint.save` (every rank calls it)."""
        checkpoint.save(path, self, optimizer, **kwargs)

    def load_checkpoint(self, path, optimizer, **kwargs) -> dict:
        """Resume from `save_checkpoint`, under this plan whatever the saving plan was; returns step and extra."""
        return checkpoint.load(path, self, optimizer, **kwargs)

    def load_hf_checkpoint(self, directory, strict: bool = True) -> None:
        """Fill this rank's shards from a `save_pretrained` directory, reading only the slices it holds.
        A LoRA model takes its base model's directory or a PEFT adapter directory (`peft.export`)."""
        lora = peft_model.is_peft_model(self.model)
        (peft_export.load_hf if lora else hf_checkpoint.load_hf_checkpoint)(self, directory, strict=strict)

    def save_hf_checkpoint(self, directory, *, tokenizer=None, max_shard_size: int | str = "5GB",
                           merge: bool = False) -> None:
        """Write a directory `from_pretrained` loads as it is: config, generation config, safetensors and,
        given `tokenizer` (an HF tokenizer or its directory), the tokenizer with its chat template; rank 0
        alone writes. A LoRA model writes its adapter as PEFT does, or with `merge=True` the merged model."""
        if merge or peft_model.is_peft_model(self.model):
            peft_export.save_hf(self, directory, merge=merge, tokenizer=tokenizer, max_shard_size=max_shard_size)
        else:
            hf_checkpoint.save_hf_checkpoint(self, directory, tokenizer=tokenizer, max_shard_size=max_shard_size)

    def init_weights(self, seed: int = 0) -> None:
        """Initialise as HF would (normal(0, initializer_range), norms 1, biases 0), shard by shard: values
        depend only on (seed, HF name), never on the plan; the peak is one full parameter, never the model."""
        full.init_weights(self, seed)

    def materialise(self) -> None:
        """Give this rank's meta-device shards real (uninitialised) storage; other stages stay on meta. The
        loaders and `init_weights` call it; call it yourself only to fill the shards by other means."""
        full.materialise(self)
