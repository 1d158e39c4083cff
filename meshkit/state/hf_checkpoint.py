"""Hugging Face weights in and out of a sharded model, with no rank holding the whole model on the way in.

In: `load_hf_checkpoint(pm, directory)` reads a directory as `save_pretrained` writes it
(`model.safetensors`, or `model-0000x-of-0000y.safetensors` shards with their index). Every rank
reads the safetensors *headers* (names, shapes) to check the whole model against the files, then
reads, tensor by tensor, only the slices it holds: its pipeline stages' tensors, and of each only its
own chunk (`get_slice`), so its peak is one local shard, not one full tensor. The checks depend only
on the files and the model config, so a mismatch raises the same ValueError on every rank with no
collective.

HF MoE models: `save_pretrained` of transformers 5.x writes Mixtral and Qwen3-MoE experts in the
legacy per-expert format (`...block_sparse_moe.experts.N.w1/w3/w2.weight` for Mixtral,
`...mlp.experts.N.gate_proj/up_proj/down_proj.weight` for the Qwen-MoE family) and converts them
when loading; meshkit's MoE keeps the fused layout (`gate_up_proj` [E, 2I, H] = per-expert
[gate; up] stacked, `down_proj` [E, H, I]), so the loader assembles each rank's experts from the
per-expert tensors (transformers' own conversion: stack experts on dim 0, gate then up on dim 1).
A fused checkpoint loads as it is. HF's empty tensors of a zero-width shared expert (which the
converted model leaves out) are accepted, and written back on export (`hf_moe.zero_width_shared_expert_shapes`).

Out: `save_hf_checkpoint(pm, directory, tokenizer=...)` assembles the full state on rank 0 only
(`state.gather`: the other ranks send their chunks and hold nothing more) and rank 0 writes it with
HF's own `save_pretrained` from a fresh meta-device HF model carrying the model's generation config,
then the tokenizer (chat template included) beside it, so the directory is exactly what
`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained` expect.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit._compat.dcp import dtensor_chunks
from meshkit.local_tensor import local_tensor
from meshkit.models import hf_moe
from meshkit.models import moe as moe_models
from meshkit.state.gather import full_state_dict_on_rank0
from meshkit.state.names import hf_name, is_adapter, is_meshkit_only, persistent_tensors
from meshkit.step.consensus import brief, raise_if_any

if TYPE_CHECKING:
    from meshkit.parallel_model import ParallelModel

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# How save_pretrained lays out each per-expert format, in the order of HF's own conversion:
# (module name in the file where the model has `.mlp.`, gate, up, down projection names).
# ------------------------------------------------------------------------------------------- files


def _read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from a safetensors header (8-byte length, then JSON); no data read."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return {name: tuple(entry["shape"]) for name, entry in header.items()}


def _checkpoint_files(directory: Path) -> list[Path]:
    if (directory / INDEX).is_file():
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        return [directory / f for f in sorted(set(weight_map.values()))]
    if (directory / SINGLE).is_file():
        return [directory / SINGLE]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"load_hf_checkpoint: no {SINGLE}, {INDEX} or *.safetensors in {str(directory)!r}; "
                         "fix: a directory written by save_pretrained (safetensors; .bin files are not read)")
    return files


# ----------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class _Direct:
    """A model tensor stored under one file key."""

    key: str
    shape: tuple[int, ...]

    def keys(self) -> list[str]:
        return [self.key]

    def read(self, files: _Files, box: tuple[slice, ...]) -> torch.Tensor:
        if not box:
            return files.handle(self.key).get_tensor(self.key)
        return files.handle(self.key).get_slice(self.key)[box]


@dataclass(frozen=True)
class _StackedExperts:
    """A fused expert tensor [E, sum(rows), cols] stored as per-expert matrices, `pieces[e]` stacked on rows."""

    pieces: tuple[tuple[str, ...], ...]
    rows: tuple[int, ...]
    cols: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.pieces), sum(self.rows), self.cols)

    def keys(self) -> list[str]:
        return [k for per_expert in self.pieces for k in per_expert]

    def read(self, files: _Files, box: tuple[slice, ...]) -> torch.Tensor:
        experts, (r0, r1), cols = box[0], (box[1].start, box[1].stop), box[2]
        out = []
        for e in range(experts.start, experts.stop):
            parts, offset = [], 0
            for key, rows in zip(self.pieces[e], self.rows):
                lo, hi = max(r0, offset), min(r1, offset + rows)
                if lo < hi:  # only the rows of this expert's matrix that this rank holds
                    parts.append(files.handle(key).get_slice(key)[lo - offset:hi - offset, cols])
                offset += rows
            out.append(torch.cat(parts))
        return torch.stack(out)


class _Files:
    """Open safetensors files on demand (memory-mapped; opening reads no tensor data)."""

    def __init__(self, where: dict[str, Path], stack: contextlib.ExitStack):
        self._where, self._stack, self._open = where, stack, {}

    def handle(self, key: str):
        path = self._where[key]
        if path not in self._open:
            self._open[path] = self._stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
        return self._open[path]


def _source(name: str, shape: tuple[int, ...], shapes: dict[str, tuple[int, ...]]):
    """Where model tensor `name` lives in the files: under its own name or, for MoE, a per-expert format."""
    if name in shapes:
        return _Direct(name, shapes[name])
    match = hf_moe.HF_MOE_PARAM_NAME.fullmatch(name)
    if match is None:
        return None
    head, tail = match.groups()
    for module, gate, up, down in hf_moe.HF_EXPERT_FILE_FORMATS:
        base = f"{head}{module}"
        if tail == "gate.weight":
            if base + "gate.weight" in shapes:
                return _Direct(base + "gate.weight", shapes[base + "gate.weight"])
            continue
        names = (gate, up) if tail == "experts.gate_up_proj" else (down,)
        pieces = tuple(tuple(f"{base}experts.{e}.{n}.weight" for n in names) for e in range(shape[0]))
        if all(k in shapes for per in pieces for k in per):
            first = [shapes[k] for k in pieces[0]]
            if any(len(s) != 2 for s in first):
                return None
            return _StackedExperts(pieces, tuple(s[0] for s in first), first[0][1])
    return None


# ---------------------------------------------------------------------------------------- loading


def _plan_sources(model: nn.Module, shapes: dict[str, tuple[int, ...]], strict: bool,
                  aliases: dict[str, str]) -> dict[str, Any]:
    """Source of every model tensor; raises (identically on every rank) on anything that does not fit.

    `aliases` (a tied head's pipeline copy -> the embedding) read the embedding's tensor for the copy.
    """
    tensors = persistent_tensors(model)
    sources, missing, wrong = {}, [], []
    for name, tensor in tensors.items():
        # A PEFT model's base weights under their HF names; its adapters are not in base files.
        source = _source(hf_name(aliases.get(name, name)), tuple(tensor.shape), shapes)
        if source is None:
            if not is_meshkit_only(name) and not is_adapter(name):  # meshkit's balancing state: not in HF files
                missing.append(name)
            continue
        per_piece_ok = not isinstance(source, _StackedExperts) or all(
            shapes[k] == (rows, source.cols) for per in source.pieces for k, rows in zip(per, source.rows))
        if tuple(source.shape) != tuple(tensor.shape) or not per_piece_ok:
            wrong.append(f"{name}: file {tuple(source.shape)}, model {tuple(tensor.shape)}")
            continue
        sources[name] = source
    used = {k for s in sources.values() for k in s.keys()}
    # A tied weight's second name (lm_head.weight) may be in the file; the embedding is authoritative.
    tied = {hf_name(n) for n in set(dict(model.named_parameters(remove_duplicate=False))) - set(tensors) | set(aliases)}
    # HF's empty shared-expert tensors (and Qwen2-MoE's gate) of a zero-width shared expert: the
    # converted model leaves them out, and they add exactly zero.
    absent = {k for k, (_, shape) in hf_moe.zero_width_shared_expert_shapes(model.config, shapes).items()
              if shapes.get(k) == shape}
    unexpected = sorted(set(shapes) - used - tied - absent)
    problems = []
    if missing:
        problems.append(f"{len(missing)} model tensor(s) not in the files: {brief(missing)}")
    if wrong:
        problems.append(f"{len(wrong)} shape mismatch(es): {brief(wrong)}")
    if unexpected and strict:
        problems.append(f"{len(unexpected)} file tensor(s) the model does not have: {brief(unexpected)} "
                        "(strict=False ignores them)")
    if problems:
        raise ValueError("load_hf_checkpoint: the checkpoint does not fit the model:\n  - " + "\n  - ".join(problems)
                         + "\n  - fix: build the model from this directory's config.json")
    return sources


def _local_box(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the global tensor this rank stores (a DTensor's one chunk; a plain tensor whole)."""
    if isinstance(tensor, DTensor):
        # The same chunk description DCP writes checkpoints with: offsets and sizes in the global tensor.
        (chunk,) = dtensor_chunks(tensor)
        return tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))
    return tuple(slice(0, s) for s in tensor.shape)


