"""Column-parallel linears whose rank-local rows are not one contiguous shard of the weight.

Plain `ColwiseParallel` gives rank r rows [r*N/tp, (r+1)*N/tp) of a weight. Two kinds of layer need
other rows, and both are served by the one layer here, `RowSelectedLinear`:

- **Replicated K/V heads** (MQA, or GQA with fewer K/V heads than tp ranks): rank r holds query
  heads [r*H/tp, (r+1)*H/tp), which all read the same K/V head, so every rank sharing that head
  computes it (Megatron's and vLLM's "KV replication").
- **Packed projections** (Phi-3's `qkv_proj` = [q | k | v], `gate_up_proj` = [gate | up]): rank r
  needs its shard *of each logical part*, not rows [r*N/tp, ...) of the concatenation.

The weight stays whole on every tp rank (a Replicate DTensor, so FSDP still shards it over the data
ranks) and each rank multiplies only its rows. Gradients: rank r's weight gradient is non-zero on
its rows only and carries the share of the loss that flows through its query heads; marked Partial,
the sum over tp is exactly the single-device gradient (ranks that share a K/V head each add the part
their own query heads contributed, nothing is counted twice). The input gradient is Partial too and
is summed by the same reduction as the other column-parallel projections of the block.

Cost: the weight is not split over tp (tp times the memory of a sharded one, for this layer only),
and its gradient is all-reduced (or reduce-scattered by FSDP) in full. For MQA the K/V projections
are small; for packed layers that is the price of keeping HF's parameter layout and names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor


class RowSelectedLinear(nn.Module):
    """A linear layer computing rows `row_ranges` of its (tp-replicated) weight on this rank.

    Holds the original layer's `weight` and `bias` under the same names, so state dicts, checkpoints
    and HF export see an unchanged layer.
    """

    def __init__(self, linear: nn.Linear, tp_mesh: DeviceMesh, row_ranges: Sequence[tuple[int, int]]):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.tp_mesh = tp_mesh
        self.row_ranges = tuple((int(a), int(b)) for a, b in row_ranges)
        self.weight = _replicated(linear.weight, tp_mesh)
        self.bias = None if linear.bias is None else _replicated(linear.bias, tp_mesh)

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        pieces = [t[a:b] for a, b in self.row_ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Replicated input in, this rank's rows out (a plain tensor, like ColwiseParallel's)."""
        if not isinstance(x, DTensor):
            # The backward of from_local sums the Partial input gradient over tp (an all-reduce).
            x = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
        x_local = x.to_local(grad_placements=[Partial()])
        weight = self._rows(self.weight.to_local(grad_placements=[Partial()]))
        bias = None if self.bias is None else self._rows(self.bias.to_local(grad_placements=[Partial()]))
        return F.linear(x_local, weight, bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={list(self.row_ranges)}"


def _replicated(param: nn.Parameter, mesh: DeviceMesh) -> nn.Parameter:
    return nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()]), requires_grad=param.requires_grad)


def apply_selected_rows(block: nn.Module, rows: dict[str, list[tuple[int, int]]], tp_mesh: DeviceMesh) -> None:
    """Replace each linear named in `rows` (relative to `block`) by a `RowSelectedLinear`, in place."""
    for name, ranges in rows.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = block.get_submodule(parent_name) if parent_name else block
        setattr(parent, leaf, RowSelectedLinear(getattr(parent, leaf), tp_mesh, ranges))
