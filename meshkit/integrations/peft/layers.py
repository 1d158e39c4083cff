"""What a PEFT LoRA layer is made of, read from its attributes (peft itself is never imported here).

PEFT's `lora.Linear` wraps a targeted `nn.Linear` as `base_layer` and adds, per adapter name,
`lora_A[name]` (an `nn.Linear` in -> r, no bias), `lora_B[name]` (r -> out), `lora_dropout[name]`
and the float `scaling[name]` (alpha / r, or alpha / sqrt(r) with rsLoRA); its forward is
`base(x) + B(A(dropout(x))) * scaling`. meshkit places the three linears (`tensor_parallel.lora`)
and lets PEFT's own forward run on them, so PEFT's numerics are the reference by construction.
Reading the structure rather than the class keeps `import meshkit` free of peft's import cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Adapter:
    """The parts of one LoRA layer's (single) adapter; shared modules, not copies."""

    name: str           # PEFT's adapter name ("default")
    base: nn.Module     # the wrapped layer (an nn.Linear for lora.Linear)
    a: nn.Linear        # in -> r
    b: nn.Linear        # r -> out
    scaling: float


def is_lora_layer(module: nn.Module) -> bool:
    """Whether `module` is a PEFT LoRA wrapper (lora.Linear, lora.Embedding, ParamWrapper, ...)."""
    return (hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), nn.ModuleDict))


def base_layer(module: nn.Module) -> nn.Module:
    """The layer a LoRA wrapper wraps (the module itself when it is not one): what the plan shards."""
    return module.base_layer if is_lora_layer(module) else module


def adapter(module: nn.Module) -> Adapter:
    """The one adapter of a LoRA layer (meshkit trains a single adapter per model; `model.problems`
    refuses more before anything is sharded)."""
    (name,) = module.lora_A.keys()
    return Adapter(name, module.base_layer, module.lora_A[name], module.lora_B[name], float(module.scaling[name]))


def lora_layers(root: nn.Module) -> dict[str, nn.Module]:
    """{name relative to `root`: LoRA layer} for every LoRA wrapper under `root` (outermost only)."""
    found: dict[str, nn.Module] = {}
    for name, module in root.named_modules():
        if is_lora_layer(module) and not any(name.startswith(f"{outer}.") for outer in found):
            found[name] = module
    return found


def owner_and_part(owner: str) -> tuple[str, str]:
    """(the layer, its part) for the module path that owns a parameter: a LoRA layer's base
    (`q_proj.base_layer` -> ("q_proj", "base")) or adapter (`q_proj.lora_A.default` -> ("q_proj", "lora_A")),
    else (owner, "")."""
    for part, marker in (("base", ".base_layer"), ("lora_A", ".lora_A."), ("lora_B", ".lora_B.")):
        if marker in owner or owner.endswith(marker):
            return owner[:owner.index(marker)], part
    return owner, ""
