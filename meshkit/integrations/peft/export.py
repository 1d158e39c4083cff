"""A LoRA model's files: the base in, the adapter in and out in PEFT's format, the merged model out.

- `load_base`: the base model's `save_pretrained` directory into a PEFT model (`state/hf_checkpoint`
  maps PEFT's names to HF's); adapters the files cannot hold are drawn as PEFT draws them when they
  were still on the meta device, else kept.
- `save_adapter`: what `PeftModel.save_pretrained` writes, `adapter_config.json` (PEFT's own
  serialisation of the LoraConfig, in inference mode, naming the base) and
  `adapter_model.safetensors` (the adapter tensors under PEFT's names without the adapter name), so
  `PeftModel.from_pretrained(base, directory)` loads it. Only the adapter is gathered (it is small);
  the base is never.
- `load_adapter`: such a directory back into the sharded model. The file must fit: same LoRA
  settings (r, alpha, rsLoRA, per-layer patterns) and every adapter tensor named and shaped as the
  model's; otherwise it was saved for another base, and every rank says so before any collective.
- `save_merged`: `merge_and_unload` in files: each LoRA layer's W + s * B @ A (computed in fp32) under
  the base's HF names, written by HF's `save_pretrained`, loadable with `from_pretrained` alone.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from meshkit.integrations.peft.layers import adapter, lora_layers
from meshkit.integrations.peft.model import is_peft_model, lora_config
from meshkit.mesh import axis
from meshkit.models import hf_moe, llama
from meshkit.state.full import copy_full_into, init_weights
from meshkit.state.gather import full_state_dict_on_rank0
from meshkit.state.hf_checkpoint import load_hf_checkpoint, write_pretrained
from meshkit.state.names import hf_name, is_adapter
from meshkit.step.consensus import brief, raise_if_any

if TYPE_CHECKING:
    from meshkit.parallel_model import ParallelModel

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# LoraConfig fields that change what an adapter tensor means; a file must agree on every one.
_MEANING = ("peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "use_dora", "lora_bias")


def is_adapter_dir(directory: str | Path) -> bool:
    """Whether `directory` holds a PEFT adapter (`adapter_config.json`) rather than a base model."""
    return (Path(directory) / CONFIG).is_file()


def _adapter_name(pm: ParallelModel) -> str:
    (name,) = pm.model.peft_config
    return name


def _file_key(name: str, adapter_name: str) -> str:
    """PEFT's name for an adapter tensor in its files: the adapter name dropped (`lora_A.default.weight` ->
    `lora_A.weight`)."""
    return name.replace(f".{adapter_name}.", ".")


def load_hf(pm: ParallelModel, directory: str | Path, strict: bool = True) -> None:
    """`pm.load_hf_checkpoint` of a LoRA model: an adapter directory, or the base model's."""
    if is_adapter_dir(directory):
        load_adapter(pm, directory)
    else:
        load_base(pm, directory, strict=strict)


def save_hf(pm: ParallelModel, directory: str | Path, *, merge: bool = False, tokenizer: Any = None,
            max_shard_size: int | str = "5GB") -> None:
    """`pm.save_hf_checkpoint` of a LoRA model: the adapter, or with `merge` the merged full model (each
    with the tokenizer, when given)."""
    if not is_peft_model(pm.model):
        raise ValueError("save_hf_checkpoint: merge=True merges a LoRA adapter and this model has none; fix: "
                         "merge=False")
    if merge:
        save_merged(pm, directory, max_shard_size=max_shard_size, tokenizer=tokenizer)
    else:
        save_adapter(pm, directory, tokenizer=tokenizer)


def load_base(pm: ParallelModel, directory: str | Path, strict: bool = True) -> None:
    """Base weights from `save_pretrained` files; adapters still on meta are initialised as PEFT does."""
    fresh = {name for name, p in pm.named_parameters() if is_adapter(name) and p.is_meta}
    load_hf_checkpoint(pm, directory, strict=strict)
    if fresh:
        init_weights(pm, seed=0, only=fresh)


