"""TRL's fused-LM-head call, `model(..., labels=..., fused_lm_head=True)`, on meshkit's forward.

TRL (1.x) patches the model's forward so that, with `fused_lm_head=True`, it runs the HF backbone,
projects the hidden states through the LM head itself and returns per-token quantities instead of
logits. After `parallelize` that path cannot work: the backbone's forward is meshkit's stages, and a
head computed outside them would bypass the head's FSDP unit and its gradient reduction. So the
meshkit trainer installs `FusedHeadForward` as the model's forward after TRL has patched it: the
fields come from the full logits of meshkit's forward (gathered as `inference.hf_forward` does), at
temperature 1 (what SFT and DPO use). Per-token fields are [B, S - 1] (or [B, S] with
`shift_labels`), zero where the target is -100:

- `log_probs` (with gradient), `entropy` (with gradient), `is_top1`, `label_mask`;
- `mean_logits` and `log_sum_sq_probs` (log sum_v p_v^2), without gradient;
- `loss`: minus the summed log-probabilities over `num_items_in_batch`, or meshkit's global token
  mean without it (`inference.hf_forward`'s semantics); `aux_loss` None (router losses are refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import ModelOutput

from meshkit.inference.hf_forward import ModelForward
from meshkit.step.loss import IGNORE_INDEX


@dataclass
class FusedHeadOutput(ModelOutput):
    """The fields TRL's fused LM head returns (its `FusedCausalLMOutput`), from meshkit's logits."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


class FusedHeadForward(ModelForward):
    """meshkit's model forward that also answers TRL's `fused_lm_head=True` (module docstring)."""

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                 return_dict: bool | None = None, fused_lm_head: bool = False, **kwargs: Any):
        """HF's outputs, or with `fused_lm_head=True` the per-token fields TRL reads."""
        out = super().__call__(input_ids, attention_mask, position_ids, labels, **kwargs)
        if not fused_lm_head:
            return out if return_dict is not False else out.to_tuple()
        shifted = kwargs.get("shift_labels")
        logits = out.logits if shifted is not None else out.logits[:, :-1]
        targets = (shifted if shifted is not None else labels[:, 1:]).to(logits.device)
        return FusedHeadOutput(loss=out.loss, **per_token_fields(logits, targets))


def per_token_fields(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """log_probs, entropy, is_top1, label_mask, mean_logits, log_sum_sq_probs of [B, T, V] logits for
    [B, T] targets (-100: no target, every field 0 there)."""
    mask = targets != IGNORE_INDEX
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), device=logits.device)
    fields = {"log_probs": torch.where(mask, picked, zero),
              "entropy": torch.where(mask, -(logp.exp() * logp).sum(-1), zero),
              "label_mask": mask}
    with torch.no_grad():
        fields["is_top1"] = (logits.argmax(-1) == targets) & mask
        fields["mean_logits"] = torch.where(mask, logits.float().mean(-1), zero)
        fields["log_sum_sq_probs"] = torch.where(mask, torch.logsumexp(2 * logp, dim=-1), zero)
    return fields
