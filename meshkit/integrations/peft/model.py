"""A PEFT model as meshkit sees it: its one LoRA adapter, what a plan must meet, PEFT's initialisation.

`parallelize` accepts a `PeftModel` whose adapter is LoRA: structure is read from the HF causal LM
it wraps (`llama.causal_lm`), names from the PeftModel itself. `problems` lists, before any
collective and identically on every rank, what the model and plan rule out, each with its fix: other
PEFT methods and LoRA variants, adapters on layers meshkit computes itself (the MoE layer, the
vocabulary-parallel embedding and head) or shards in a way the adapter cannot follow (rows selected
per rank), targets that match nothing, a rank larger than the layer. `init_tensor` draws an adapter
tensor as PEFT's `reset_lora_parameters` does, from (seed, name) like every meshkit init.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from meshkit.integrations.peft.layers import adapter, base_layer, lora_layers
from meshkit.models import llama, roles
from meshkit.models import moe as moe_models

# The roles whose sharding an adapter follows (tensor_parallel.lora); kv_colwise only when tp splits
# the K/V heads (otherwise each rank selects rows of a replicated weight).
FOLLOWED_ROLES = ("colwise", "kv_colwise", "rowwise")
INITS = (True, False, "gaussian")  # what meshkit draws itself (meta-device models); others need real weights


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a PEFT `PeftModel` (duck-typed: peft is not imported by meshkit)."""
    return callable(getattr(model, "get_base_model", None)) and isinstance(getattr(model, "peft_config", None), dict)


def lora_config(model: nn.Module) -> Any:
    """The PEFT config of the model's one adapter."""
    (config,) = model.peft_config.values()
    return config


def _method_problems(model: nn.Module, tp: int) -> list[str]:
    configs = model.peft_config
    if len(configs) != 1:
        return [f"PeftModel adapters={sorted(configs)}: meshkit trains one adapter per model; fix: "
                "get_peft_model with one LoraConfig (delete_adapter the others)"]
    (name, config), = configs.items()
    kind = getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None))
    if kind != "LORA":
        return [f"peft_config[{name!r}].peft_type={kind}: meshkit runs LoRA adapters only (prompt/prefix tuning "
                "change the inputs and the KV cache, IA3 and the other methods rescale activations, none of which "
                "the sharded blocks know); fix: peft.LoraConfig"]
    problems = []
    if getattr(config, "use_dora", False):
        problems.append("LoraConfig.use_dora=True: DoRA rescales every output row of W + BA by its norm over all "
                        "input features, which a row-parallel base splits over tp and FSDP/pipeline ranks hold in "
                        "pieces, and its magnitude is computed from the base weights at get_peft_model time; "
                        "meshkit does not support it; fix: use_dora=False (plain LoRA)")
    unsupported = {"target_parameters": "PEFT's ParamWrapper on raw parameters (fused MoE experts)",
                   "modules_to_save": "trainable full copies of whole modules",
                   "trainable_token_indices": "trainable embedding rows",
                   "layer_replication": "repeated decoder layers"}
    for field, what in unsupported.items():
        if getattr(config, field, None):
            problems.append(f"LoraConfig.{field}={getattr(config, field)!r}: {what} is not supported by meshkit; "
                            f"fix: {field}=None and target_modules naming attention and dense-MLP linears (PEFT's "
                            "'all-linear' adds an MoE model's experts as target_parameters by itself)")
    if tp > 1 and getattr(config, "lora_dropout", 0.0) > 0:
        problems.append(f"LoraConfig.lora_dropout={config.lora_dropout} with tp={tp}: tp ranks would draw "
                        "different (or, seeded alike, repeated) dropout masks over one input; fix: lora_dropout=0.0, "
                        "or tp=1")
    return problems


def _layer_problems(model: nn.Module) -> list[str]:
    """Where each adapter sits (before MoE conversion, which would drop an adapter inside an MoE block)."""
    lm = llama.causal_lm(model)
    names = {id(m): n for n, m in lm.named_modules()}
    blocks = [names[id(b)] + "." for b in llama.parts(lm).blocks]
    sparse = [names[id(m)] + "." for m in moe_models.expert_computed_modules(lm)]
    problems, meta = [], False
    for name, layer in lora_layers(lm).items():
        if not any(name.startswith(p) for p in blocks):
            problems.append(f"LoRA on {name}: meshkit runs the embedding and the LM head itself (vocabulary-"
                            "parallel under tp, a tied weight split under pp), so an adapter there is not "
                            "supported; fix: leave it out of target_modules (or add it to exclude_modules)")
            continue
        if any(name.startswith(p) for p in sparse):
            problems.append(f"LoRA on {name}: meshkit's MoE layer computes the router, experts and shared experts "
                            "from their weights (grouped GEMMs over expert parallelism), so an adapter there would "
                            "be ignored; fix: target attention and dense-MLP linears only (e.g. target_modules="
                            "['q_proj', 'k_proj', 'v_proj', 'o_proj'])")
            continue
        if not isinstance(base_layer(layer), nn.Linear):
            problems.append(f"LoRA on {name} ({type(base_layer(layer)).__name__}): meshkit supports adapters on "
                            "nn.Linear layers; fix: leave it out of target_modules")
            continue
        parts = adapter(layer)
        meta = meta or parts.a.weight.is_meta
        r, base = parts.a.out_features, parts.base
        if r > min(base.in_features, base.out_features):
            problems.append(f"LoraConfig.r={r} on {name}: larger than min(in_features={base.in_features}, "
                            f"out_features={base.out_features}), so the update is not low-rank; fix: r <= "
                            f"{min(base.in_features, base.out_features)} (rank_pattern sets it per layer)")
    init = getattr(lora_config(model), "init_lora_weights", True)
    if meta and init not in INITS:
        problems.append(f"LoraConfig.init_lora_weights={init!r} on a meta-device model: that initialisation is "
                        f"computed from the base weights, which do not exist yet; fix: init_lora_weights in {INITS}, "
                        "or build the PeftModel on real weights")
    return problems


