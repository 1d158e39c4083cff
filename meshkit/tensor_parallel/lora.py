"""Tensor parallelism of a PEFT LoRA layer: the adapter follows the sharding of its base layer.

A LoRA layer computes `base(x) + B(A(x)) * s` (A: in -> r, B: r -> out). Under TP its base linear is
split like any other, and the adapter is split so that nothing but the base's own collectives runs:

- **column-parallel base** (q/k/v/gate/up: W split on output rows): A [r, in] is replicated and B
  [out, r] split on rows like W. Each rank computes its own output features' delta B_r(A x) from the
  same gathered input the base reads (under SP the attention / MLP input is gathered once, before
  every projection). A's local gradient is this rank's share (its rows of B), so it is Partial and
  summed over tp by FSDP's reduce-scatter (or `place_grads_like_params`); the adapter's input
  gradient adds into the base's partial input gradient, reduced once by the block's shared input
  reduction.
- **row-parallel base** (o/down: W split on input columns): A is split on columns like W, B
  replicated. A_r x_r is a partial sum over tp and B is linear, so B(A_r x_r) * s is the rank's
  partial of the adapter's output: added to the base's partial output *before* the reduction the
  base needs anyway (all-reduce, or reduce-scatter onto the sequence shard under SP), it costs no
  collective of its own. B's local gradient is this rank's share (Partial), A's its shard's.

Both TP paths are served. The local-shard path (`tensor_parallel.local`) takes `linear_shards`,
distributes each linear of the layer and runs it on its local shard; the DTensor path
(`apply_adapter_style`, used under torch.compile and B/W-split schedules) distributes the same
placements and lets DTensor propagate them through PEFT's forward (Replicate x Shard(0) -> Shard(-1)
for the column case; Shard(-1) x Shard(1) -> Partial, and Partial x Replicate -> Partial for the row
case), reducing once at the layer's output. PEFT's forward itself is never replaced.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

from meshkit.integrations.peft.layers import adapter, base_layer, is_lora_layer

COLUMN_ROLES = ("colwise", "kv_colwise")
ROW_ROLES = ("rowwise",)


def linear_base(module: nn.Module) -> nn.Module:
    """The linear the plan shards: the module itself, or a LoRA layer's base layer."""
    return base_layer(module)


def linear_shards(module: nn.Module, role: str) -> list[tuple[nn.Module, Placement, tuple | None]]:
    """(linear, placement of its parameters, grad placements of their local shards) for each linear
    that computes `module` (a plain linear, or a LoRA layer's base, A and B) under a colwise or
    rowwise role. A grad placement of (Partial(),) marks a replicated weight whose local gradient is
    only this rank's share; None keeps the parameter's own placement (a shard's gradient is its own)."""
    column = role in COLUMN_ROLES
    split = Shard(0) if column else Shard(1)
    if not is_lora_layer(module):
        return [(module, split, None)]
    parts = adapter(module)
    if column:
        return [(parts.base, split, None), (parts.a, Replicate(), (Partial(),)), (parts.b, Shard(0), None)]
    return [(parts.base, split, None), (parts.a, Shard(1), None), (parts.b, Replicate(), (Partial(),))]


def _distribute(linear: nn.Module, mesh: DeviceMesh, placement: Placement, row_bias: bool) -> None:
    """Replace the linear's weight (and bias) by DTensors; a row-parallel base's bias is replicated
    (DTensor adds it once to the partial sum)."""
    for name, param in list(linear.named_parameters(recurse=False)):
        where = Replicate() if (name == "bias" and row_bias) else placement
        dt = distribute_tensor(param.data, mesh, [where])
        linear.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def apply_adapter_style(module: nn.Module, role: str, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """The DTensor path for one LoRA layer: its linears placed by `linear_shards`, the input made a
    DTensor (Replicate for a column base, Shard(-1) for a row base), the output a local tensor (a row
    base's Partial sum reduced once: to the sequence shard under SP, else replicated)."""
    column = role in COLUMN_ROLES
    shards = linear_shards(module, role)
    base = shards[0][0]

    def partition(name: str, sub: nn.Module, device_mesh: DeviceMesh) -> None:
        for linear, placement, _ in shards:
            if sub is linear:
                _distribute(linear, device_mesh, placement, row_bias=not column and linear is base)

    def prepare_input(sub: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, [Replicate() if column else Shard(-1)], run_check=False)
        return (x, *inputs[1:])

    def prepare_output(sub: nn.Module, output: Any, device_mesh: DeviceMesh) -> torch.Tensor:
        if not column:
            output = output.redistribute(placements=[Shard(1) if sequence_parallel else Replicate()])
        return output.to_local()

    distribute_module(module, mesh, partition, prepare_input, prepare_output)
