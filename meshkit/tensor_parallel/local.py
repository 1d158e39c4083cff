"""Tensor and sequence parallelism of a plain Llama block on local tensors (Megatron's f/g ops).

The ParallelStyles of `tensor_parallel` run every sharded linear, norm and boundary as DTensor ops:
each op pays sharding propagation and dispatch in Python, and the sequence gathers and reduce-scatters
go through `redistribute`, which splits, narrows and concatenates the [B, S, H] activations around
every collective. On a CPU step that is ~4,600 aten ops per rank against transformers' ~3,200, and
7% more CPU time. This path keeps the parameters exactly as the styles place them (DTensors, so FSDP,
clipping and state dicts see nothing different) but runs the block on their local shards:

- the attention / MLP input passes through `gather_sequence` (SP: all-gather on the sequence dim,
  backward one reduce-scatter of the summed q/k/v or gate/up input gradients) or
  `copy_to_tensor_parallel` (no SP: identity, backward one all-reduce), applied once per module so
  the projections share one gradient reduction;
- the rowwise output passes through `reduce_scatter_sequence` (SP) or `all_reduce_partial` (no SP);
- while a sharded module runs, its DTensor parameters are swapped for their local shards with
  `to_local(grad_placements=...)`: a colwise / rowwise weight's local gradient is its shard's
  gradient; a norm on the sequence shard gets a Partial gradient (each rank saw other tokens),
  which FSDP's reduce-scatter or `place_grads_like_params` sums over tp as before. A PEFT LoRA layer's
  base, A and B are each placed and run this way by `tensor_parallel.lora.linear_shards` (the
  replicated half with a Partial gradient), so the rowwise reduction sums base and adapter at once.

Bytes and the memory layout are those of the DTensor path (same collectives, same sizes, norms on
1/tp of the tokens). The embedding and LM head take the same ops where they are plain modules
(`apply_local_ends`). On gloo the sequence gathers and reduce-scatters are pairwise messages
(`tensor_parallel.pairwise`). Used for blocks whose roles are plain colwise / rowwise / seq_norm / attention
/ mlp, without a rowwise bias, without torch.compile (dynamo would trace the parameter swap) and
without a schedule that splits B from W (its deferred weight gradients wrap plain `nn.Linear`
forwards; `compose._tp_on_local_shards`); anything else (q/k norms, replicated K/V rows, packed
projections, MoE) keeps the styles. Multi-head latent attention (DeepSeek-V3) runs here in every
block, beside either path for the rest of the block (`latent_attention_layers`): its replicated
latent layers get partial gradients like the norms on the sequence shard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from meshkit._compat.collectives import all_gather_single, functional_reduce_scatter, reduce_scatter_single
from meshkit.tensor_parallel import pairwise
from meshkit.tensor_parallel.lora import COLUMN_ROLES, linear_base, linear_shards
from meshkit.transport import shared_memory

LOCAL_ROLES = frozenset({"colwise", "kv_colwise", "rowwise", "seq_norm", "attention", "mlp", "latent"})


def _ranks_to_sequence(buf: torch.Tensor, size: int) -> torch.Tensor:
    """[size*B, s, ...] (rank-major all-gather output) -> [B, size*s, ...]; a view when B == 1."""
    b = buf.shape[0] // size
    return buf.view(size, b, *buf.shape[1:]).transpose(0, 1).reshape(b, size * buf.shape[1], *buf.shape[2:])


def _sequence_to_ranks(x: torch.Tensor, size: int) -> torch.Tensor:
    """[B, S, ...] -> [size*B, S/size, ...] contiguous, rank r's sequence chunk at rows r*B..(r+1)*B."""
    b, s = x.shape[0], x.shape[1] // size
    return x.reshape(b, size, s, *x.shape[2:]).transpose(0, 1).reshape(size * b, s, *x.shape[2:]).contiguous()


