"""Router auxiliary losses in a step: what each call's terms weigh, and the value reported beside the CE.

Two kinds reach the gradients. meshkit `MoE` layers with `aux_loss_coef` / `z_loss_coef` attach
their terms to their output (`AttachLoss`), so they work on any pipeline stage; HF MoE models with
`output_router_logits` get HF's pooled-over-layers term added to the loss (`models.hf_moe.hf_aux_loss`).
Either way, one `forward_backward` call's terms are weighted like its cross-entropy:

- by 1/microbatches under pipelining: every microbatch's term is a whole batch's worth (its counts
  are summed over the data and context ranks), so the step's term is their mean;
- by the call's share of the window's valid tokens (`valid / loss_denominator`) under gradient
  accumulation, so the window's term is the token-weighted mean of its calls' and the coefficient
  means the same whatever the accumulation.

The value reported is exactly what entered the gradients: each rank's share summed over the ranks
that split the batch's tokens (dp x cp x tp) and over the pipeline stages, which hold different
layers. `evaluate` measures it the same way without building a graph.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshkit.expert_parallel import MoE, moe_layers
from meshkit.mesh import axis
from meshkit.models import hf_moe
from meshkit.models import moe as moe_models


class AuxLosses:
    """The auxiliary terms of one model under one plan: weights set per call, values summed globally."""

    def __init__(self, model: nn.Module, parts: list[nn.Module], mesh: DeviceMesh, microbatches: int):
        every = moe_layers(model)  # every rank sees every layer (other stages' on the meta device)
        held = {id(m): m for part in parts for m in moe_layers(part)}
        self.held: list[MoE] = list(held.values())
        self.hf = bool(getattr(model.config, "output_router_logits", False)) and moe_models.is_moe_model(model)
        self.active = self.hf or any(m.aux_loss_coef > 0 or m.z_loss_coef > 0 for m in every)
        self.model = model
        self.mesh = mesh
        self.microbatches = microbatches

    def begin(self, weight: float, measure: bool = False) -> None:
        """Before a call: its terms weigh `weight` (its share of the window's tokens); `measure`
        computes them without a graph (evaluation)."""
        for m in self.held:
            m.aux_loss_scale = weight / self.microbatches
            m.aux_loss_total = None
            m.measure_balance = measure

    def hf_term(self, weight: float) -> torch.Tensor | None:
        """HF's pooled term of the last forward, this rank's share, weighted (pp = 1 only: the plan
        refuses HF's pooled loss under pipelining)."""
        term = hf_moe.hf_aux_loss(self.model) if self.hf else None
        return None if term is None else term * weight

    def total(self, hf_term: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """The global auxiliary loss of the call as it entered the gradients (None if the model has none).

        Collective over the mesh when active; every rank knows `active` from the model alone.
        """
        for m in self.held:
            m.measure_balance = False
        if not self.active:
            return None
        value = torch.zeros((), dtype=torch.float32, device=device)
        for m in self.held:
            if m.aux_loss_total is not None:
                value = value + m.aux_loss_total.float()
        if hf_term is not None:
            value = value + hf_term.detach().float()
        value = value.clone()
        for name in ("dp_cp_tp", "pp"):
            group = axis(self.mesh, name)
            if group.size() > 1:
                dist.all_reduce(value, group=group.get_group())
        return value
