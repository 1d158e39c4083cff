"""The Llama family as meshkit sees it: where the parts live, what each block's layers are for.

This is the only module that knows Hugging Face module names. Everything else asks it for the parts
of a causal LM (embedding, decoder blocks, final norm, LM head, rotary embedding) and for the *role*
of each layer inside a block (column- or row-parallel linear, sequence-parallel norm, ...), and turns
roles into parallel styles itself. Llama, Mistral, Qwen2 (attention biases), Qwen3 (per-head q/k
RMSNorm) and the MoE models Mixtral and Qwen3-MoE (whose sparse blocks `models/hf_moe.py` converts into
meshkit MoE layers first) share these names.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from meshkit.context_parallel import hf as cp_hf
from meshkit.expert_parallel import MoE
from meshkit.models import quirks as quirks_lib

# The model types whose tiny configs pass the family tests (tests/models/test_families.py); the
# README's support matrix lists them with every axis. The code below reads roles and quirks from
# configs and module structure; this list only records what has been proven equal to HF.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma", "gemma2",
                         "gemma3_text", "phi3", "olmo2", "granite", "smollm3", "glm4", "helium", "qwen2_moe",
                         "olmoe", "deepseek_v3", "gpt_oss")



@dataclass
class CausalLMParts:
    """The pieces of a decoder-only LM in execution order; shared objects, not copies."""

    embed: nn.Embedding
    blocks: list[nn.Module]
    norm: nn.Module
    lm_head: nn.Linear
    rotary: nn.Module
    tied: bool
    config: object = None
    quirks: quirks_lib.OuterQuirks = field(default_factory=quirks_lib.OuterQuirks)



def causal_lm(model: nn.Module) -> nn.Module:
    """The HF `*ForCausalLM` of `model`: itself, or the one a PEFT `PeftModel` wraps (`get_base_model`),
    whose targeted linears are LoRA layers. Structure is read from it, state-dict names from `model`."""
    unwrap = getattr(model, "get_base_model", None)
    return unwrap() if callable(unwrap) and isinstance(getattr(model, "peft_config", None), dict) else model


def check_supported(model: nn.Module) -> None:
    """Raise a ValueError naming what is missing when `model` is not a Llama-family causal LM."""
    model = causal_lm(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    inner = getattr(model, "model", None)
    missing = [
        name
        for name, ok in (
            ("config", config is not None),
            ("model.embed_tokens", hasattr(inner, "embed_tokens")),
            ("model.layers", hasattr(inner, "layers")),
            ("model.norm", hasattr(inner, "norm")),
            ("model.rotary_emb", hasattr(inner, "rotary_emb")),
            ("lm_head", hasattr(model, "lm_head")),
        )
        if not ok
    ]
    if missing or model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"meshkit.parallelize: {type(model).__name__} (model_type={model_type!r}) is not a supported "
            f"Llama-family causal LM{f'; it lacks {missing}' if missing else ''}. Supported model types: "
            f"{SUPPORTED_MODEL_TYPES} as their *ForCausalLM classes; fix: pass e.g. "
            f"transformers.LlamaForCausalLM"
        )
    for i, block in enumerate(inner.layers):
        attn = getattr(block, "self_attn", None)
        if attn is None or not hasattr(block, "mlp"):
            raise ValueError(f"meshkit.parallelize: decoder block {i} lacks self_attn/mlp; not a Llama-family block")


def parts(model: nn.Module) -> CausalLMParts:
    """The model's parts, after `check_supported`."""
    model = causal_lm(model)
    inner = model.model
    tied = model.lm_head.weight is inner.embed_tokens.weight
    return CausalLMParts(inner.embed_tokens, list(inner.layers), inner.norm, model.lm_head, inner.rotary_emb, tied,
                         model.config, quirks_lib.outer_quirks(model.config, inner.rotary_emb))


