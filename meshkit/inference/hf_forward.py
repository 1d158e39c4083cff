"""The HF module's own `forward` and `generate` after `parallelize`: what trainers and user code call.

Trainers (transformers' `Trainer`, TRL's) call `model(input_ids=..., attention_mask=..., labels=...)`
and read `.loss` and `.logits`; after `parallelize` the module's forward is meshkit's (pp = 1):

- The inputs are checked on every rank (one all-or-none collective, and tp/cp/pp peers compare
  their batches), padded on the right to the plan's sequence multiple and cut into this rank's
  context shard, exactly as `pm.forward` does; the one stage runs with autograd.
- The logits come back whole, [B, S, vocab] in token order: vocabulary shards gathered over tp
  (DTensor `full_tensor`), context shards gathered over cp. Each gather's backward hands a rank only
  its own slice of the incoming gradient, with no sum over peers: every tp/cp peer holds the same
  rows and computes the same loss on the same full logits, so that slice is the gradient of its shard.
- `attention_mask` may only mark right padding (ones, then zeros): attention is causal, so padding
  after a token never changes its logits. Left padding would need a mask meshkit does not build.

Loss semantics (with `labels`, unshifted, -100 ignored; or `shift_labels`, taken as they are): the
token cross-entropies of this data rank's rows, summed, divided by

- `num_items_in_batch` when given: HF's convention, which the Trainer uses with the global count of
  its accumulation window; `.loss` is then this data rank's share of the window's loss;
- otherwise the global count of valid targets over every data rank (one all-reduce): the gradient,
  which meshkit sums over data ranks, is exactly the single-device gradient of the global batch,
  and the value reported is the global loss itself (the ranks' shares summed), the same everywhere.

HF divides by the rank's own count and leaves the averaging to DDP; meshkit sums gradients over data
ranks, so a hand-written loss built from `.logits` should be a share of a global quantity too (the
Trainer integration divides whatever `compute_loss` returns by the dp size, as DDP's mean would).

Plans whose gradients meshkit finishes after backward (`pm.finishes_grads_after_backward`) build a
graph here only inside `pm.backward_context()`. Router auxiliary losses are not added (refused: use
`pm.forward_backward`). Under pp > 1 no rank holds the whole model: `model(...)` raises, pointing to
`pm.forward_backward` and `pm.forward`; `model.generate` is `pm.generate` under every plan.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.modeling_outputs import CausalLMOutputWithPast

from meshkit.context_parallel import sharding as cp_sharding
from meshkit.data_parallel.fsdp import reshard_fsdp
from meshkit.inference.forward import check_inputs, ids_problem, run_stages, stage_inputs
from meshkit.mesh import axis
from meshkit.step import loss as loss_lib

if TYPE_CHECKING:
    from meshkit.parallel_model import ParallelModel

# HF forward keywords accepted when None or False (use_cache: any value; no cache is returned).
_NEUTRAL = ("past_key_values", "inputs_embeds", "cache_position", "output_attentions", "output_hidden_states",
            "output_router_logits", "use_cache")
# Packed-sequence boundaries for flash attention, as padding-free collators send them beside position_ids:
# the same documents the position ids mark, which meshkit reads from the position ids.
PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


class ModelForward:
    """The parallelized HF causal LM's `forward` (pp = 1): HF's keywords in, `CausalLMOutputWithPast` out."""

    def __init__(self, pm: ParallelModel):
        self.pm = pm

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                 return_dict: bool | None = None, **kwargs: Any):
        """Logits of this data rank's rows and, with labels, the loss (see the module docstring)."""
        out = causal_lm_forward(self.pm, input_ids, attention_mask, position_ids, labels, **kwargs)
        return out if return_dict is not False else out.to_tuple()


