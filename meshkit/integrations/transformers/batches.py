"""A Trainer batch (the collator's dict) as `pm.forward_backward` / `pm.evaluate` take it.

Collators pad to the longest row of each batch, so lengths are arbitrary, and the last batch of an
epoch can be short. meshkit's step needs a sequence length the plan can split (cp's layout, SP's tp
multiple) and, under pp, rows that split into `pp_microbatches`. Both are padded here without
changing the loss: padded positions get label -100 (no target, and causal attention means no real
token ever attends to them) and continuing positions; padded rows are all -100.

The collator's `attention_mask` may only mark right padding, with no target under it (its labels
-100, as `DataCollatorForLanguageModeling` and TRL's collators set them): meshkit's attention is
causal over the whole row, which equals HF's masked attention for every real token exactly then.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from meshkit.inference.hf_forward import PACKING_KWARGS
from meshkit.plan import Plan
from meshkit.step.loss import IGNORE_INDEX

KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "shift_labels")


class StepBatch(NamedTuple):
    """What meshkit's step runs: padded ids, unshifted labels (None without), positions (None: 0..S-1)."""

    input_ids: torch.Tensor
    labels: torch.Tensor | None
    position_ids: torch.Tensor | None
    rows: int  # before padding
    seq: int


def batch_problem(inputs: Mapping[str, Any], need_labels: bool) -> str | None:
    """What keeps meshkit's step from running this batch as the HF model would, or None (local)."""
    extra = sorted(set(inputs) - set(KEYS) - set(PACKING_KWARGS))
    if extra:
        return (f"the batch holds {extra}, which meshkit's training step does not take (it takes {list(KEYS)}); fix: "
                "a collator without them, or a compute_loss of your own (pp = 1) that passes them to the model")
    if any(k in inputs for k in PACKING_KWARGS) and inputs.get("position_ids") is None:
        return "packing boundaries (cu_seq_lens) without position_ids; fix: a collator that sets position_ids"
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return f"input_ids must be a tensor [batch, seq], got {getattr(ids, 'shape', type(ids).__name__)}"
    labels, shifted = inputs.get("labels"), inputs.get("shift_labels")
    if need_labels and labels is None and shifted is None:
        return "the batch has no labels; fix: a collator that sets them (DataCollatorForLanguageModeling(mlm=False))"
    for name in ("labels", "shift_labels", "attention_mask"):
        value = inputs.get(name)
        if value is not None and tuple(value.shape) != tuple(ids.shape):
            return f"{name} {tuple(value.shape)} must have the shape of input_ids {tuple(ids.shape)}"
    if shifted is not None and bool((shifted[:, -1] != IGNORE_INDEX).any()):
        return ("shift_labels has a target at the last position, which unshifted labels cannot express; fix: "
                "labels instead of shift_labels")
    mask = inputs.get("attention_mask")
    if mask is not None:
        if not torch.equal(mask.cummin(dim=1).values, mask):
            return ("attention_mask marks padding that is not all on the right (left padding or holes); fix: pad on "
                    "the right (tokenizer.padding_side = 'right') or pack with position_ids")
        target = labels if labels is not None else shifted
        if target is not None and bool(((mask == 0) & (target != IGNORE_INDEX)).any()):
            return ("labels under attention_mask == 0 are targets; HF's masked attention and meshkit's causal one "
                    "differ there; fix: label padded positions -100 (DataCollatorForLanguageModeling does)")
    return None


def step_batch(inputs: Mapping[str, Any], plan: Plan) -> StepBatch:
    """Pad `inputs` (checked by `batch_problem`) to the plan's sequence multiple and microbatch rows."""
    ids = inputs["input_ids"]
    rows, seq = ids.shape
    labels = inputs.get("labels")
    if labels is None and inputs.get("shift_labels") is not None:
        labels = F.pad(inputs["shift_labels"][:, :-1], (1, 0), value=IGNORE_INDEX)
    positions = inputs.get("position_ids")
    extra = -seq % plan.seq_multiple()
    if extra:
        ids = F.pad(ids, (0, extra))
        labels = None if labels is None else F.pad(labels, (0, extra), value=IGNORE_INDEX)
        if positions is not None:
            more = positions[:, -1:] + torch.arange(1, extra + 1, device=positions.device)
            positions = torch.cat([positions, more], dim=1)
    missing = -rows % plan.microbatches if plan.pp > 1 else 0
    if missing:
        ids = torch.cat([ids, ids.new_zeros(missing, ids.shape[1])])
        labels = None if labels is None else torch.cat([labels, labels.new_full((missing, ids.shape[1]),
                                                                                  IGNORE_INDEX)])
        if positions is not None and positions.shape[0] > 1:
            positions = torch.cat([positions, positions[:1].expand(missing, -1)])
    return StepBatch(ids, labels, positions, rows, seq)
