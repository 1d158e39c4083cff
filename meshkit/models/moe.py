"""Mixture-of-experts models as meshkit sees them: which blocks have experts, and the conversion of
every MoE block into a `meshkit.MoE`, in place.

Like `llama.py`, this is a module that knows Hugging Face names; the rest of meshkit only ever sees
`MoE` layers. Two kinds of model qualify:

- **HF MoE models** (`hf_moe.MOE_MODEL_TYPES`): each decoder block's sparse `mlp` becomes an `MoE`
  holding the block's own Parameters under HF's names (`hf_moe.py`: block formats, the converter,
  HF's auxiliary loss and the export to HF's keys).
- **Llama-MoE** (meshkit's debug model): a Llama-family config carrying a `meshkit_moe` dict (e.g.
  `{"num_experts": 8, "top_k": 2}`); `llama_moe` (or `convert_moe_blocks`, which reads the dict)
  swaps every dense MLP for an `MoE`. The dict travels in `config.json`, so a saved model says how to
  rebuild itself.

`moe_spec` reads what a config says about its experts (what `Plan.validate`, FLOP counts and the
estimator need), `uniform_config` gives a stack of one block kind, `plan_problems` the MoE rules a
plan must meet.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from meshkit.expert_parallel import MoE, expert_split_problem, moe_layers
from meshkit.models.hf_moe import CONVERT_OPTIONS, MOE_MODEL_TYPES, convert_hf_block, is_hf_moe_block

__all__ = [
    "MoESpec",
    "convert_moe_blocks",
    "is_moe_model",
    "llama_moe",
    "moe_layers",
    "moe_spec",
    "plan_problems",
    "uniform_config",
]

LLAMA_MOE_KEY = "meshkit_moe"  # config attribute that turns a Llama-family model into a Llama-MoE


@dataclass(frozen=True)
class MoESpec:
    """What a model config says about its experts; what `Plan.validate` and FLOP counts need."""

    num_experts: int
    top_k: int
    intermediate_size: int
    layers: tuple[int, ...]  # indices of the decoder blocks that are MoE
    shared_intermediate_size: int = 0  # the shared expert every token runs (Qwen2-MoE, DeepSeek-V3)
    shared_gate: bool = False  # Qwen2-MoE's [1, H] sigmoid gate on the shared expert


def moe_spec(config: Any) -> MoESpec | None:
    """The experts a config describes (HF MoE or Llama-MoE), or None for a dense model."""
    model_type = getattr(config, "model_type", None)
    n_layers = int(getattr(config, "num_hidden_layers", 0))
    if model_type == "mixtral":
        return MoESpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                       tuple(range(n_layers)))
    if model_type == "deepseek_v3":
        return MoESpec(config.n_routed_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                       tuple(range(int(config.first_k_dense_replace or 0), n_layers)),
                       shared_intermediate_size=config.moe_intermediate_size * int(config.n_shared_experts or 0))
    if model_type == "gpt_oss":
        return MoESpec(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                       tuple(range(n_layers)))
    if model_type == "olmoe":
        return MoESpec(config.num_experts, config.num_experts_per_tok, config.intermediate_size, tuple(range(n_layers)))
    if model_type in ("qwen3_moe", "qwen2_moe"):
        step, dense = max(int(config.decoder_sparse_step), 1), set(config.mlp_only_layers or ())
        layers = tuple(i for i in range(n_layers) if i not in dense and config.num_experts > 0 and (i + 1) % step == 0)
        if model_type == "qwen2_moe":
            return MoESpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, layers,
                           shared_intermediate_size=config.shared_expert_intermediate_size, shared_gate=True)
        return MoESpec(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, layers)
    options = getattr(config, LLAMA_MOE_KEY, None)
    if options:
        opts = _llama_moe_options(options)
        layers = opts.get("layers")
        return MoESpec(opts["num_experts"], opts["top_k"], opts.get("intermediate_size") or config.intermediate_size,
                       tuple(range(n_layers)) if layers is None else tuple(layers))
    return None


def uniform_config(config: Any, moe: bool) -> Any:
    """A copy of `config` whose every decoder block is MoE (`moe=True`) or dense (`moe=False`).

    Why: a published stack often mixes the two (DeepSeek-V3's `first_k_dense_replace`, Qwen2/3-MoE's
    `mlp_only_layers` and `decoder_sparse_step`, a Llama-MoE's `layers`), and whoever models one block
    (the estimator builds, traces and counts a one-block model) needs a config in which block 0 is of
    the kind asked for, with every other field as published. Raises ValueError for a family whose
    blocks are all of one kind when the other is asked for.
    """
    cfg = copy.deepcopy(config)
    n = int(getattr(cfg, "num_hidden_layers", 0))
    model_type = getattr(cfg, "model_type", None)
    if model_type == "deepseek_v3":
        cfg.first_k_dense_replace = 0 if moe else n
    elif model_type in ("qwen3_moe", "qwen2_moe"):
        cfg.mlp_only_layers = [] if moe else list(range(n))
        if moe:
            cfg.decoder_sparse_step = 1
    elif _is_llama_moe(cfg):
        opts = dict(getattr(cfg, LLAMA_MOE_KEY))
        opts.pop("layers", None)
        setattr(cfg, LLAMA_MOE_KEY, opts if moe else {**opts, "layers": []})
    else:
        spec = moe_spec(cfg)
        if (spec is not None and len(spec.layers) == n) != moe:
            raise ValueError(f"{model_type}: every block is {'dense' if spec is None else 'MoE'}; there is no "
                             f"{'MoE' if moe else 'dense'} block to model")
    return cfg


def is_moe_model(model: nn.Module) -> bool:
    """True when the model has meshkit MoE layers, HF sparse blocks, or a config that asks for experts."""
    if moe_spec(getattr(model, "config", None)) is not None:
        return True
    return any(isinstance(m, MoE) or is_hf_moe_block(m) for m in model.modules())


def plan_problems(moes: list[MoE], config: Any, *, pp: int, tp: int, ep: int, sequence_parallel: bool) -> list[str]:
    """MoE rules a plan's degrees must meet that the config alone cannot show (the model's actual
    layers: a user may swap in `MoE` layers a config does not describe), each with its fix."""
    problems = []
    if moes and pp > 1 and getattr(config, "output_router_logits", False):
        problems.append(
            f"pp={pp} with output_router_logits=true: HF's auxiliary loss pools router statistics over all "
            f"layers, which pipelining puts on different ranks; fix: config.output_router_logits=false (and, "
            f"for balancing, a per-layer aux_loss_coef or bias_update_rate on the MoE layers)"
        )
    if ep > 1 and not moes:
        problems.append(
            f"ep={ep}: the model has no meshkit MoE layers to shard; fix: ep=1, or swap its MLPs for "
            f"meshkit.MoE layers (HF sparse blocks of {MOE_MODEL_TYPES} are converted automatically)"
        )
    if moes and expert_split_problem(ep, moes[0].num_experts):
        problems.append(expert_split_problem(ep, moes[0].num_experts))
    if moes and tp > 1 and not sequence_parallel:
        problems.append(
            f"tp={tp} with MoE layers needs sequence_parallel=true: TP ranks route their own sequence shard "
            f"(experts are never split by TP); fix: sequence_parallel=true"
        )
    return problems


# ------------------------------------------------------------------------------------ HF models


def convert_moe_blocks(model: nn.Module, **options: Any) -> list[MoE]:
    """Replace every HF sparse MoE block (or, for a Llama-MoE config, every dense MLP) by an `MoE`.

    In place and idempotent: blocks already converted are kept as they are. Returns the model's MoE
    layers in block order. `options` (`capacity_factor`, `aux_loss_coef`, `z_loss_coef`,
    `bias_update_rate`, `expert_backend`) apply to newly converted HF blocks; the defaults reproduce
    HF's outputs and loss. Raises ValueError for HF settings meshkit does not reproduce.
    """
    unknown = sorted(set(options) - set(CONVERT_OPTIONS))
    if unknown:
        raise ValueError(f"convert_moe_blocks: unknown option(s) {unknown}; known: {list(CONVERT_OPTIONS)}")
    config = getattr(model, "config", None)
    llama_options = getattr(config, LLAMA_MOE_KEY, None)
    if llama_options and not any(is_hf_moe_block(m) for m in model.modules()):
        return llama_moe(model, **{**_llama_moe_options(llama_options), **options})
    for block in _decoder_blocks(model):
        mlp = getattr(block, "mlp", None)
        if mlp is not None and is_hf_moe_block(mlp):
            block.mlp = convert_hf_block(mlp, config, **options)
    return moe_layers(model)


def expert_computed_modules(model: nn.Module) -> list[nn.Module]:
    """The modules meshkit's `MoE` layer computes from their weights, never by calling them: each
    decoder block's HF sparse MoE block or `MoE` layer, and, for a Llama-MoE config, every block's MLP
    (conversion replaces it). An adapter inside one of them would be ignored (PEFT integration)."""
    blocks = _decoder_blocks(model)
    llama_moe = _is_llama_moe(getattr(model, "config", None)) and not any(map(is_hf_moe_block, model.modules()))
    mlps = [getattr(block, "mlp", None) for block in blocks]
    return [m for m in mlps if m is not None and (llama_moe or isinstance(m, MoE) or is_hf_moe_block(m))]


def _decoder_blocks(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: not a decoder-only causal LM meshkit knows")
    return list(layers)


# ------------------------------------------------------------------------------------ Llama-MoE


def _is_llama_moe(config: Any) -> bool:
    return bool(getattr(config, LLAMA_MOE_KEY, None)) and getattr(config, "model_type", None) not in MOE_MODEL_TYPES


def _llama_moe_options(options: Any) -> dict[str, Any]:
    """The `meshkit_moe` dict, checked: a typo must fail with the field's name, not a TypeError."""
    opts = dict(options)
    missing = [k for k in ("num_experts", "top_k") if k not in opts]
    known = {"num_experts", "top_k", "intermediate_size", "layers"} | (
        set(inspect.signature(MoE.__init__).parameters) - {"self", "hidden_size", "device", "dtype"})
    unknown = sorted(set(opts) - known)
    if missing or unknown:
        raise ValueError(f"config.{LLAMA_MOE_KEY}={opts!r}: " + "; ".join(
            ([f"lacks {missing}"] if missing else []) + ([f"unknown keys {unknown}"] if unknown else []))
            + f"; known keys: {sorted(known)}; e.g. {LLAMA_MOE_KEY} = {{num_experts = 8, top_k = 2}}")
    return opts


