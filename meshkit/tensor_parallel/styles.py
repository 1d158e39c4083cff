"""Tensor and sequence parallelism for Llama-family blocks, and the vocab-parallel loss.

Megatron's layout expressed with torch's ParallelStyles: q/k/v/gate/up split on output features
(colwise), o/down on input features (rowwise), so each block needs one reduction after attention and
one after the MLP. With sequence parallelism those reductions become reduce-scatters onto a
sequence-sharded residual stream, the norms run on 1/tp of the tokens, and the all-gathers move to
the attention and MLP inputs: same bytes as the all-reduce, 1/tp of the norm activations.

The embedding is split by vocabulary rows and the LM head by vocabulary columns, so the logits stay
vocab-sharded and cross-entropy runs on the shards (`loss_parallel`): the full [tokens, vocab] fp32
logits, often the memory peak, never exist on one rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from meshkit.integrations.peft.layers import is_lora_layer
from meshkit.models import llama
from meshkit.models import roles as roles_lib
from meshkit.tensor_parallel.local import (
    apply_head_params,
    apply_local_block,
    apply_local_ends,
    apply_local_norm,
    block_runs_local,
    ends_are_plain,
    latent_attention_layers,
)
from meshkit.tensor_parallel.lora import apply_adapter_style
from meshkit.tensor_parallel.rows import apply_selected_rows
from meshkit.transport import shared_memory


def _block_styles(roles: dict[str, str], sequence_parallel: bool) -> dict[str, object]:
    seq = Shard(1)
    styles: dict[str, object] = {}
    for name, role in roles.items():
        if role in ("colwise", "kv_colwise"):
            styles[name] = ColwiseParallel()
        elif role == "rowwise":
            styles[name] = RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate())
        elif role == "row_norm":
            # A q/k norm over the whole projection (all heads) sees this rank's features (the last dim):
            # as a DTensor sharded there, the mean of squares becomes a sum over tp (DTensor inserts the
            # all-reduce, and its backward); the weight is Replicate and its gradient summed over tp.
            styles[name] = SequenceParallel(sequence_dim=-1, use_local_output=True)
        elif role == "head_norm":
            # A per-head norm sees this rank's heads (dim 2 of [B, S, heads, head_dim]); its weight is
            # shared by all heads, so it must be a Replicate DTensor whose gradient sums over tp.
            styles[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
        elif not sequence_parallel:
            if role in ("attention", "mlp"):
                styles[name] = _shared_input_grad(role)
            continue
        elif role == "seq_norm":
            # Local output: a post-norm (Gemma-2/3, GLM-4, OLMo-2) feeds the residual add, a plain
            # tensor; a pre-norm feeds attention/MLP, whose PrepareModuleInput wraps it again.
            styles[name] = SequenceParallel(use_local_output=True)
        elif role == "attention":
            # The gathered input stays a Replicate DTensor: q/k/v then share ONE reduce-scatter of
            # their input gradient in backward; local tensors would all-reduce it once per projection.
            styles[name] = PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": seq},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            )
        elif role == "mlp":
            styles[name] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        elif role == "moe":
            # Each TP rank routes its own sequence shard: no gather, no duplicated tokens.
            styles[name] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(seq,),
                                              use_local_output=True)
    return styles


def _own_output(module: nn.Module, args, output):
    """A layer's local output as a tensor of its own, not a view of the DTensor's local shard: HF
    code modifies some in place (OLMoE clamps q, k and v by `clip_qkv`), which autograd forbids on a
    view made by DTensor's custom `to_local` function. One copy of [B, S, features/tp]."""
    return output.clone()


def _shared_input_grad(role: str) -> PrepareModuleInput:
    """Without SP: hand the attention / MLP input to q, k, v (gate, up) as ONE Replicate DTensor.

    Each colwise projection's input gradient is a Partial sum over tp. Given plain tensors, every
    projection would wrap its own DTensor and all-reduce its own gradient (5 all-reduces per block);
    given one shared DTensor, autograd adds the Partial gradients first and the single wrap reduces
    them once (2 per block), as the SP path's all-gather does.
    """
    if role == "attention":
        return PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                  desired_input_kwarg_layouts={"hidden_states": Replicate()})
    return PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))


