"""What the experts add to an estimate: their state, the activations of routed tokens, the all-to-alls.

One assumption runs through it: **uniform routing**. Every rank sends T*K rows per MoE layer (its
tokens times top-k, a routing-independent count) and, under uniform routing, receives T*K back. A
skewed router moves memory and all-to-all bytes between ranks; the totals over the expert-parallel
group stay what is printed here (the tests compare exactly those totals).

Activations are measured, not written down: meshkit's own `MoE` layer, with the model's top-k and
options, runs on small real tensors (its routing is data-dependent, which a fake-tensor trace cannot
follow), and the saved bytes are identified as an exact linear function of tokens x (hidden, expert
width, expert count, shared-expert width, 1) plus a fixed part linear in the same shapes. The layer
that runs is a proxy with a handful of experts (top-k + 1 to top-k + 11), never the model's 256:
the loop backend costs one matmul per expert. The identification is checked at a further shape; a
layer whose saved bytes stop being linear raises instead of extrapolating. About a dozen runs of
milliseconds each, once per process and layer options (a second estimate reuses them).

Stacks may mix dense and MoE blocks (DeepSeek-V3's first dense layers, Qwen2-MoE's `mlp_only_layers`):
`block_kinds` says which block is which, and each kind is built, traced and measured on its own
uniform config (`kind_config`), which the rest of the estimator sums over the blocks a rank holds.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import transformers
from torch import nn
from tqdm import tqdm

from meshkit._compat.subclasses import storage_key
from meshkit.estimate.spec import config_from_key, config_key
from meshkit.estimate.trace import Recorder, by_part, recording
from meshkit.expert_parallel.moe import MoE
from meshkit.models import llama
from meshkit.models.moe import MoESpec, convert_moe_blocks, moe_spec, uniform_config
from meshkit.plan import DTYPES

MOE_PARTS = {"gate": "router", "experts": "experts", "shared_expert": "shared_expert"}
DEFAULT_PART = "dispatch_combine"  # ops of MoE.forward itself: scores, top-k, gather, scatter-add


KINDS = ("dense", "moe")  # the block kinds a stack may mix, in the order reports list them


# Per config (by `config_key`): a plan search asks for a config's experts and block kinds ~10^5 times,
# and every read of a transformers 5 config attribute goes through two Python __getattribute__ layers.
_STACKS: dict[str, tuple[MoESpec | None, tuple[str, ...]]] = {}


def _stack(config: Any) -> tuple[MoESpec | None, tuple[str, ...]]:
    key = config_key(config)
    hit = _STACKS.get(key)
    if hit is None:
        spec = moe_spec(config)
        spec = spec if spec is not None and spec.layers else None
        layers = set(spec.layers) if spec is not None else set()
        hit = (spec, tuple("moe" if i in layers else "dense" for i in range(config.num_hidden_layers)))
        if len(_STACKS) >= 256:
            _STACKS.clear()
        _STACKS[key] = hit
    return hit


def model_experts(config: Any) -> MoESpec | None:
    """The config's experts, or None when no decoder block is MoE (a dense model, or a dense-kind
    config from `kind_config`)."""
    return _stack(config)[0]


def block_kinds(config: Any) -> tuple[str, ...]:
    """The kind of every decoder block, "dense" or "moe", in order: what a stack is summed over.

    Published MoE stacks mix them (DeepSeek-V3's first dense layers, Qwen2-MoE's `mlp_only_layers`
    and `decoder_sparse_step`); each kind is estimated on its own uniform config (`kind_config`)."""
    return _stack(config)[1]


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
def _layer_options(config_json: str) -> tuple[tuple[str, Any], ...]:
    """The options meshkit's converter gives this model's MoE layers, read off a converted meta model
    (sorted items: hashable, so measurements cache by options, not by config)."""
    cfg = config_from_key(config_json)
    cfg.num_hidden_layers = 1
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    convert_moe_blocks(model)
    moe = llama.moe_modules(llama.parts(model))[0]
    shared = moe.shared_expert.gate_proj.out_features if moe.shared_expert is not None else 0
    # Everything that changes what the layer saves: routing and balancing options, the router's bias,
    # Qwen2-MoE's shared-expert gate, gpt-oss's expert layout, biases and clamped activation. Group-limited
    # routing and the selection bias choose experts under no_grad and save nothing: left out, so the
    # proxy's expert count need not divide into groups.
    return tuple(sorted(dict(
        num_experts=moe.num_experts, top_k=moe.top_k, score_func=moe.score_func,
        normalize_topk=moe.normalize_topk, route_scale=moe.route_scale, capacity_factor=moe.capacity_factor,
        aux_loss_coef=moe.aux_loss_coef, z_loss_coef=moe.z_loss_coef, bias_update_rate=moe.bias_update_rate,
        keep_router_stats=moe.keep_router_stats, intermediate_size=moe.intermediate_size,
        shared_intermediate_size=shared, router_bias=moe.gate.bias is not None,
        shared_expert_gate=moe.shared_expert_gate is not None, expert_layout=moe.experts.layout,
        expert_biases=moe.experts.gate_up_proj_bias is not None, expert_activation=moe.experts.activation).items()))


def layer_options(config: Any) -> dict[str, Any]:
    """Expert count, top-k, expert and shared-expert widths and balancing options of the MoE layers."""
    return dict(_layer_options(config_key(kind_config(config, "moe"))))


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run the small measurements on one intra-op thread.

    Their matmuls are a few dozen rows wide: a second OpenMP thread buys nothing, and on a loaded
    machine every parallel region waits for a descheduled thread (milliseconds per op, 100x slower).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _measure(options: dict[str, Any], tokens: int, hidden: int, inter: int, shared: int, experts: int,
             dtype: str) -> dict[str, int]:
    """Bytes one forward of a real small `MoE` keeps for backward, by "mode/part" (parameters
    excluded): mode "none" counts what autograd saves, "selective" what meshkit's policy keeps."""
    opts = {k: v for k, v in options.items() if k not in ("intermediate_size", "shared_intermediate_size",
                                                          "keep_router_stats", "num_experts", "top_k")}
    torch.manual_seed(0)
    layer = MoE(hidden, inter, experts, options["top_k"], shared_intermediate_size=shared,
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


# The proxy layer's shapes: two values per dimension to identify its slope, and one point past all
# of them to check the identification. Few experts: the loop backend runs one matmul per expert.
_TOKENS = (24, 40)
_CHECK_TOKENS = 56


def _proxy_dims(options: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The dimensions the saved bytes are identified along, each with its two proxy values: the
    expert count starts just above top-k (every expert a real choice), never at the model's count."""
    k = options["top_k"]
    dims = {"hidden": (48, 80), "inter": (40, 72), "experts": (k + 1, k + 3)}
    if options["shared_intermediate_size"]:
        dims["shared"] = (24, 56)
    return dims


@functools.lru_cache(maxsize=64)
def _identify(options_items: tuple[tuple[str, Any], ...], hidden: int, dtype: str) -> LayerBytes:
    """Saved bytes of the model's MoE layer as an exact function of its shapes, measured on a proxy.

    A real layer of the model's expert count would cost one matmul per expert per run (256 for
    DeepSeek-V3), so a few-expert proxy with the model's top-k and options runs instead, and the
    bytes are identified as linear in tokens x (hidden, expert width, expert count, shared width,
    1), plus a fixed part linear in the same shapes. One run past every identified value checks
    that; a layer that is not linear raises rather than extrapolating. Cached per process by the
    layer's options: models sharing them share the measurement.
    """
    options = dict(options_items)
    dims = _proxy_dims(options)
    base = {name: pair[0] for name, pair in dims.items()}
    check = {name: hi + 8 for name, (_, hi) in dims.items()}
    points = [(t, {}) for t in _TOKENS] + [(t, {n: hi}) for n, (_, hi) in dims.items() for t in _TOKENS]
    points.append((_CHECK_TOKENS, check))
    runs: dict[tuple[int, tuple[tuple[str, int], ...]], dict[str, int]] = {}
    with _one_thread(), tqdm(points, desc="meshkit.estimate: measuring the MoE layer", unit="run", delay=2,
                             leave=False, disable=None) as progress:
        for tokens, point in progress:
            p = {**base, **point}
            runs[tokens, tuple(sorted(point.items()))] = _measure(
                options, tokens, p["hidden"], p["inter"], p.get("shared", 0), p["experts"], dtype)

    def line(point: dict[str, int]) -> tuple[dict[str, Fraction], dict[str, Fraction]]:
        """(per-token, fixed) bytes at one proxy point, from its two token counts."""
        key = tuple(sorted(point.items()))
        a, b = runs[_TOKENS[0], key], runs[_TOKENS[1], key]
        slope = {k: Fraction(b.get(k, 0) - a.get(k, 0), _TOKENS[1] - _TOKENS[0]) for k in keys}
        return slope, {k: a.get(k, 0) - slope[k] * _TOKENS[0] for k in slope}

    keys = list(dict.fromkeys(k for run in runs.values() for k in run))  # parts in the order they ran
    per0, fixed0 = line({})
    lines = {n: line({n: hi}) for n, (_, hi) in dims.items()}

    def coefficient(at_base: dict[str, Fraction], at_hi: dict[str, Fraction], name: str) -> dict[str, Fraction]:
        lo, hi = dims[name]
        return {k: (at_hi[k] - at_base[k]) / (hi - lo) for k in keys}

    per_slope = {n: coefficient(per0, lines[n][0], n) for n in dims}
    fixed_slope = {n: coefficient(fixed0, lines[n][1], n) for n in dims}

    def at(point: dict[str, int]) -> LayerBytes:
        delta = {n: point[n] - base[n] for n in dims}
        return LayerBytes({k: per0[k] + sum(per_slope[n][k] * delta[n] for n in dims) for k in keys},
                          {k: fixed0[k] + sum(fixed_slope[n][k] * delta[n] for n in dims) for k in keys})

    measured = runs[_CHECK_TOKENS, tuple(sorted(check.items()))]
    expected = at(check)
    predicted = {k: expected.per_token[k] * _CHECK_TOKENS + expected.fixed[k] for k in keys}
    if any(measured.get(k, 0) != predicted[k] for k in keys):
        raise RuntimeError(f"meshkit.estimate: the MoE layer's saved bytes are not linear in its shapes "
                           f"({measured} measured vs {predicted} identified); the estimator cannot extrapolate them")
    return at({"hidden": hidden, "inter": options["intermediate_size"], "experts": options["num_experts"],
               "shared": options["shared_intermediate_size"]})


def layer_activations(config: Any, tokens: int, dtype: str, ac: str) -> dict[str, int]:
    """Bytes one MoE layer keeps for `tokens` tokens on this rank (AC none or selective), by part."""
    if ac == "full":
        return {}
    identified = _identify(_layer_options(config_key(kind_config(config, "moe"))), config.hidden_size, dtype)
    prefix = ac + "/"
    return {k[len(prefix):]: n for k, n in identified.at(tokens).items() if k.startswith(prefix) and n}


def combine_backward_bytes(config: Any, tokens: int) -> int:
    """Bytes the backward of `dispatch.combine`'s weighted sum holds beyond the MoE layer's saved tensors,
    for `tokens` tokens on this rank: two fp32 [rows, hidden] buffers, where rows are the assignments the
    rank's experts compute (T·K under uniform routing, fewer where a capacity drops some).

    The sum is `index_add(y.float() * w)`: its backward gives the product's gradient per assignment
    (an index_select of the output's gradient, in the place of the product index_add saved, whose
    size the saved bytes already count), then the mul's backward makes the gradient of `y.float()`
    (grad * w) and the weights' gradient before its sum over hidden (grad * y), both [rows, hidden]
    fp32 beside it. Measured by the dry run: DeepSeek-V3's middle pipeline rank held the three at once.
    """
    options = layer_options(config)
    experts, rows = options["num_experts"], tokens * options["top_k"]
    if options["capacity_factor"] is not None:  # each expert keeps at most ceil(cf·T·K/E) of this rank's
        rows = min(rows, experts * math.ceil(options["capacity_factor"] * rows / experts))
    return 2 * rows * config.hidden_size * 4
