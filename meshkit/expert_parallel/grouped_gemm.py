"""SwiGLU experts over expert-major rows: one grouped GEMM per projection, or a per-expert loop.

Rows arrive sorted by expert with the per-expert counts already on the host (dispatch synced them
once), so both paths cost no further host sync. `torch._grouped_mm` runs every expert in one kernel;
the loop is the reference it is tested against and the fallback where the kernel does not run
(fp64, strides that are not 16-byte aligned, devices or builds without it).

Weights use the HF 5.x fused layout, which is `nn.Linear`'s (out, in) per expert:
`gate_up_EOH` is [E, 2I, H] with the gate rows first, `down_EHI` is [E, H, I]. Families whose experts
store them transposed or interleaved, add biases or clamp the activation (gpt-oss) are served by the
adapters of `expert_variants`, on the same kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from itertools import accumulate
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshkit._compat.dispatch import grouped_mm_op, outside_dispatch_modes
from meshkit.expert_parallel.expert_variants import (
    ROW_LAYOUT,
    Activation,
    ExpertLayout,
    add_expert_bias,
    expert_of_rows,
    silu_glu,
)
from meshkit.local_tensor import local_tensor

Backend = Literal["auto", "grouped_mm", "loop"]


@functools.cache
def _kernel_runs(device_type: str, device_index: int | None, dtype: torch.dtype, transposed: bool = False) -> bool:
    """Whether the kernel runs for this device, dtype and weight layout, found by running it once.

    Support differs by build, device capability and dtype across the torch versions meshkit runs on,
    and a probe is the one answer that cannot go stale. The right operand is column-major for the
    row layout (`w.transpose(-2, -1)`) and row-major for a transposed one ([E, in, out] as stored).
    """
    op = grouped_mm_op()
    if op is None:
        return False
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    try:
        # The probe first runs inside the first MoE forward, possibly under selective activation
        # checkpointing, whose recompute (probe cached by then) would not run it: outside every
        # dispatch mode, it cannot shift the forward's cached outputs against the recompute's ops.
        with torch.no_grad(), outside_dispatch_modes():
            a = torch.zeros(8, 8, device=device, dtype=dtype)
            b = torch.zeros(2, 8, 8, device=device, dtype=dtype)
            op(a, b if transposed else b.transpose(-2, -1), offs=torch.tensor([3, 8], device=device, dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_mm_usable(x_GH: Tensor, *weights: Tensor, transposed: bool = False) -> bool:
    """True when `torch._grouped_mm` can take these operands as they are (`transposed`: the weights
    are stored [E, in, out]).

    It needs every row stride 16-byte aligned: H and I times the element size must be multiples of 16.
    """
    if any(w.dtype != x_GH.dtype or w.device != x_GH.device for w in weights):
        return False
    size = x_GH.element_size()
    dims = [x_GH.shape[-1]] + [d for w in weights for d in w.shape[-2:]]
    if any(d * size % 16 for d in dims):
        return False
    return _kernel_runs(x_GH.device.type, x_GH.device.index, x_GH.dtype, transposed)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.

    `_grouped_mm`'s backward rejects stride-0 gradients (e.g. from `.sum()` or `expand`), which the
    ops after the experts may produce.
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def expert_linear(
    x_GH: Tensor, w_EOH: Tensor, tokens_per_expert: Sequence[int], offsets_E: Tensor | None,
    transposed: bool = False,
) -> Tensor:
    """Rows of expert e times `w_EOH[e]`ᵀ (or times `w[e]` when `transposed`: [E, in, out]), for all
    experts at once; `offsets_E` selects the kernel.

    With `offsets_E` (int32 cumulative row ends) one `_grouped_mm`; rows past the last offset would
    come back uninitialised, so callers pass exactly `sum(tokens_per_expert)` rows. Without it, a loop
    of matmuls over the per-expert blocks.
    """
    if offsets_E is not None:
        out = grouped_mm_op()(x_GH, w_EOH if transposed else w_EOH.transpose(-2, -1), offs=offsets_E)
        return _ContiguousGrad.apply(out)
    blocks = torch.split(x_GH, list(tokens_per_expert))
    if transposed:
        return torch.cat([block @ w_EOH[e] for e, block in enumerate(blocks)])
    return torch.cat([F.linear(block, w_EOH[e]) for e, block in enumerate(blocks)])


def swiglu_experts(
    x_GH: Tensor,
    gate_up_EOH: Tensor,
    down_EHI: Tensor,
    tokens_per_expert: Sequence[int],
    backend: Backend = "auto",
    counts_E: Tensor | None = None,
    *,
    layout: ExpertLayout = ROW_LAYOUT,
    gate_up_bias_EN: Tensor | None = None,
    down_bias_EH: Tensor | None = None,
    activation: Activation = silu_glu,
) -> Tensor:
    """down(act(gate(x), up(x))) for every row with its own expert's weights; rows expert-major.

    `layout`, the biases and `activation` (default silu(gate) * up) are the `expert_variants`
    adapters; the defaults compute Mixtral's experts. `backend="auto"` takes the grouped GEMM where
    `grouped_mm_usable` says it runs, else the loop; `"grouped_mm"` raises where it does not run
    instead of silently falling back. `counts_E`, the same counts already on the device, gives the
    kernel its offsets (and the biases their rows' experts) without a host-to-device copy (on CUDA a
    blocking one).
    """
    if len(tokens_per_expert) != gate_up_EOH.shape[0]:
        raise ValueError(
            f"tokens_per_expert has {len(tokens_per_expert)} entries for {gate_up_EOH.shape[0]} local experts"
        )
    if sum(tokens_per_expert) != x_GH.shape[0]:
        raise ValueError(f"tokens_per_expert sums to {sum(tokens_per_expert)}, but there are {x_GH.shape[0]} rows")
    if backend not in ("auto", "grouped_mm", "loop"):
        raise ValueError(f"expert backend {backend!r}: use 'auto', 'grouped_mm' or 'loop'")
    x_GH = x_GH.to(gate_up_EOH.dtype)
    use_kernel = backend != "loop" and grouped_mm_usable(x_GH, gate_up_EOH, down_EHI, transposed=layout.transposed)
    if backend == "grouped_mm" and not use_kernel:
        raise ValueError(
            f"torch._grouped_mm does not run here ({x_GH.dtype} on {x_GH.device.type}, hidden "
            f"{x_GH.shape[-1]}, expert weights {tuple(gate_up_EOH.shape)}): it needs fp32/bf16 and "
            f"16-byte aligned strides; use expert_backend='auto' or 'loop'"
        )
    offsets_E = None
    if use_kernel and counts_E is not None:
        offsets_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    elif use_kernel:
        offsets_E = torch.tensor(list(accumulate(tokens_per_expert)), dtype=torch.int32, device=x_GH.device)
    expert_G = None
    if gate_up_bias_EN is not None or down_bias_EH is not None:
        expert_G = expert_of_rows(list(tokens_per_expert), counts_E, x_GH.device)
    gate_up_G2I = expert_linear(x_GH, gate_up_EOH, tokens_per_expert, offsets_E, layout.transposed)
    gate_GI, up_GI = layout.split(add_expert_bias(gate_up_G2I, gate_up_bias_EN, expert_G))
    out_GH = expert_linear(activation(gate_GI, up_GI), down_EHI, tokens_per_expert, offsets_E, layout.transposed)
    return add_expert_bias(out_GH, down_bias_EH, expert_G)


class GroupedExperts(nn.Module):
    """The routed experts' stacked weights, in HF 5.x's fused layout and under HF's names.

    A module of their own so that expert parallelism and FSDP can give these weights a mesh of
    their own (Shard(0) over ep, FSDP over the remaining data ranks) while the router and shared
    expert keep the dense placements; and named like HF's `experts` so state dicts map one to one.
    Every parameter has the experts on dim 0. `layout`, `bias` (`gate_up_proj_bias` [E, 2I],
    `down_proj_bias` [E, H]) and `activation` are the `expert_variants` adapters (gpt-oss uses all
    three); the defaults are Mixtral's experts.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: Backend = "auto",
                 *, layout: ExpertLayout = ROW_LAYOUT, bias: bool = False, activation: Activation = silu_glu,
                 **factory):
        super().__init__()
        gate_up_shape, down_shape = layout.shapes(num_experts, hidden_size, intermediate_size)
        self.gate_up_proj = nn.Parameter(torch.empty(gate_up_shape, **factory))
        self.down_proj = nn.Parameter(torch.empty(down_shape, **factory))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, **factory))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size, **factory))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        self.layout, self.activation = layout, activation
        self.backend: Backend = backend

    @property
    def num_local_experts(self) -> int:
        """Experts this rank holds (all of them without expert parallelism)."""
        return local_tensor(self.gate_up_proj).shape[0]

    def forward(self, x_GH: Tensor, tokens_per_expert: Sequence[int], counts_E: Tensor | None = None) -> Tensor:
        """`tokens_per_expert`: rows per local expert on the host; `counts_E`: the same on the device."""
        biases = (None if b is None else local_tensor(b) for b in (self.gate_up_proj_bias, self.down_proj_bias))
        gate_up_bias_EN, down_bias_EH = biases
        return swiglu_experts(x_GH, local_tensor(self.gate_up_proj), local_tensor(self.down_proj), tokens_per_expert,
                              self.backend, counts_E, layout=self.layout, gate_up_bias_EN=gate_up_bias_EN,
                              down_bias_EH=down_bias_EH, activation=self.activation)