class ModelGenerate:
    """The parallelized HF module's `generate`: `pm.generate`, taking HF's `input_ids`/`inputs` name."""

    def __init__(self, pm: ParallelModel):
        self.pm = pm

    def __call__(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """Continue this data rank's prompts; every rank calls it (see `ParallelModel.generate`)."""
        prompt = kwargs.pop("inputs", None) if input_ids is None else input_ids
        return self.pm.generate(prompt, **kwargs)


def install_hf_forward(model: nn.Module, pm: ParallelModel) -> None:
    """Make `model(...)` and `model.generate(...)` run through meshkit after `parallelize`.

    pp = 1: the module's `forward` becomes `ModelForward(pm)`. pp > 1: a pre-hook makes `model(...)`
    raise a ValueError naming what runs instead (without it, HF's forward would reach meta tensors).
    """
    if pm.plan.pp == 1:
        model.forward = ModelForward(pm)
    else:
        model.register_forward_pre_hook(_refuse_pipelined, with_kwargs=True)
    model.generate = ModelGenerate(pm)
    model._meshkit_parallel_model = weakref.ref(pm)  # weak: pm holds the model


def parallel_model_of(model: nn.Module) -> ParallelModel | None:
    """The ParallelModel `parallelize` made of `model`, or None if it was never parallelized (or dropped)."""
    ref = getattr(model, "_meshkit_parallel_model", None)
    return ref() if ref is not None else None


def _refuse_pipelined(module: nn.Module, args, kwargs):
    raise ValueError(
        f"{type(module).__name__}(...) after meshkit.parallelize with pp > 1: each pipeline rank holds only its "
        "stages, so no rank can run the model's own forward. Use pm.forward_backward(input_ids, labels) to train "
        "(meshkit.integrations.transformers.Trainer does), pm.forward(input_ids) for logits and "
        "pm.generate(prompt_ids, max_new_tokens=...) (or model.generate) to generate; for a plain HF model, export "
        "with pm.save_hf_checkpoint(dir)")


def causal_lm_forward(pm: ParallelModel, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                      position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None, *,
                      shift_labels: torch.Tensor | None = None, num_items_in_batch: Any = None,
                      logits_to_keep: int = 0, **kwargs: Any) -> CausalLMOutputWithPast:
    """HF's causal-LM forward on the sharded model: full logits with gradients, and the loss (module docstring)."""
    config = pm.model.config
    problem = ids_problem(input_ids, position_ids, config) or _problem(
        pm, input_ids, attention_mask, position_ids, labels, shift_labels, logits_to_keep, kwargs)
    if pm.check_inputs:
        check_inputs(pm, input_ids, problem)
    elif problem:
        raise ValueError(problem)
    batch, seq = input_ids.shape
    inputs = stage_inputs(pm, input_ids, position_ids)
    logits = _full_logits(pm, run_stages(pm, inputs))[:, :seq]
    if not torch.is_grad_enabled():
        for part in pm.model_parts:
            reshard_fsdp(part)  # the last unit stays gathered after a forward; an optimizer step would outdate it
    loss = None
    if labels is not None or shift_labels is not None:
        targets = shift_labels if shift_labels is not None else loss_lib.shift_labels(labels)
        loss = _loss(pm, logits, targets.to(logits.device), num_items_in_batch)
    if logits_to_keep:
        logits = logits[:, -logits_to_keep:]
    return CausalLMOutputWithPast(loss=loss, logits=logits)


def _problem(pm: ParallelModel, input_ids, attention_mask, position_ids, labels, shift_labels, logits_to_keep,
             kwargs: dict[str, Any]) -> str | None:
    """What keeps this call from running on the sharded model, or None (local, no collective)."""
    batch, seq = input_ids.shape
    odd = sorted(k for k, v in kwargs.items() if k not in PACKING_KWARGS
                 and (k not in _NEUTRAL or (k != "use_cache" and v is not None and v is not False)))
    if odd:
        return (f"model(...) after meshkit.parallelize takes input_ids, attention_mask, position_ids, labels, "
                f"shift_labels, num_items_in_batch, logits_to_keep and packing boundaries; got {odd} (caches, input embeddings, "
                "attentions, hidden states and router logits are not available from the sharded model); fix: drop "
                "them (router auxiliary losses: train with pm.forward_backward)")
    packing = sorted(k for k in kwargs if k in PACKING_KWARGS and kwargs[k] is not None)
    if packing and position_ids is None:
        return (f"{packing} mark packed documents but position_ids are missing; meshkit reads the documents from "
                "the position ids (restarting at 0); fix: pass position_ids (padding-free collators do)")
    if pm.has_router_aux_loss:
        return ("model(...) after meshkit.parallelize does not add router auxiliary losses, which this model's "
                "config asks for; fix: train with pm.forward_backward (the Trainer's default loss does), or "
                "output_router_logits=False")
    if torch.is_grad_enabled() and pm.finishes_grads_after_backward and not pm.backward_context_open:
        return ("model(...) builds a graph on a plan whose gradients meshkit finishes after backward (ZeRO-1, tensor "
                "parallel without FSDP, or weights several ranks hold whole); fix: run the forward and its backward "
                "inside `with pm.backward_context():`, or use pm.forward_backward")
    for name, value in (("labels", labels), ("shift_labels", shift_labels), ("attention_mask", attention_mask)):
        if value is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != (batch, seq)):
            return f"{name} must be a tensor [batch, seq] = {(batch, seq)}, got {getattr(value, 'shape', value)}"
    if labels is not None and shift_labels is not None:
        return "labels and shift_labels both given; fix: pass one (shift_labels are labels already shifted by one)"
    if attention_mask is not None and not torch.equal(attention_mask.cummin(dim=1).values, attention_mask):
        return ("attention_mask marks padding that is not all on the right (left padding or holes); meshkit's "
                "attention is causal with right padding only; fix: pad on the right (tokenizer.padding_side = "
                "'right') or pack with position_ids")
    for name, targets in (("labels", labels), ("shift_labels", shift_labels)):
        if targets is not None:
            valid = targets[targets != loss_lib.IGNORE_INDEX]
            if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= pm.model.config.vocab_size):
                return f"{name} hold ids outside [0, {pm.model.config.vocab_size}) other than -100 (ignored)"
    if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        return f"logits_to_keep={logits_to_keep!r} must be an int >= 0 (0 keeps every position)"
    return None


