"""What the experts add to an estimate: their state, the activations of routed tokens, the all-to-alls.

One assumption runs through it: **uniform routing**. Every rank sends T*K rows per MoE layer (its
tokens times top-k, a routing-independent count) and, under uniform routing, receives T*K back. A
skewed router moves memory and all-to-all bytes between ranks; the totals over the expert-parallel
group stay what is printed here (the tests compare exactly those totals).

Activations are measured, not written down: meshkit's own `MoE` layer, with the model's expert count,
top-k and options, runs on small real tensors (its routing is data-dependent, which a fake-tensor
trace cannot follow), and the saved bytes are identified as an exact linear function of tokens x
(hidden, expert width, shared-expert width, 1). That identification is checked at a further shape;
a layer whose saved bytes stop being linear raises instead of extrapolating.

Stacks may mix dense and MoE blocks (DeepSeek-V3's first dense layers, Qwen2-MoE's `mlp_only_layers`):
`block_kinds` says which block is which, and each kind is built, traced and measured on its own
uniform config (`kind_config`), which the rest of the estimator sums over the blocks a rank holds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import transformers
from torch import nn

from meshkit._compat import storage_key
from meshkit.estimate.spec import DTYPES, config_from_key, config_key
from meshkit.estimate.trace import Recorder, by_part, recording
from meshkit.expert_parallel.moe import MoE
from meshkit.models import llama
from meshkit.models.moe import MoESpec, convert_moe_blocks, moe_spec, uniform_config

MOE_PARTS = {"gate": "router", "experts": "experts", "shared_expert": "shared_expert"}
DEFAULT_PART = "dispatch_combine"  # ops of MoE.forward itself: scores, top-k, gather, scatter-add


KINDS = ("dense", "moe")  # the block kinds a stack may mix, in the order reports list them


def model_experts(config: Any) -> MoESpec | None:
    """The config's experts, or None when no decoder block is MoE (a dense model, or a dense-kind
    config from `kind_config`)."""
    spec = moe_spec(config)
    return spec if spec is not None and spec.layers else None


def block_kinds(config: Any) -> tuple[str, ...]:
    """The kind of every decoder block, "dense" or "moe", in order: what a stack is summed over.

    Published MoE stacks mix them (DeepSeek-V3's first dense layers, Qwen2-MoE's `mlp_only_layers`
    and `decoder_sparse_step`); each kind is estimated on its own uniform config (`kind_config`)."""
    spec = model_experts(config)
    layers = set(spec.layers) if spec is not None else set()
    return tuple("moe" if i in layers else "dense" for i in range(config.num_hidden_layers))


@functools.lru_cache(maxsize=32)
def _kind_config(config_json: str, kind: str) -> Any:
    return uniform_config(config_from_key(config_json), kind == "moe")


def kind_config(config: Any, kind: str) -> Any:
    """The config of a stack made only of `kind` blocks (the config itself when it already is one):
    one-block models built from it have block 0 of that kind, every other field as published."""
    if kind not in KINDS:
        raise ValueError(f"block kind {kind!r}: must be one of {KINDS}")
    kinds = set(block_kinds(config))
    if kinds == {kind}:
        return config
    if kind not in kinds:
        raise ValueError(f"{getattr(config, 'model_type', '?')}: no {kind} block in this stack")
    return _kind_config(config_key(config), kind)


# ------------------------------------------------------------------------------ the layer itself


@functools.lru_cache(maxsize=16)
def _layer_options(config_json: str) -> dict[str, Any]:
    """The options meshkit's converter gives this model's MoE layers, read off a converted meta model."""
    cfg = config_from_key(config_json)
    cfg.num_hidden_layers = 1
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    convert_moe_blocks(model)
    moe = llama.moe_modules(llama.parts(model))[0]
    shared = moe.shared_expert.gate_proj.out_features if moe.shared_expert is not None else 0
    return dict(num_experts=moe.num_experts, top_k=moe.top_k, score_func=moe.score_func,
                normalize_topk=moe.normalize_topk, route_scale=moe.route_scale, capacity_factor=moe.capacity_factor,
                aux_loss_coef=moe.aux_loss_coef, z_loss_coef=moe.z_loss_coef, bias_update_rate=moe.bias_update_rate,
                keep_router_stats=moe.keep_router_stats, intermediate_size=moe.intermediate_size,
                shared_intermediate_size=shared)


def layer_options(config: Any) -> dict[str, Any]:
    """Expert count, top-k, expert and shared-expert widths and balancing options of the MoE layers."""
    return _layer_options(config_key(kind_config(config, "moe")))


def _measure(options: dict[str, Any], tokens: int, hidden: int, inter: int, shared: int,
             dtype: str) -> dict[str, int]:
    """Bytes one forward of a real small `MoE` keeps for backward, by "mode/part" (parameters
    excluded): mode "none" counts what autograd saves, "selective" what meshkit's policy keeps."""
    opts = {k: v for k, v in options.items() if k not in ("intermediate_size", "shared_intermediate_size",
                                                          "keep_router_stats", "num_experts", "top_k")}
    torch.manual_seed(0)
    layer = MoE(hidden, inter, options["num_experts"], options["top_k"], shared_intermediate_size=shared,
                expert_backend="loop", dtype=DTYPES[dtype], **opts)
    layer.keep_router_stats = options["keep_router_stats"]
    recorder = Recorder({storage_key(p) for p in layer.parameters()})
    module_parts: dict[nn.Module, str] = {getattr(layer, name): part for name, part in MOE_PARTS.items()
                                          if getattr(layer, name, None) is not None}
    x = torch.randn(tokens, hidden, dtype=DTYPES[dtype], requires_grad=True)
    with recording(recorder, module_parts, DEFAULT_PART):
        out = layer(x)
    layer.router_stats = None
    del out
    return {f"{mode}/{part}": n for mode, entries in (("none", recorder.saved), ("selective", recorder.cached))
            for part, n in by_part(entries, set()).items()}