def apply_tensor_parallel(
    parts: llama.CausalLMParts,
    tp_mesh: DeviceMesh,
    *,
    sequence_parallel: bool,
    loss_parallel: bool,
    local: bool = True,
    saved_reduce_scatter: bool = True,
) -> None:
    """Shard the embedding, every block, the final norm and the LM head over `tp_mesh`, in place.

    Between blocks the residual stream is a plain local tensor: sequence-sharded [B, S/tp, H] with SP,
    replicated [B, S, H] without. The logits come out as a DTensor sharded on the vocabulary when
    `loss_parallel`, else as a replicated plain tensor. With `local` (off under torch.compile), plain
    blocks and the final norm run on their local shards (`tensor_parallel.local`: same parameters,
    bytes and numerics, a fraction of the DTensor dispatch work). `saved_reduce_scatter` (selective
    activation checkpointing): their SP reduce-scatters as the functional op it keeps. CPU ranks of
    one host on gloo run the local path's collectives through shared memory (`shared_memory`).
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    if local:
        shared_memory.open_for(tp_mesh.get_group(), tp_mesh.device_type)  # CPU ranks of a host: collective
    local_ends = local and ends_are_plain(parts.embed, parts.lm_head)
    if local_ends:
        apply_local_ends(parts.embed, parts.lm_head, tp_mesh, sequence_parallel, loss_parallel, saved_reduce_scatter)
    else:
        parallelize_module(parts.embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=seq))
    rank = tp_mesh.get_local_rank()
    for block in parts.blocks:
        roles = roles_lib.block_roles(block, parts.config)
        rows = roles_lib.selected_rows(roles, parts.config, tp_mesh.size(), rank)
        apply_selected_rows(block, rows, tp_mesh)
        roles_lib.localize_head_counts(block, roles, parts.config, tp_mesh.size())
        latent = latent_attention_layers(roles)
        apply_local_block(block, latent, tp_mesh, sequence_parallel, saved_reduce_scatter)
        kept = {name: role for name, role in roles.items() if name not in rows and name not in latent}
        if local and not rows and block_runs_local(kept, block):
            # its linears return fresh tensors (no DTensor views), which HF may edit in place
            apply_local_block(block, kept, tp_mesh, sequence_parallel, saved_reduce_scatter)
        else:
            # LoRA layers get the adapter's style (`tensor_parallel.lora`), which follows the base's role
            adapters = {name: role for name, role in kept.items() if is_lora_layer(block.get_submodule(name))}
            plain = {name: role for name, role in kept.items() if name not in adapters}
            parallelize_module(block, tp_mesh, _block_styles(plain, sequence_parallel))
            for name, role in adapters.items():
                apply_adapter_style(block.get_submodule(name), role, tp_mesh, sequence_parallel)
            for name in roles_lib.outputs_edited_in_place(kept, parts.config):
                block.get_submodule(name).register_forward_hook(_own_output)
        apply_head_params(block, roles_lib.head_params(block, parts.config), tp_mesh)
    if sequence_parallel and local:
        apply_local_norm(parts.norm, tp_mesh)
    elif sequence_parallel:
        parallelize_module(parts.norm, tp_mesh, SequenceParallel())
    if not local_ends:
        head = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                               use_local_output=not loss_parallel)
        parallelize_module(parts.lm_head, tp_mesh, head)
    if parts.tied:
        # Each style distributed its own copy; the rowwise embedding and the colwise head both shard
        # the [vocab, hidden] weight on dim 0, so one DTensor can serve both again.
        parts.lm_head.weight = parts.embed.weight


def loss_context(tp_enabled: bool, loss_parallel_on: bool):
    """The context under which cross-entropy accepts vocab-sharded logits (a no-op otherwise)."""
    return loss_parallel() if tp_enabled and loss_parallel_on else contextlib.nullcontext()



def dtensor_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The TP-sharded (DTensor) parameters of `modules`."""
    return [p for module in modules for p in module.parameters() if isinstance(p, DTensor)]