def _full_logits(pm: ParallelModel, out: torch.Tensor) -> torch.Tensor:
    """This rank's stage output as the whole [B, S_padded, vocab] tensor, differentiably (module docstring)."""
    if isinstance(out, DTensor):
        out = out.full_tensor()  # tp: vocab shards gathered; backward keeps this rank's shard of the gradient
    if pm.plan.cp == 1:
        return out
    cp_axis = axis(pm.mesh, "cp")
    return _GatherContextShards.apply(out, cp_axis.get_group(), cp_axis.get_local_rank(), pm.plan.cp_layout,
                                      pm.plan.ulysses_degree)


class _GatherContextShards(torch.autograd.Function):
    """Every cp rank's shard of the sequence, put back in token order; backward: this rank's slice only."""

    @staticmethod
    def forward(ctx, local, group, rank, layout, ulysses):
        ctx.rank, ctx.layout, ctx.ulysses, ctx.cp = rank, layout, ulysses, dist.get_world_size(group)
        shards = [torch.empty_like(local) for _ in range(ctx.cp)]
        dist.all_gather(shards, local.contiguous(), group=group)
        return cp_sharding.unshard(shards, layout, dim=1, ulysses=ulysses)

    @staticmethod
    def backward(ctx, grad):
        mine = cp_sharding.shard(grad, ctx.layout, ctx.cp, ctx.rank, dim=1, ulysses=ctx.ulysses)
        return mine.contiguous(), None, None, None, None


def _loss(pm: ParallelModel, logits: torch.Tensor, targets: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
    summed = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=loss_lib.IGNORE_INDEX,
                             reduction="sum")
    if num_items_in_batch is not None:
        return summed / torch.as_tensor(num_items_in_batch, device=summed.device).clamp(min=1)
    dp = axis(pm.mesh, "dp").get_group()
    share = summed / max(loss_lib.global_valid_tokens(targets, dp), 1)
    total = loss_lib.global_loss(share, [dp])
    return share + (total - share.detach())  # value: the global loss; gradient: this rank's share