def tp_problems(model: nn.Module, tp: int) -> list[str]:
    """Whether each adapter can follow its base layer's tensor-parallel split (after MoE conversion:
    the roles of a converted block are read without its experts)."""
    if tp <= 1:
        return []
    lm = llama.causal_lm(model)
    names = {id(m): n for n, m in lm.named_modules()}
    problems = []
    for block in llama.parts(lm).blocks:
        block_roles = roles.block_roles(block, lm.config)
        for inner, layer in lora_layers(block).items():
            problems += _tp_problems(f"{names[id(block)]}.{inner}", block_roles.get(inner), layer, lm.config, tp)
    return problems


def _tp_problems(name: str, role: str | None, layer: nn.Module, config: Any, tp: int) -> list[str]:
    follows = role in FOLLOWED_ROLES and (role != "kv_colwise" or roles.kv_rows(config, tp, 0) is None)
    if not follows:
        how = "is not split by tensor parallelism" if role is None else f"is a {role!r} layer under tp={tp}"
        return [f"LoRA on {name}: the layer {how}; an adapter follows only plain column- or row-parallel layers "
                "(not rows selected per rank: packed projections, K/V heads replicated when tp exceeds them); "
                f"fix: leave it out of target_modules, or a tp that splits it evenly"]
    if role == "rowwise" and adapter(layer).b.bias is not None:
        return [f"LoraConfig.lora_bias=True on {name} (row-parallel under tp={tp}): B is replicated and its "
                "output summed over tp, which would add the bias tp times; fix: lora_bias=False, or tp=1"]
    return []


def _target_problems(model: nn.Module) -> list[str]:
    """Each entry of a list of target modules must name some layer (PEFT only checks that one does)."""
    targets = getattr(lora_config(model), "target_modules", None)
    if not isinstance(targets, (set, list, tuple)):
        return []  # a regular expression or "all-linear": PEFT matched at least one layer
    names = list(lora_layers(llama.causal_lm(model)))
    unmatched = sorted(t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names))
    if not unmatched:
        return []
    leaves = sorted({n.rsplit(".", 1)[-1] for n, m in llama.causal_lm(model).named_modules()
                     if isinstance(m, nn.Linear) and ".lora_" not in n and not n.endswith("base_layer")})
    return [f"LoraConfig.target_modules: {unmatched} match(es) no layer of the model; fix: target among {leaves}"]


def adapter_problems(model: nn.Module, tp: int) -> list[str]:
    """What the PEFT model (and a tp degree's dropout rule) rules out, each with its fix (pure: every rank
    alike); `tp_problems` adds the tensor-parallel layout's once MoE blocks are converted."""
    found = _method_problems(model, tp)
    return found or _target_problems(model) + _layer_problems(model)


def adapter_dims(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{adapter parameter name, as `model` names it: (in_features, r) of its layer}: what its init needs."""
    out = {}
    for name, layer in lora_layers(model).items():
        parts = adapter(layer)
        for module, kind in ((parts.a, "lora_A"), (parts.b, "lora_B")):
            for leaf, _ in module.named_parameters():
                out[f"{name}.{kind}.{parts.name}.{leaf}"] = (parts.a.in_features, parts.a.out_features)
    return out


def init_tensor(name: str, shape: torch.Size, in_features: int, r: int, init: Any,
                generator: torch.Generator) -> torch.Tensor:
    """An adapter tensor drawn as PEFT's `reset_lora_parameters` draws it: A kaiming-uniform (bound
    1/sqrt(in), nn.Linear's default) or normal(0, 1/r) for "gaussian", B zeros; with
    `init_lora_weights=False` both keep nn.Linear's default (B's bound 1/sqrt(r)), so B starts non-zero."""
    is_b = ".lora_B." in name
    fan_in = r if is_b else in_features
    if init is False or not is_b:
        if init == "gaussian":
            return torch.randn(shape, generator=generator) / r
        bound = 1.0 / math.sqrt(fan_in)
        return (torch.rand(shape, generator=generator) * 2 - 1) * bound
    return torch.zeros(shape)


# ------------------------------------------------------------------------------- the estimator's view

LORA_KEY = "meshkit_lora"  # config attribute: {"r": ..., "target_modules": [...]}, what the estimator models


def with_lora(config: Any, r: int, target_modules: list[str] | str) -> Any:
    """A copy of `config` that tells the estimator (`meshkit.estimate`) the model trains a LoRA adapter
    of rank `r` on `target_modules` with everything else frozen (PEFT's `get_peft_model`)."""
    out = copy.deepcopy(config)
    setattr(out, LORA_KEY, {"r": int(r), "target_modules": target_modules if isinstance(target_modules, str)
                            else sorted(target_modules)})
    return out


def estimate_config(model: nn.Module) -> Any:
    """The config the estimator reads for a PEFT model: its HF config with its LoRA settings."""
    config = lora_config(model)
    return with_lora(llama.causal_lm(model).config, config.r, config.target_modules)


def lora_of(config: Any) -> dict | None:
    """The LoRA settings a config carries for the estimator (`with_lora`), or None (full fine-tuning)."""
    return getattr(config, LORA_KEY, None) or None


def wrap(model: nn.Module, config: Any) -> nn.Module:
    """`model` (an HF causal LM, e.g. a one-block meta model the estimator builds) as the PeftModel of
    the LoRA settings `config` carries; the model itself when it carries none."""
    settings = lora_of(config)
    if settings is None:
        return model
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=settings["r"], target_modules=settings["target_modules"]))