def untie_for_pipeline(model: nn.Module, keep_copy: bool) -> dict[str, str]:
    """Give the LM head its own copy of a tied embedding weight; return {head name: embedding name}.

    Pipelining puts the embedding (first stage) and the head (last stage) on different ranks, so each
    holds its own copy and `ParallelModel` keeps them equal: the copies' gradients are summed, and the
    copy goes by the embedding's name in every name-keyed path (init, checkpoints, HF files).
    `keep_copy=False` (a rank that does not hold the head) makes the copy a meta tensor.
    """
    p = parts(model)
    if not p.tied:
        return {}
    weight = p.embed.weight
    copy = weight.detach().clone() if keep_copy else torch.empty_like(weight, device="meta")
    lm = causal_lm(model)
    lm.lm_head.weight = nn.Parameter(copy, requires_grad=weight.requires_grad)
    prefix = next(f"{name}." if name else "" for name, module in model.named_modules() if module is lm)
    return {f"{prefix}lm_head.weight": f"{prefix}model.embed_tokens.weight"}



def has_moe(block: nn.Module) -> bool:
    """Whether the block's MLP is a meshkit MoE."""
    return isinstance(getattr(block, "mlp", None), MoE)


def moe_modules(parts: CausalLMParts) -> list[MoE]:
    """The meshkit MoE layers of the model's blocks (empty for a dense model)."""
    return [block.mlp for block in parts.blocks if isinstance(getattr(block, "mlp", None), MoE)]


def use_attention(model: nn.Module, implementation: str) -> None:
    """Route every attention layer through `implementation` (a transformers AttentionInterface name).

    meshkit drives the blocks itself with `attention_mask=None`; HF's eager attention would then
    apply no causal mask at all, so the implementation is always pinned to meshkit's causal one.
    """
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = implementation


def use_meshkit_attention(model: nn.Module) -> None:
    """Route every attention layer of `model` through meshkit's registered attention function."""
    use_attention(model, cp_hf.register())


def run_block(block: nn.Module, hidden, position_embeddings, position_ids, **attention_kwargs):
    """One decoder block on the residual stream; extra keywords reach the attention function."""
    out = block(hidden, attention_mask=None, position_embeddings=position_embeddings, position_ids=position_ids,
                **attention_kwargs)
    return out[0] if isinstance(out, tuple) else out


def cache_keyword(block: nn.Module) -> str:
    """The keyword an HF decoder block takes its KV cache under: transformers renamed
    `past_key_values` to `cache` (5.2x keeps the old name as a deprecated alias, older 5.x lack the new one)."""
    return "cache" if "cache" in inspect.signature(type(block).forward).parameters else "past_key_values"


def reset_rotary(rotary: nn.Module, device: torch.device) -> None:
    """Recompute rotary buffers, which are not parameters and come back empty from the meta device.

    A fresh module of the same class computes them exactly as HF does for every rope type (and for
    every layer type, Gemma-3's local and global bases); its plain attributes (attention scaling per
    type) are copied too.
    """
    with torch.device("cpu"):
        fresh = type(rotary)(config=rotary.config)
    for name, buf in fresh.named_buffers(recurse=False):
        setattr(rotary, name, buf.to(device))
    for name, value in vars(fresh).items():
        if not name.startswith("_") and isinstance(value, (int, float, str, dict, list, tuple)):
            setattr(rotary, name, value)


def reset_scalar_buffers(model: nn.Module) -> None:
    """Refill non-persistent scalar buffers that mirror a Python attribute `scalar_<name>` (Gemma's
    embedding scale), which `to_empty` left as garbage and no checkpoint holds."""
    for module in model.modules():
        for name in getattr(module, "_non_persistent_buffers_set", ()):
            value = getattr(module, f"scalar_{name}", None)
            buf = getattr(module, name, None)
            if isinstance(value, (int, float)) and buf is not None and not buf.is_meta:
                buf.fill_(value)


def init_rule(name: str, config) -> tuple[str, float]:
    """How HF initialises a parameter: ("ones"|"zeros"|"normal", std). Used to fill local shards."""
    std = getattr(config, "initializer_range", 0.02)
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if owner.endswith("norm") or "layernorm" in owner:
        return "ones", 0.0
    if leaf == "bias" and owner == "router":  # gpt-oss draws its router bias like a weight
        return "normal", std
    if leaf == "bias" or leaf.endswith("_bias"):  # linear biases, gpt-oss's expert biases
        return "zeros", 0.0
    return "normal", std


def padding_row(name: str, config) -> int | None:
    """The embedding row HF zeroes at init (`pad_token_id`), if this parameter is the embedding."""
    if name.endswith("embed_tokens.weight"):
        pad = getattr(config, "pad_token_id", None)
        return pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None
    return None