def _gather_adapter(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """Every adapter tensor in full on every rank (each pipeline rank contributes its stages')."""
    out = {}
    for name, p in pm.named_parameters():
        if is_adapter(name):
            out[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
    if pm.plan.pp > 1:
        pieces: list[dict | None] = [None] * pm.plan.pp
        dist.all_gather_object(pieces, out, group=axis(pm.mesh, "pp").get_group())
        out = {k: v for piece in pieces for k, v in piece.items()}
    return out


def save_adapter(pm: ParallelModel, directory: str | Path, tokenizer: Any = None) -> None:
    """Write the adapter as `PeftModel.save_pretrained` does, and the tokenizer (an HF tokenizer or its
    directory) when given (rank 0 writes; every rank calls it)."""
    tensors = _gather_adapter(pm)
    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            directory = Path(directory)
            directory.mkdir(parents=True, exist_ok=True)
            name = _adapter_name(pm)
            save_file({_file_key(k, name): v.contiguous() for k, v in tensors.items()}, str(directory / WEIGHTS),
                      metadata={"format": "pt"})
            config = copy.deepcopy(lora_config(pm.model))
            lm = llama.causal_lm(pm.model)
            if config.base_model_name_or_path is None:
                config.base_model_name_or_path = getattr(lm, "name_or_path", None) or None
            config.inference_mode = True
            mapping = None if config.task_type is not None else {
                "base_model_class": type(lm).__name__, "parent_library": type(lm).__module__}
            config.save_pretrained(str(directory), auto_mapping_dict=mapping)
            if isinstance(tokenizer, (str, os.PathLike)):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(directory))
        except Exception as err:  # noqa: BLE001 - every rank must learn of it
            problem = f"save_hf_checkpoint: rank 0 could not write the adapter to {str(directory)!r}: {err}"
    raise_if_any(problem, device=pm.device)


def _fit_problems(pm: ParallelModel, directory: Path) -> list[str]:
    """Why the adapter in `directory` does not fit this model (read from the files alone)."""
    saved = json.loads((directory / CONFIG).read_text())
    mine = lora_config(pm.model)
    problems = []
    for field in _MEANING:
        here = getattr(mine, field, None)
        here = getattr(here, "value", here)
        there = saved.get(field)
        if field in ("rank_pattern", "alpha_pattern"):
            here, there = here or {}, there or {}
        if there != here and not (field == "lora_bias" and there is None and not here):
            problems.append(f"adapter_config.json {field}={there!r}, this model's LoraConfig {field}={here!r}")
    with safe_open(str(directory / WEIGHTS), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    name = _adapter_name(pm)
    expected = {_file_key(n, name): tuple(t.shape) for n, t in pm.model.named_parameters() if is_adapter(n)}
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    wrong = [f"{k}: file {shapes[k]}, model {expected[k]}" for k in sorted(set(shapes) & set(expected))
             if shapes[k] != expected[k]]
    for what, items in (("adapter tensors of the model not in the file", missing),
                        ("file tensors the model has no adapter for", extra), ("shape mismatches", wrong)):
        if items:
            problems.append(f"{len(items)} {what}: {brief(items)}")
    return problems


@torch.no_grad()
def load_adapter(pm: ParallelModel, directory: str | Path) -> None:
    """Load a PEFT adapter directory into this rank's adapter shards (the base stays as it is)."""
    directory = Path(directory)
    if not (directory / WEIGHTS).is_file():
        raise ValueError(f"load_hf_checkpoint: {str(directory)!r} has {CONFIG} but no {WEIGHTS}; fix: a directory "
                         "written by PeftModel.save_pretrained (safetensors) or pm.save_hf_checkpoint")
    problems = _fit_problems(pm, directory)
    if problems:
        raise ValueError(f"load_hf_checkpoint: the adapter in {str(directory)!r} was saved for another base or "
                         "LoRA config:\n  - " + "\n  - ".join(problems) + "\n  - fix: load it into the model and "
                         "LoraConfig it was trained with (its base_model_name_or_path, r, lora_alpha, target_modules)")
    pm.materialise()
    name = _adapter_name(pm)
    problem = None
    try:
        with safe_open(str(directory / WEIGHTS), framework="pt") as f:
            for param_name, p in pm.named_parameters():
                if is_adapter(param_name) and not p.is_meta:
                    copy_full_into(p, f.get_tensor(_file_key(param_name, name)))
    except Exception as err:  # noqa: BLE001 - reported on every rank instead of hanging the others
        problem = f"load_hf_checkpoint({str(directory)!r}): {type(err).__name__}: {err}"
    raise_if_any(problem, device=pm.device)


def save_merged(pm: ParallelModel, directory: str | Path, max_shard_size: int | str = "5GB",
                tokenizer: Any = None) -> None:
    """Write the merged model (W + s * B @ A per LoRA layer) as a plain HF model: rank 0 alone assembles
    the full state (`state.gather`) and writes; every rank calls it."""
    state = full_state_dict_on_rank0(pm)
    problem = None
    if state is not None:  # rank 0
        try:
            write_pretrained(llama.causal_lm(pm.model), _merged_hf_state(pm, state), Path(directory), max_shard_size,
                             tokenizer)
        except Exception as err:  # noqa: BLE001 - every rank must learn of it
            problem = f"save_hf_checkpoint(merge=True): rank 0 could not write {str(directory)!r}: {err}"
    raise_if_any(problem, device=pm.device)


def _merged_hf_state(pm: ParallelModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The full PEFT state with every adapter merged into its base weight, under HF's names."""
    merged = {}
    for name, layer in lora_layers(pm.model).items():
        parts = adapter(layer)
        key = f"{name}.base_layer.weight"
        a, b = state[f"{name}.lora_A.{parts.name}.weight"], state[f"{name}.lora_B.{parts.name}.weight"]
        merged[key] = (state[key].float() + parts.scaling * b.float() @ a.float()).to(state[key].dtype)
        bias = state.get(f"{name}.lora_B.{parts.name}.bias")
        if bias is not None:
            base_bias = f"{name}.base_layer.bias"
            merged[base_bias] = (state[base_bias].float() + parts.scaling * bias.float()).to(state[base_bias].dtype)
    hf_state = {hf_name(k): merged.get(k, v) for k, v in state.items() if not is_adapter(k)}
    return hf_moe.to_hf_state_dict(hf_state, llama.causal_lm(pm.model).config)
