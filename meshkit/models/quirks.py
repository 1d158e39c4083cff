"""Family quirks that change the math outside the decoder blocks, one small adapter each.

meshkit drives the blocks itself (`stage.CausalLMStage`), so whatever an HF `*Model.forward` or
`*ForCausalLM.forward` does around them must be redone here, read from the config, never per family:

- embedding multiplier: the embedding output times `config.embedding_multiplier` (Granite). Gemma's
  sqrt(hidden) scale lives inside its embedding module and needs nothing;
- logit scaling: logits divided by `config.logits_scaling` (Granite);
- final logit soft-capping: c * tanh(logits / c) with c = `config.final_logit_softcapping` (Gemma-2/3);
- rotary per layer type: a rotary module whose forward takes a `layer_type` (Gemma-3's local and
  global rope bases) gives each block the embeddings of `config.layer_types[i]`.

Quirks inside the blocks (residual and attention multipliers, post-norms, q/k norms, partial rotary,
NoPE layers) run in HF's own block code; the attention-score quirks (windows, soft-capping, sinks)
arrive at meshkit's attention function as keywords (`context_parallel.masked`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class OuterQuirks:
    """What a model computes around its blocks beyond embedding -> blocks -> norm -> head."""

    embedding_multiplier: float = 1.0
    logits_divisor: float = 1.0
    logit_softcap: float | None = None
    layer_types: tuple[str, ...] | None = None  # set only when the rotary module takes a layer type


def outer_quirks(config, rotary: nn.Module) -> OuterQuirks:
    """Read the quirks from the config and the rotary module's signature."""
    takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
    layer_types = getattr(config, "layer_types", None)
    return OuterQuirks(
        embedding_multiplier=float(getattr(config, "embedding_multiplier", None) or 1.0),
        logits_divisor=float(getattr(config, "logits_scaling", None) or 1.0),
        logit_softcap=getattr(config, "final_logit_softcapping", None) or None,
        layer_types=tuple(layer_types) if takes_type and layer_types else None,
    )


def scale_embeddings(hidden: torch.Tensor, quirks: OuterQuirks) -> torch.Tensor:
    """The embedding output as the HF model feeds it to the first block."""
    return hidden * quirks.embedding_multiplier if quirks.embedding_multiplier != 1.0 else hidden


def transform_logits(logits: torch.Tensor, quirks: OuterQuirks) -> torch.Tensor:
    """The LM head output as the HF model returns it (elementwise, so vocab-sharded logits work)."""
    if quirks.logits_divisor != 1.0:
        logits = logits / quirks.logits_divisor
    if quirks.logit_softcap:
        logits = torch.tanh(logits / quirks.logit_softcap) * quirks.logit_softcap
    return logits


def position_embeddings(rotary: nn.Module, hidden: torch.Tensor, position_ids: torch.Tensor,
                        quirks: OuterQuirks) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
    """Rotary embeddings by layer type ({None: ...} when every layer shares one rope)."""
    if quirks.layer_types is None:
        return {None: rotary(hidden, position_ids)}
    return {t: rotary(hidden, position_ids, t) for t in sorted(set(quirks.layer_types))}


def layer_type(quirks: OuterQuirks, index: int) -> str | None:
    """The key into `position_embeddings` for decoder block `index`."""
    return None if quirks.layer_types is None else quirks.layer_types[index]