def _all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
    out = shared_memory.try_collective("all_gather", x, group)
    if out is not None:
        return out
    if pairwise.applies(x, group):
        return pairwise.all_gather(x, group, size)
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x, group)
    return _ranks_to_sequence(out, size)


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup, size: int, saved: bool) -> torch.Tensor:
    if saved:  # the functional op, which selective checkpointing keeps (as the DTensor path's reduce-scatter)
        return functional_reduce_scatter(_sequence_to_ranks(x, size), group)
    out = shared_memory.try_collective("reduce_scatter", x, group)
    if out is not None:
        return out
    if pairwise.applies(x, group):
        return pairwise.reduce_scatter(x, group, size)
    ranks = _sequence_to_ranks(x, size)
    out = ranks.new_empty((ranks.shape[0] // size, *ranks.shape[1:]))
    reduce_scatter_single(out, ranks, group)
    return out


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = shared_memory.try_collective("all_reduce", x, group)
    if out is not None:
        return out
    out = x.contiguous().clone()  # autograd owns the incoming buffer: reduce a copy
    dist.all_reduce(out, group=group)
    return out


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.size = group, size
        return _all_gather_sequence(x, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _reduce_scatter_sequence(grad, ctx.group, ctx.size, saved=False), None, None  # never recomputed


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, size: int,  # type: ignore[override]
                saved: bool) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _reduce_scatter_sequence(x, group, size, saved)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_gather_sequence(grad, ctx.group, ctx.size), None, None, None


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_reduce(grad, ctx.group), None


class _AllReducePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return grad, None


def gather_sequence(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """[B, S/tp, ...] -> [B, S, ...]: the SP region's exit; backward reduce-scatters the (summed)
    partial input gradients back onto the sequence shard."""
    return _GatherSequence.apply(x, mesh.get_group(), mesh.size())


def reduce_scatter_sequence(x: torch.Tensor, mesh: DeviceMesh, saved: bool = True) -> torch.Tensor:
    """Partial [B, S, ...] -> summed [B, S/tp, ...]: the rowwise output entering the SP region. `saved`:
    as the functional collective, whose output selective activation checkpointing keeps (a recompute
    would otherwise reduce again); else c10d's, cheaper where nothing selective recomputes."""
    return _ReduceScatterSequence.apply(x, mesh.get_group(), mesh.size(), saved)


def copy_to_tensor_parallel(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity whose backward all-reduces: the replicated input of colwise projections (no SP)."""
    return _CopyToTensorParallel.apply(x, mesh.get_group())


def all_reduce_partial(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum a Partial rowwise output over tp (no SP); backward passes the replicated gradient on."""
    return _AllReducePartial.apply(x, mesh.get_group())


def block_runs_local(roles: dict[str, str], block: nn.Module) -> bool:
    """Whether `block` (its roles, no selected rows) can take the local path."""
    if not set(roles.values()) <= LOCAL_ROLES:
        return False
    modules = dict(block.named_modules())
    for name, role in roles.items():
        module = linear_base(modules[name])  # a LoRA layer is judged by the linear it wraps
        if role in ("colwise", "kv_colwise", "rowwise") and not isinstance(module, nn.Linear):
            return False
        if role == "rowwise" and module.bias is not None:
            # `_rowwise_forward` adds a bias after the sum, but only multi-head latent attention (which
            # always runs here) is tested with one; other biased rowwise layers keep the styles
            return False
    return True


def _distribute(module: nn.Module, mesh: DeviceMesh, placement: Callable[[str], Any]) -> None:
    """Replace each parameter of `module` (not its children) by a DTensor placed by `placement(name)`,
    from rank 0's values as torch's ParallelStyles do."""
    for name, param in list(module.named_parameters(recurse=False)):
        dt = distribute_tensor(param.data, mesh, [placement(name)])
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _run_on_local_params(module: nn.Module, grad_placements: tuple | None) -> None:
    """Make `module.forward` see its DTensor parameters' local shards (swapped in for the call)."""
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        params = module._parameters
        swapped = {name: p for name, p in params.items() if isinstance(p, DTensor)}
        for name, p in swapped.items():
            params[name] = p.to_local(grad_placements=grad_placements)  # type: ignore[assignment]
        try:
            return original(*args, **kwargs)
        finally:
            params.update(swapped)

    module.forward = forward  # type: ignore[method-assign]


def _input_hook(fn: Callable[[torch.Tensor, DeviceMesh], torch.Tensor], mesh: DeviceMesh):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"], mesh)}
        return (fn(args[0], mesh), *args[1:]), kwargs
    return hook


def apply_local_block(block: nn.Module, roles: dict[str, str], mesh: DeviceMesh, sequence_parallel: bool,
                      saved_reduce_scatter: bool = True) -> None:
    """Shard `block`'s parameters over `mesh` like the ParallelStyles and run it on local shards.
    `saved_reduce_scatter`: SP's forward reduce-scatters as the op selective checkpointing keeps."""
    modules = dict(block.named_modules())
    enter = gather_sequence if sequence_parallel else copy_to_tensor_parallel
    leave = functools.partial(reduce_scatter_sequence, saved=saved_reduce_scatter) if sequence_parallel \
        else all_reduce_partial
    for name, role in roles.items():
        module = modules[name]
        if role in COLUMN_ROLES or role == "rowwise" and linear_base(module) is not module:
            # a plain column linear, or a LoRA layer's base, A and B (`tensor_parallel.lora`), each on its shard
            for linear, placement, grads in linear_shards(module, role):
                _distribute(linear, mesh, lambda _, p=placement: p)
                _run_on_local_params(linear, grads)
            if role == "rowwise":  # the adapter's partial joins the base's before the one reduction
                module.register_forward_hook(lambda m, args, out: leave(out, mesh))
        elif role == "rowwise":
            _distribute(module, mesh, lambda leaf: Shard(1) if leaf == "weight" else Replicate())
            # A replicated bias joins once, after the sum: on this rank's tokens under SP (a partial
            # gradient), on every token without SP (the complete one).
            module.forward = functools.partial(_rowwise_forward, module, leave, mesh,
                                               (Partial(),) if sequence_parallel else None)
        elif role == "seq_norm" and sequence_parallel or role == "latent":
            # a norm on the sequence shard saw this rank's tokens, a latent layer served its heads
            _distribute(module, mesh, lambda _: Replicate())
            _run_on_local_params(module, (Partial(),))
        elif role in ("attention", "mlp"):
            module.register_forward_pre_hook(_input_hook(enter, mesh), with_kwargs=True)


def _rowwise_forward(module: nn.Linear, leave, mesh: DeviceMesh, bias_grad: tuple | None,
                     x: torch.Tensor) -> torch.Tensor:
    out = leave(F.linear(x, module.weight.to_local()), mesh)
    return out if module.bias is None else out + module.bias.to_local(grad_placements=bias_grad)


def latent_attention_layers(roles: dict[str, str]) -> dict[str, str]:
    """The attention module and layers of a block with multi-head latent attention ({} without one).

    They run on local shards whichever path the rest of the block takes: under the ParallelStyles
    the attention input would be a Replicate DTensor, the shared rope key (copied by HF into every
    local head's key) has no module output a style could mark as partial, and each up-projection
    would reduce its own input gradient, mixing complete and partial gradients in the latent layers.
    """
    owner = next((name for name, role in roles.items() if role == "attention"), None)
    if owner is None or "latent" not in roles.values():
        return {}
    return {name: role for name, role in roles.items() if name == owner or name.startswith(owner + ".")}


def apply_local_norm(norm: nn.Module, mesh: DeviceMesh) -> None:
    """The final norm on the sequence shard (SP), on local tensors."""
    _distribute(norm, mesh, lambda _: Replicate())
    _run_on_local_params(norm, (Partial(),))


def ends_are_plain(embed: nn.Module, lm_head: nn.Module) -> bool:
    """Whether the embedding and LM head are the modules `apply_local_ends` can run on local shards: a
    plain `nn.Embedding` (no max_norm, dense gradients; not a subclass such as Gemma 3's scaled one)
    and a bias-free `nn.Linear`. TP runs them so wherever its blocks may (`tensor_parallel.path`); their
    gradients are then the vocabulary shard's, where the styles' embedding hands FSDP a vocabulary-wide
    one (`estimate.zero.zero_memory`). `Plan.validate` makes tp divide the vocabulary."""
    return (type(embed) is nn.Embedding and embed.max_norm is None and not embed.sparse
            and not embed.scale_grad_by_freq and type(lm_head) is nn.Linear and lm_head.bias is None)


def apply_local_ends(embed: nn.Embedding, lm_head: nn.Linear, mesh: DeviceMesh, sequence_parallel: bool,
                     loss_parallel: bool, saved_reduce_scatter: bool = True) -> None:
    """The embedding and LM head sharded on the vocabulary as torch's Rowwise/ColwiseParallel place them,
    run on local shards with the blocks' boundary ops (under SP the embedding's sum is a sequence
    reduce-scatter and the head's input a sequence all-gather, the pairwise messages on gloo). The
    logits come out as the styles' do: a `Shard(-1)` DTensor under `loss_parallel`, else gathered."""
    leave = functools.partial(reduce_scatter_sequence, saved=saved_reduce_scatter) if sequence_parallel \
        else all_reduce_partial
    _distribute(embed, mesh, lambda _: Shard(0))
    embed.forward = functools.partial(_embedding_forward, embed, leave, mesh)  # type: ignore[method-assign]
    _distribute(lm_head, mesh, lambda _: Shard(0))
    _run_on_local_params(lm_head, None)
    lm_head.register_forward_pre_hook(
        _input_hook(gather_sequence if sequence_parallel else copy_to_tensor_parallel, mesh), with_kwargs=True)
    lm_head.register_forward_hook(lambda m, args, out: _vocab_sharded_logits(out, mesh, loss_parallel))


def _embedding_forward(embed: nn.Embedding, leave, mesh: DeviceMesh, ids: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the vocabulary looked up, zeros for every other token: a Partial sum."""
    weight = embed.weight.to_local()
    rows = weight.shape[0]
    first = mesh.get_local_rank() * rows
    outside = (ids < first) | (ids >= first + rows)
    pad = embed.padding_idx
    pad = pad - first if pad is not None and first <= pad < first + rows else None
    out = F.embedding((ids - first).masked_fill(outside, 0), weight, pad)
    return leave(out.masked_fill(outside.unsqueeze(-1), 0.0), mesh)


def _vocab_sharded_logits(local: torch.Tensor, mesh: DeviceMesh, loss_parallel: bool) -> torch.Tensor:
    logits = DTensor.from_local(local, mesh, (Shard(-1),), run_check=False)
    return logits if loss_parallel else logits.redistribute(mesh, (Replicate(),)).to_local()


def apply_head_params(block: nn.Module, names: list[str], mesh: DeviceMesh) -> None:
    """Split the attention's own per-head parameters (gpt-oss's `sinks`) with the query heads.

    Rank r computes query heads [r*H/tp, (r+1)*H/tp), so it holds exactly those heads' entries
    (Shard(0)); meshkit's attention function takes the local shard (`to_local`, whose backward
    hands the shard's gradient back as Shard(0): each head lives on one tp rank). Applied after the
    block's styles, whichever path runs the block (also under torch.compile: nothing is swapped).
    """
    owners: dict[str, list[str]] = {}
    for name in names:
        owner, _, leaf = name.rpartition(".")
        owners.setdefault(owner, []).append(leaf)
    for owner, leaves in owners.items():
        module = block.get_submodule(owner)
        for leaf in leaves:
            param = module._parameters[leaf]
            dt = distribute_tensor(param.data, mesh, [Shard(0)])
            module.register_parameter(leaf, nn.Parameter(dt, requires_grad=param.requires_grad))

