"""Full (unsharded) state dicts in and out of a sharded model, and initialisation that ignores the plan.

Loading slices each rank's shards out of the full tensors locally, with no communication. Weight
init generates each parameter whole from (seed, HF name) and keeps this rank's slice, trading compute
(every rank generates every parameter it holds a piece of) for reproducibility across plans: the
same seed gives the same model under any plan, which resharding checkpoints and the tests rely on.
The memory peak is one full parameter, never the whole model.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from meshkit._compat.fake import forget_fake_memo
from meshkit.integrations.peft import model as peft_model
from meshkit.mesh import axis
from meshkit.models import hf_moe, llama
from meshkit.state.names import hf_name, is_meshkit_only, non_persistent_buffer_names

if TYPE_CHECKING:
    from meshkit.parallel_model import ParallelModel


def full_state_dict(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer as a plain CPU tensor under its HF name (on every rank).

    Under pipelining each rank gathers its stages' tensors and the pipeline ranks exchange them, so
    every rank ends with the whole model in CPU memory: meant for export and tests of small models.
    """
    out = {}
    for name, tensor in pm.model.state_dict().items():
        if tensor.is_meta:
            continue  # another pipeline rank's layer
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().cpu().clone()
    if pm.plan.pp > 1:
        pp = axis(pm.mesh, "pp")
        pieces: list[dict | None] = [None] * pp.size()
        dist.all_gather_object(pieces, out, group=pp.get_group())
        out = {k: v for piece in pieces for k, v in piece.items()}
    return out


@torch.no_grad()
def load_full_state_dict(pm: ParallelModel, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Copy full (unsharded) tensors into this rank's shards; each rank slices what it holds, no traffic."""
    materialise(pm)
    aliases = pm.tied_aliases
    every = dict(pm.model.named_parameters(remove_duplicate=False))  # tied weights under both names
    every.update(dict(pm.model.named_buffers()))
    expected = set(every) - non_persistent_buffer_names(pm.model)
    # meshkit's router-bias buffers are not in HF checkpoints: missing ones keep their zeros.
    missing = sorted(k for k in expected - set(state_dict)
                     if not is_meshkit_only(k) and aliases.get(k) not in state_dict)
    unexpected = sorted(set(state_dict) - expected)
    if strict and (missing or unexpected):
        raise ValueError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")
    for name, target in every.items():
        source = name if name in state_dict else aliases.get(name)
        if source in state_dict and not target.is_meta:
            copy_full_into(target, state_dict[source])


@torch.no_grad()
def init_weights(pm: ParallelModel, seed: int = 0, only: set[str] | None = None) -> None:
    """Initialise as HF would (normal(0, initializer_range), norms 1, biases 0), shard by shard; a PEFT
    model's adapters as PEFT does (`peft.model.init_tensor`), its base exactly as the plain model's
    (seeded by the HF name). `only`: just these names (adapters a base checkpoint lacks)."""
    materialise(pm)
    config = pm.model.config
    adapters = peft_model.adapter_dims(pm.model) if peft_model.is_peft_model(pm.model) else {}
    for name, param in pm.named_parameters():
        if only is not None and name not in only:
            continue
        hf = hf_name(name)
        rule, std = llama.init_rule(hf, config)
        shape = param.shape
        gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(hf.encode())) % 2**63)
        if name in adapters:
            in_features, r = adapters[name]
            full = peft_model.init_tensor(name, shape, in_features, r, peft_model.lora_config(pm.model)
                                          .init_lora_weights, gen)
        elif rule == "ones":
            full = torch.ones(shape)
        elif rule == "zeros":
            full = torch.zeros(shape)
        else:
            full = torch.randn(shape, generator=gen) * std
            row = llama.padding_row(hf, config)
            if row is not None:
                full[row] = 0
        copy_full_into(param, full)


def materialise(pm: ParallelModel) -> None:
    """Give this rank's meta-device shards real (uninitialised) storage; other stages stay on meta.

    Every parameter keeps its identity, so an optimizer built on the meta model (before a checkpoint
    load) still holds the model's parameters afterwards.
    """
    parts = pm.model_parts
    if not any(t.is_meta for part in parts for t in [*part.parameters(), *part.buffers()]):
        return
    for part in parts:
        _swap_plain_parameters(part, pm.device)
        part.to_empty(device=pm.device)
        hf_moe.init_moe_buffers(part, pm.device, hf_buffers=True)  # balancing buffers are not parameters
    llama.reset_rotary(llama.parts(pm.model).rotary, pm.device)
    llama.reset_scalar_buffers(pm.model)


def _swap_plain_parameters(module: nn.Module, device: torch.device) -> None:
    """Move plain meta parameters to `device` in place (`swap_tensors`: same Python objects).

    `Module.to_empty` swaps DTensor parameters (FSDP, TP) in place, but replaces a plain parameter by a
    new `Parameter` (meta and CPU tensors are not shallow-copy compatible), which orphaned the
    parameters an optimizer already holds: plans without FSDP or TP on some weights (`pp=2` alone, TP
    without SP's norms) and tied weights shared by two modules. Under a FakeTensorMode (a dry run,
    `meshkit.dryrun`) `swap_tensors` refuses the weak references fake tensors carry: the new storage is
    made from the shape alone (an op on the meta parameter would convert it, attaching one) and the
    fake mode's own reference to the new tensor is dropped.
    """
    for sub in module.modules():
        for param in sub._parameters.values():
            if param is not None and param.is_meta and not isinstance(param, DTensor):
                storage = torch.empty(param.shape, dtype=param.dtype, device=device)
                real = nn.Parameter(storage, requires_grad=param.requires_grad)
                forget_fake_memo(real)
                torch.utils.swap_tensors(param, real)


def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's slice of the full tensor `full` into `target` (a DTensor shard or a plain tensor)."""
    if tuple(full.shape) != tuple(target.shape):
        raise ValueError(f"shape mismatch: expected {tuple(target.shape)}, got {tuple(full.shape)}")
    if isinstance(target, DTensor):
        local = distribute_tensor(full.to(target.device, target.dtype), target.device_mesh, target.placements,
                                  src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)
