"""What some families' experts compute beyond plain SwiGLU, one small adapter each.

meshkit's experts default to Mixtral's: `down(silu(gate(x)) * up(x))`, weights in HF 5.x's fused
row layout (`gate_up_proj` [E, 2I, H], gate rows first). Families that differ say so in their HF
experts class (transformers marks it with `is_transposed`, `is_concatenated`, `has_bias`), and each
difference is one adapter here, shared by every family that has it:

- `ExpertLayout`: how the fused weights are stored. `transposed` ([E, in, out]: gate_up [E, H, 2I],
  down [E, I, H]; Llama4, gpt-oss) and `interleaved` (gate and up alternate along the fused dim,
  [g0, u0, g1, u1, ...]; gpt-oss). The experts keep HF's Parameters as they are (no re-layout, so
  HF export needs nothing) and read them accordingly: a transposed weight is the grouped GEMM's
  right operand as is, an interleaved output is split by stride instead of by halves.
- `add_expert_bias`: per-expert biases (`gate_up_proj_bias` [E, 2I], `down_proj_bias` [E, H]), each
  row adding its own expert's bias: one gather over the expert-major rows, whose backward sums each
  expert's rows into its bias gradient.
- `ClampedSwiGLU`: gpt-oss's activation. The gate is clamped above at `limit`, the up projection
  to [-limit, limit]; glu = gate * sigmoid(alpha * gate); out = (up + 1) * glu. Clamping keeps
  activations bounded for low-precision inference; the `+ 1` lets an expert pass the glu through
  unscaled when up is zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

Activation = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class ExpertLayout:
    """How fused expert weights are stored (HF's `is_transposed` and `not is_concatenated`)."""

    transposed: bool = False  # [E, in, out] instead of nn.Linear's [E, out, in]
    interleaved: bool = False  # gate/up alternate along the fused dim instead of [gate | up]

    def shapes(self, num_experts: int, hidden: int, inter: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(gate_up_proj shape, down_proj shape) for this layout."""
        if self.transposed:
            return (num_experts, hidden, 2 * inter), (num_experts, inter, hidden)
        return (num_experts, 2 * inter, hidden), (num_experts, hidden, inter)

    def split(self, gate_up_GN: Tensor) -> tuple[Tensor, Tensor]:
        """The fused projection's output -> (gate, up) [G, I] each."""
        if self.interleaved:
            return gate_up_GN[..., ::2], gate_up_GN[..., 1::2]
        gate_GI, up_GI = gate_up_GN.chunk(2, dim=-1)
        return gate_GI, up_GI


ROW_LAYOUT = ExpertLayout()  # HF 5.x's default: nn.Linear rows per expert, [gate | up]


def silu_glu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's gating: silu(gate) * up (Mixtral, Qwen-MoE, DeepSeek, OLMoE)."""
    return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gating: (clamp(up, ±limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

    A frozen dataclass, so layers holding one compare and print by value.
    """

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: Tensor, up: Tensor) -> Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def expert_of_rows(tokens_per_expert: list[int], counts_E: Tensor | None, device: torch.device) -> Tensor:
    """The local expert of each expert-major row [G], without a host sync when `counts_E` (the same
    counts on the device) is given."""
    num_rows = sum(tokens_per_expert)
    experts = torch.arange(len(tokens_per_expert), device=device)
    if counts_E is None:
        counts_E = torch.tensor(tokens_per_expert, device=device)
    return torch.repeat_interleave(experts, counts_E, output_size=num_rows)


def add_expert_bias(y_GN: Tensor, bias_EN: Tensor | None, expert_G: Tensor | None) -> Tensor:
    """Each expert-major row plus its expert's bias (no-op without a bias)."""
    if bias_EN is None:
        return y_GN
    return y_GN + bias_EN.index_select(0, expert_G).to(y_GN.dtype)