@contextlib.contextmanager
def tp_grads_of_a_call(modules: list[nn.Module], active: bool) -> Iterator[None]:
    """Around one forward/backward call of a plan with TP and without FSDP (`active`): the summed
    gradients of earlier calls back to Partial sums before (`grads_as_partial_sums`), every gradient
    placed like its parameter after (`place_grads_like_params`)."""
    if not active:
        yield
        return
    grads_as_partial_sums(dtensor_params(modules))
    yield
    place_grads_like_params(dtensor_params(modules))


def place_grads_like_params(params: list[nn.Parameter]) -> None:
    """Give every gradient its parameter's placement, in place, when FSDP is absent.

    DTensor's backward leaves some gradients placed differently from their parameters: replicated
    weights (norms) get Partial gradients, each rank having seen different tokens or heads, and the
    styles' vocab-parallel embedding gets a Replicate [vocab, hidden] gradient, tp times its shard. FSDP
    redistributes both inside its reduce-scatter; without FSDP nothing would, and optimizers and norms
    would read one rank's share or hold full-size gradients. Done after backward rather than in
    gradient hooks, which `to_empty` (meta-device materialisation) would drop with the old tensors.
    The Partial sums of replicated parameters (every norm under SP: 2 per block) share one flat
    all-reduce per mesh and dtype instead of one redistribute each; `grads_as_partial_sums` gives
    them back their Partial form before the next call of an accumulation window.
    """
    summed: dict[tuple, list[nn.Parameter]] = {}
    for param in params:
        grad = param.grad
        if grad is None or tuple(grad.placements) == tuple(param.placements):
            continue
        if _sums_to_replicate(grad, param):
            summed.setdefault((grad.device_mesh, grad.dtype, grad.device), []).append(param)
        else:
            param.grad = grad.redistribute(placements=param.placements)
    for (mesh, _, _), group in summed.items():
        locals_ = [p.grad.to_local() for p in group]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        dist.all_reduce(flat, group=mesh.get_group())
        for p, t, chunk in zip(group, locals_, flat.split([t.numel() for t in locals_]), strict=True):
            p.grad = DTensor.from_local(chunk.view_as(t), mesh, p.placements, run_check=False)
            setattr(p.grad, _SUMMED, True)


def grads_as_partial_sums(params: list[nn.Parameter]) -> None:
    """Before a call that accumulates onto gradients `place_grads_like_params` summed: the whole sum
    on tp rank 0 and zeros elsewhere, a Partial gradient again (exactly the same sum).

    Autograd adds the call's Partial gradient onto the existing one; onto a Replicate gradient DTensor
    adds it only after an all-reduce of its own, one per norm per call (9 extra collectives per
    microbatch of a 4-block model under SP); Partial onto Partial is a local add, and the call's end
    sums the window in the one flat all-reduce.
    """
    for param in params:
        grad = param.grad
        if grad is not None and getattr(grad, _SUMMED, False):
            local = grad.to_local()
            share = local if grad.device_mesh.get_local_rank() == 0 else torch.zeros_like(local)
            param.grad = DTensor.from_local(share, grad.device_mesh, (Partial(),), run_check=False)


_SUMMED = "_meshkit_tp_summed"  # marks a gradient `place_grads_like_params` summed over tp


def _sums_to_replicate(grad: DTensor, param: nn.Parameter) -> bool:
    """A Partial(sum) gradient of a Replicate parameter on a 1D mesh: its placement is one all-reduce."""
    return (grad.device_mesh.ndim == 1 and isinstance(param, DTensor) and param.device_mesh == grad.device_mesh
            and tuple(param.placements) == (Replicate(),) and isinstance(grad.placements[0], Partial)
            and grad.placements[0].reduce_op == "sum")