class SwiGLU(nn.Module):
    """The shared expert: down(silu(gate(x)) * up(x)) on every token, under HF's MLP names."""

    def __init__(self, hidden_size: int, intermediate_size: int, **factory):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **factory)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **factory)

    def forward(self, x: Tensor) -> Tensor:
        """down(silu(gate(x)) * up(x))."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def from_hf_layout(gate_up: Tensor, down: Tensor, *, transposed: bool = False) -> tuple[Tensor, Tensor]:
    """HF fused expert weights -> `GroupedExperts`' (gate_up_proj, down_proj), losslessly.

    Most HF 5.x MoE models (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, OLMoE, ...) already store this
    layout: identity. Models marked `is_transposed` (Llama4, Aria) store [E, H, 2I] and [E, I, H] with
    the gate half first on the last dim: a transpose of the last two dims. gpt-oss (interleaved gate/up
    columns, biases, clamped activation) keeps its own layout: `GroupedExperts(layout=ExpertLayout(
    transposed=True, interleaved=True), bias=True, activation=ClampedSwiGLU(...))` reads it as stored.
    """
    if transposed:
        return gate_up.transpose(-2, -1), down.transpose(-2, -1)
    return gate_up, down


def to_hf_layout(gate_up_proj: Tensor, down_proj: Tensor, *, transposed: bool = False) -> tuple[Tensor, Tensor]:
    """Inverse of `from_hf_layout` (a transpose is its own inverse)."""
    return from_hf_layout(gate_up_proj, down_proj, transposed=transposed)