@torch.no_grad()
def load_hf_checkpoint(pm: ParallelModel, directory: str | Path, *, strict: bool = True) -> None:
    """Fill this rank's shards from a `save_pretrained` directory; no rank reads more than it holds.

    Call on every rank after `parallelize` (a meta-device model is materialised here). Tensors of other
    pipeline stages are never read; of its own tensors a rank reads only its chunk. Tied embeddings
    need no `lm_head.weight` in the files. Raises ValueError on every rank when names or shapes do not
    fit (`strict=False` tolerates extra file tensors), and on every rank when any rank fails to read.
    """
    directory = Path(directory)
    files = _checkpoint_files(directory)
    shapes, where = {}, {}
    for path in files:
        for key, shape in _read_header(path).items():
            shapes[key], where[key] = shape, path
    sources = _plan_sources(pm.model, shapes, strict, pm.tied_aliases)

    pm.materialise()
    held = {id(t) for part in pm.model_parts for t in [*part.parameters(), *part.buffers()]}
    problem = None
    try:
        with contextlib.ExitStack() as stack:
            opened = _Files(where, stack)
            for name, target in persistent_tensors(pm.model).items():
                if id(target) not in held or name not in sources:
                    continue  # another pipeline stage's tensor, or a meshkit-only buffer keeping its init
                box = _local_box(target)
                dest = local_tensor(target)
                if dest.numel() == 0:
                    continue  # an uneven shard left this rank nothing
                local = sources[name].read(opened, box)
                if tuple(local.shape) != tuple(dest.shape):
                    raise RuntimeError(f"{name}: read {tuple(local.shape)} for a local shard of {tuple(dest.shape)}")
                dest.copy_(local)
    except Exception as err:  # noqa: BLE001 - reported on every rank below instead of hanging the others
        problem = f"load_hf_checkpoint({str(directory)!r}): {type(err).__name__}: {err}"
    raise_if_any(problem, device=pm.device)


