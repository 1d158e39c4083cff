"""Which tensors a state dict holds, and under which names: the rules every path in and out shares.

- Names are Hugging Face's (`model.layers.3.self_attn.q_proj.weight`), never module paths of
  meshkit's wrappers, which depend on the plan. A tied weight is named once (the embedding).
- Under pipelining a tied embedding is split into two copies; the LM head's copy answers to the
  embedding's name (`aliases`: {head name: embedding name}), so init, checkpoints and HF files
  treat the two as one tensor.
- Non-persistent buffers (rotary caches) are never saved or expected.
- meshkit-only buffers (the DeepSeek-V3 router bias and its load counts) are saved when present but
  may be missing from a checkpoint: HF files have no slot for them, and they start from zeros.
- A PEFT model goes by PEFT's names (`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight`,
  `...q_proj.lora_A.default.weight`): `hf_name` gives a base tensor's name in the base model's HF
  files, `is_adapter` tells the adapter's tensors, which those files do not hold.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

MESHKIT_ONLY_BUFFERS = (".expert_bias", ".load_counts_E")
PEFT_ROOT = "base_model.model."  # where a PeftModel keeps the HF *ForCausalLM
_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_magnitude_vector.", ".lora_embedding_A.", ".lora_embedding_B.")


def is_adapter(name: str) -> bool:
    """Whether `name` is a PEFT adapter tensor (LoRA's A and B), which base-model files never hold."""
    return any(part in name for part in _ADAPTER_PARTS)


def hf_name(name: str) -> str:
    """The name a tensor of the model goes by in the base model's HF files: PEFT's root and the
    `.base_layer` of a wrapped layer dropped (a plain model's names are HF's already)."""
    if not name.startswith(PEFT_ROOT):
        return name
    return name[len(PEFT_ROOT):].replace(".base_layer.", ".")


def is_meshkit_only(name: str) -> bool:
    """Whether `name` is meshkit balancing state a checkpoint or HF file may lack."""
    return name.endswith(MESHKIT_ONLY_BUFFERS)


def non_persistent_buffer_names(model: nn.Module) -> set[str]:
    """Names of buffers a state dict leaves out (rotary caches): never expected from a checkpoint."""
    names = set()
    for prefix, module in model.named_modules():
        for buf in getattr(module, "_non_persistent_buffers_set", ()):
            names.add(f"{prefix}.{buf}" if prefix else buf)
    return names


def persistent_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (tied weights once) and persistent buffer of the whole model, all stages.

    Other stages' layers are meta tensors of full shape and DTensors report their global shape, so
    every rank sees the same names and shapes without communicating.
    """
    transient = non_persistent_buffer_names(model)
    out = dict(model.named_parameters())
    out.update({n: b for n, b in model.named_buffers() if n not in transient})
    return out


def named_parameters(model: nn.Module, held: Iterable[nn.Parameter],
                     aliases: Mapping[str, str]) -> Iterator[tuple[str, nn.Parameter]]:
    """The parameters in `held` under their HF names (a tied head's pipeline copy under the embedding's)."""
    mine = {id(p) for p in held}
    for name, p in model.named_parameters():
        if id(p) in mine:
            yield aliases.get(name, name), p


def held_buffers(model: nn.Module, parts: Iterable[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """The persistent buffers the modules in `parts` own, under their HF names."""
    held = {id(b) for part in parts for b in part.buffers()}
    transient = non_persistent_buffer_names(model)
    for name, buf in model.named_buffers():
        if id(buf) in held and name not in transient:
            yield name, buf