@dataclass(frozen=True)
class LayerBytes:
    """Bytes one MoE layer keeps, by part: `per_token[part] * tokens + fixed[part]` (exact fractions)."""

    per_token: dict[str, Fraction]
    fixed: dict[str, Fraction]

    def at(self, tokens: int) -> dict[str, int]:
        """Bytes by part for `tokens` tokens on this rank."""
        return {p: int(self.per_token[p] * tokens + self.fixed[p]) for p in self.per_token}


@functools.lru_cache(maxsize=64)
def _identify(config_json: str, hidden: int, dtype: str) -> LayerBytes:
    options = _layer_options(config_json)
    dims = {"hidden": (48, 80), "inter": (40, 72)}
    if options["shared_intermediate_size"]:
        dims["shared"] = (24, 56)
    base = {name: pair[0] for name, pair in dims.items()}
    t0, t1 = 24, 40

    def run(tokens: int, **point: int) -> dict[str, int]:
        p = {**base, **point}
        return _measure(options, tokens, p["hidden"], p["inter"], p.get("shared", 0), dtype)

    def per_token(**point: int) -> dict[str, Fraction]:
        a, b = run(t0, **point), run(t1, **point)
        return {k: Fraction(b.get(k, 0) - a.get(k, 0), t1 - t0) for k in set(a) | set(b)}

    at_base = per_token()
    slopes = {name: {k: (per_token(**{name: hi}).get(k, 0) - at_base.get(k, 0)) / (hi - lo) for k in at_base}
              for name, (lo, hi) in dims.items()}
    first = run(t0)
    fixed = {k: first.get(k, 0) - at_base[k] * t0 for k in at_base}

    def predict(tokens: int, point: dict[str, int]) -> dict[str, Fraction]:
        return {k: (at_base[k] + sum(slopes[n][k] * (point[n] - base[n]) for n in dims)) * tokens + fixed[k]
                for k in at_base}

    check = {name: hi + 8 for name, (_, hi) in dims.items()}
    measured = run(56, **check)
    expected = predict(56, check)
    if any(measured.get(k, 0) != expected[k] for k in expected) or set(measured) - set(expected):
        raise RuntimeError(f"meshkit.estimate: the MoE layer's saved bytes are not linear in its shapes "
                           f"({measured} measured vs {expected} identified); the estimator cannot extrapolate them")
    real = {"hidden": hidden, "inter": options["intermediate_size"], "shared": options["shared_intermediate_size"]}
    per = {k: at_base[k] + sum(slopes[n][k] * (real[n] - base[n]) for n in dims) for k in at_base}
    return LayerBytes(per, fixed)


def layer_activations(config: Any, tokens: int, dtype: str, ac: str) -> dict[str, int]:
    """Bytes one MoE layer keeps for `tokens` tokens on this rank (AC none or selective), by part."""
    if ac == "full":
        return {}
    identified = _identify(config_key(kind_config(config, "moe")), config.hidden_size, dtype)
    prefix = ac + "/"
    return {k[len(prefix):]: n for k, n in identified.at(tokens).items() if k.startswith(prefix) and n}