# ---------------------------------------------------------------------------------------- export


def save_hf_checkpoint(pm: ParallelModel, directory: str | Path, *, tokenizer: Any = None,
                       max_shard_size: int | str = "5GB") -> None:
    """Write a directory `from_pretrained` loads as it is, from any plan; call on every rank.

    Config, generation config (`pm.model.generation_config`: eos, pad, sampling defaults) and
    safetensors, as `save_pretrained` writes them; with `tokenizer` (a tokenizer object, or the
    directory of one) also the tokenizer and its chat template, so `AutoTokenizer.from_pretrained` and
    a serving stack load the same directory. Only rank 0 assembles the full state (CPU memory for
    the whole model, `meshkit.state.gather`) and writes; the other ranks send their chunks and
    hold nothing more. All ranks return after the write, or all raise if it failed.
    meshkit-only state (DeepSeek-V3 `expert_bias`) is dropped: HF classes have no slot.
    """
    config = pm.model.config
    if moe_models.is_moe_model(pm.model) and getattr(config, "model_type", None) not in hf_moe.MOE_MODEL_TYPES:
        raise ValueError(
            f"save_hf_checkpoint: a {config.model_type} model with meshkit MoE layers (Llama-MoE) has no "
            "Hugging Face class, so from_pretrained could not load it; fix: save it with "
            "meshkit.state.checkpoint.save, or pm.full_state_dict() with safetensors")
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)) and not hasattr(tokenizer,
                                                                                               "save_pretrained"):
        raise ValueError(f"save_hf_checkpoint: tokenizer={type(tokenizer).__name__}: expected a Hugging Face "
                         "tokenizer (with save_pretrained) or the directory of one; fix: pass "
                         "AutoTokenizer.from_pretrained(<dir>) or <dir>, or leave tokenizer out")
    state = full_state_dict_on_rank0(pm)
    problem = None
    if state is not None:  # rank 0
        try:
            write_pretrained(pm.model, hf_moe.to_hf_state_dict(state, config), Path(directory), max_shard_size,
                             tokenizer)
        except Exception as err:  # noqa: BLE001 - every rank must learn of it, or they return as if it worked
            problem = f"save_hf_checkpoint: rank 0 could not write {str(directory)!r}: {type(err).__name__}: {err}"
    raise_if_any(problem, device=pm.device)  # also the barrier: no rank returns before the files exist


def write_pretrained(source: nn.Module, state: dict[str, torch.Tensor], directory: Path,
                     max_shard_size: int | str, tokenizer: Any) -> None:
    """Rank 0's write: a fresh meta-device HF model of `source`'s config given `state` (HF names), saved by
    HF's own `save_pretrained` with `source`'s generation config and the tokenizer (the merged export of
    a LoRA model writes through it too)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} is a file")  # save_pretrained would only log this and return
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    config = copy.deepcopy(source.config)
    if tokenizer is not None and len(tokenizer) > config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, the model's embedding {config.vocab_size} rows: "
                         "ids past the embedding would fail in from_pretrained's model; fix: the model's own "
                         "tokenizer (the one its data was tokenized with)")
    # parallelize pinned meshkit's attention function on the live config; the export must not name it.
    config._attn_implementation = None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if getattr(source, "generation_config", None) is not None:
        model.generation_config = copy.deepcopy(source.generation_config)
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()  # assign=True replaced both names of a tied weight; make them one again
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    if not (directory / "config.json").is_file():
        raise RuntimeError(f"save_pretrained wrote no config.json into {directory}")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