def llama_moe(model: nn.Module, num_experts: int, top_k: int, *, intermediate_size: int | None = None,
              layers: Iterable[int] | None = None, upcycle: bool = False, **moe_kwargs: Any) -> list[MoE]:
    """Swap the dense SwiGLU MLPs of a Llama-family model for `MoE` layers: meshkit's debug MoE model.

    `intermediate_size` per expert defaults to the dense one; `layers` (default all) picks the blocks;
    `moe_kwargs` go to `MoE` (`score_func`, `shared_intermediate_size`, `aux_loss_coef`,
    `bias_update_rate`, ...). `upcycle=True` copies each dense MLP into every expert (sparse
    upcycling), so the converted model computes exactly the dense one until training moves them
    apart; otherwise experts and router are drawn like HF draws linears (normal, `initializer_range`).
    The options are recorded in `config.meshkit_moe`, so `convert_moe_blocks` rebuilds the same model
    from a saved config. Idempotent: blocks whose `mlp` already is an `MoE` are left alone.
    """
    config = model.config
    inter = intermediate_size or config.intermediate_size
    chosen = None if layers is None else sorted(set(layers))
    recorded = {"num_experts": num_experts, "top_k": top_k, **moe_kwargs}
    if intermediate_size is not None:
        recorded["intermediate_size"] = intermediate_size
    if chosen is not None:
        recorded["layers"] = chosen
    setattr(config, LLAMA_MOE_KEY, recorded)
    moe_kwargs.setdefault("init_std", getattr(config, "initializer_range", 0.02))
    for i, block in enumerate(_decoder_blocks(model)):
        mlp = block.mlp
        if isinstance(mlp, MoE) or (chosen is not None and i not in chosen):
            continue
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"llama_moe: block {i}'s mlp ({type(mlp).__name__}) is not a SwiGLU MLP")
        if upcycle and inter != mlp.gate_proj.out_features:
            raise ValueError(f"llama_moe: upcycle copies the dense MLP, so intermediate_size={inter} must equal "
                             f"the dense {mlp.gate_proj.out_features}; fix: drop intermediate_size")
        weight = mlp.gate_proj.weight
        moe = MoE(config.hidden_size, inter, num_experts, top_k, device=weight.device, dtype=weight.dtype,
                  **moe_kwargs)
        if upcycle:
            with torch.no_grad():
                dense_gate_up_2IH = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                moe.experts.gate_up_proj.copy_(dense_gate_up_2IH.expand(num_experts, -1, -1))
                moe.experts.down_proj.copy_(mlp.down_proj.weight.expand(num_experts, -1, -1))
        block.mlp = moe
    return moe_layers(model)
