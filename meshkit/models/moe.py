"""Mixture-of-experts models as meshkit sees them: HF sparse blocks become `meshkit.MoE`, in place.

Like `llama.py`, this is a module that knows Hugging Face names; the rest of meshkit only ever sees
`MoE` layers. Two kinds of model qualify:

- **HF MoE models** (`mixtral`, `qwen3_moe`, `qwen2_moe`, `olmoe`, `deepseek_v3`, `gpt_oss`): each decoder block's `mlp` is a
  sparse block with a `gate` router ([E, H] weight) and fused `experts` (`gate_up_proj` [E, 2I, H],
  `down_proj` [E, H, I]; Qwen2/3-MoE keep dense MLPs in `mlp_only_layers`; Qwen2-MoE adds a
  `shared_expert` scaled by sigmoid(`shared_expert_gate`), which `MoE` has as options). `convert_moe_blocks`
  replaces each sparse block with an `MoE` that holds *the same Parameter objects* (no copy, works on
  the meta device) under the same names, so `model.state_dict()` keeps exactly HF's keys, shapes and
  dtypes and checkpoints load and save with HF's own code. gpt-oss's block (`router` with a bias,
  experts stored transposed with gate/up interleaved, biased, with a clamped SwiGLU) is read from
  what its experts class declares (`is_transposed`, `is_concatenated`, `has_bias`) and the
  config's `swiglu_alpha` / `swiglu_limit`, through `expert_parallel.expert_variants`.
- **Llama-MoE** (meshkit's debug model): a Llama-family config carrying a `meshkit_moe` dict (e.g.
  `{"num_experts": 8, "top_k": 2}`); `llama_moe` (or `convert_moe_blocks`, which reads the dict)
  swaps every dense MLP for an `MoE`. The dict travels in `config.json`, so a saved model says how to
  rebuild itself.

Why conversion is lossless: HF routes with softmax over fp32 probabilities, top-k, then renormalises
(Mixtral always, Qwen2/3-MoE and OLMoE when `norm_topk_prob`); `MoE` does the same with `score_func="softmax"`
and `normalize_topk` from the config. HF computes the router logits in the model dtype and meshkit in
fp32: identical for fp32 models, a documented difference for bf16 ones.

Why the auxiliary loss needs care: HF adds `router_aux_loss_coef * load_balancing_loss` to the loss
only when `output_router_logits` is true, and its loss pools counts and probabilities over *all*
layers before the product, which no per-layer loss reproduces. So a converted layer attaches no loss
of its own; it keeps its router statistics (`keep_router_stats`) exactly when the config asks for the
loss, and `hf_aux_loss(model)` turns them into HF's term, this rank's share of the global batch's,
for the training loop to add. A converted model called through HF's own `forward` still yields HF's
loss: a forward hook feeds HF's output collector the router logits its loss function expects.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshkit.expert_parallel import (
    ClampedSwiGLU,
    ExpertLayout,
    MoE,
    expert_split_problem,
    hf_load_balancing_loss,
    moe_layers,
    pop_router_stats,
)

__all__ = [
    "MoESpec",
    "convert_moe_blocks",
    "hf_aux_loss",
    "init_moe_buffers",
    "is_moe_model",
    "llama_moe",
    "moe_layers",
    "moe_spec",
    "plan_problems",
    "to_hf_state_dict",
    "uniform_config",
]

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")
LLAMA_MOE_KEY = "meshkit_moe"  # config attribute that turns a Llama-family model into a Llama-MoE


@dataclass(frozen=True)
class _BlockFormat:
    """How one HF sparse-block class maps onto `MoE`: where E lives in the config, which flag
    renormalises the top-k weights (None: always), and the submodule names of its shared expert and
    of that expert's sigmoid gate (None: it has none)."""

    experts_field: str
    norm_field: str | None
    shared: str | None = None
    shared_gate: str | None = None
    score_func: str = "softmax"
    # DeepSeek-V3: the config fields of the routed scaling factor and of group-limited routing
    # (n_group, topk_group), and the router's persistent selection-bias buffer.
    scale_field: str | None = None
    group_fields: tuple[str, str] | None = None
    bias_in_gate: bool = False
    # gpt-oss: the router's HF name, and the config fields of the clamped SwiGLU (alpha, limit); the
    # experts' layout and biases are read from the experts class itself.
    router: str = "gate"
    clamped_swiglu: tuple[str, str] | None = None
    # gpt-oss's block returns (hidden states, router scores), which its decoder layer unpacks.
    returns_pair: bool = False


_HF_BLOCKS: dict[str, _BlockFormat] = {
    "MixtralSparseMoeBlock": _BlockFormat("num_local_experts", None),
    "Qwen3MoeSparseMoeBlock": _BlockFormat("num_experts", "norm_topk_prob"),
    "Qwen2MoeSparseMoeBlock": _BlockFormat("num_experts", "norm_topk_prob", "shared_expert", "shared_expert_gate"),
    "OlmoeSparseMoeBlock": _BlockFormat("num_experts", "norm_topk_prob"),
    "DeepseekV3MoE": _BlockFormat("n_routed_experts", "norm_topk_prob", "shared_experts", score_func="sigmoid",
                                  scale_field="routed_scaling_factor", group_fields=("n_group", "topk_group"),
                                  bias_in_gate=True),
    "GptOssMLP": _BlockFormat("num_local_experts", None, router="router",
                              clamped_swiglu=("swiglu_alpha", "swiglu_limit"), returns_pair=True),
}
# Options a caller may set on converted layers; anything else would change what the layer computes
# in ways HF's weights know nothing about (shared experts, sigmoid scores).
_CONVERT_OPTIONS = ("capacity_factor", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "expert_backend")


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
    return any(isinstance(m, MoE) or type(m).__name__ in _HF_BLOCKS for m in model.modules())


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
    unknown = sorted(set(options) - set(_CONVERT_OPTIONS))
    if unknown:
        raise ValueError(f"convert_moe_blocks: unknown option(s) {unknown}; known: {list(_CONVERT_OPTIONS)}")
    config = getattr(model, "config", None)
    llama_options = getattr(config, LLAMA_MOE_KEY, None)
    if llama_options and not any(type(m).__name__ in _HF_BLOCKS for m in model.modules()):
        return llama_moe(model, **{**_llama_moe_options(llama_options), **options})
    for block in _decoder_blocks(model):
        mlp = getattr(block, "mlp", None)
        if mlp is not None and type(mlp).__name__ in _HF_BLOCKS:
            block.mlp = _convert_hf_block(mlp, config, **options)
    return moe_layers(model)


def _decoder_blocks(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: not a decoder-only causal LM meshkit knows")
    return list(layers)


def _check_hf_config(config: Any) -> None:
    problems = []
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config.hidden_act!r}: meshkit experts are SwiGLU; fix: use a silu model")
    if getattr(config, "router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise={config.router_jitter_noise}: meshkit's router adds no noise; "
                        "fix: set config.router_jitter_noise = 0.0 before converting")
    if problems:
        raise ValueError("cannot convert the MoE blocks losslessly:\n  - " + "\n  - ".join(problems))


def _convert_hf_block(block: nn.Module, config: Any, **options: Any) -> MoE:
    """One HF sparse block -> an `MoE` owning the block's own Parameters (no copy; meta stays meta)."""
    _check_hf_config(config)
    fmt = _HF_BLOCKS[type(block).__name__]
    experts_field, norm_field = fmt.experts_field, fmt.norm_field
    router = getattr(block, fmt.router)
    router_weight: nn.Parameter = router.weight
    router_bias = getattr(router, "bias", None)
    experts = block.experts
    gate_up, down = experts.gate_up_proj, experts.down_proj
    # transformers' experts decorator declares the storage: transposed ([E, in, out]) and, with
    # is_concatenated False, gate/up interleaved; has_bias adds `gate_up_proj_bias` / `down_proj_bias`.
    layout = ExpertLayout(transposed=bool(getattr(experts, "is_transposed", False)),
                          interleaved=not getattr(experts, "is_concatenated", True))
    biased = bool(getattr(experts, "has_bias", False))
    if (layout != ExpertLayout() or biased) and fmt.clamped_swiglu is None:
        raise ValueError(f"{type(block).__name__} stores {layout} experts (biases: {biased}), which this adapter "
                         f"does not map for this block class")
    num_experts, hidden = router_weight.shape
    if num_experts != getattr(config, experts_field):
        raise ValueError(f"{type(block).__name__}: router has {num_experts} experts, config.{experts_field}="
                         f"{getattr(config, experts_field)}")
    inter = down.shape[-2] if layout.transposed else down.shape[-1]
    activation = ClampedSwiGLU(*(float(getattr(config, f)) for f in fmt.clamped_swiglu)) if fmt.clamped_swiglu \
        else None
    shared = getattr(block, fmt.shared) if fmt.shared else None
    n_group, topk_group = (int(getattr(config, f) or 1) for f in fmt.group_fields) if fmt.group_fields else (1, 1)
    moe = MoE(hidden, inter, num_experts, config.num_experts_per_tok, score_func=fmt.score_func,
              route_scale=float(getattr(config, fmt.scale_field)) if fmt.scale_field else 1.0,
              n_group=n_group, topk_group=topk_group, bias_in_gate=fmt.bias_in_gate,
              shared_intermediate_size=0 if shared is None else shared.down_proj.in_features,
              shared_expert_gate=fmt.shared_gate is not None, shared_expert_name=fmt.shared or "shared_expert",
              normalize_topk=True if norm_field is None else bool(getattr(config, norm_field)),
              router_name=fmt.router, router_bias=router_bias is not None, expert_layout=layout,
              expert_biases=biased, **({} if activation is None else {"expert_activation": activation}),
              aux_loss_coef=options.get("aux_loss_coef", 0.0), z_loss_coef=options.get("z_loss_coef", 0.0),
              bias_update_rate=options.get("bias_update_rate", 0.0),
              capacity_factor=options.get("capacity_factor"), expert_backend=options.get("expert_backend", "auto"),
              init_std=getattr(config, "initializer_range", 0.02), device="meta", dtype=gate_up.dtype)
    # The block's own Parameters: GroupedExperts reads HF 5.x's fused layout as stored (the row
    # layout, or gpt-oss's transposed interleaved one), and optimizer/FSDP references stay valid.
    moe.gate.weight = router_weight
    if router_bias is not None:
        moe.gate.bias = router_bias
    moe.experts.gate_up_proj, moe.experts.down_proj = gate_up, down
    if biased:
        moe.experts.gate_up_proj_bias, moe.experts.down_proj_bias = experts.gate_up_proj_bias, experts.down_proj_bias
    if shared is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(moe.shared_expert, name).weight = getattr(shared, name).weight
    if fmt.shared_gate is not None:
        moe.shared_expert_gate.weight = getattr(block, fmt.shared_gate).weight
    if fmt.bias_in_gate:
        moe.gate.e_score_correction_bias = block.gate.e_score_correction_bias
    init_moe_buffers(moe, router_weight.device)
    moe.keep_router_stats = bool(getattr(config, "output_router_logits", False))
    moe.register_forward_hook(_feed_hf_router_logits)
    if fmt.returns_pair:
        moe.register_forward_hook(_as_hf_pair)
    return moe


def _as_hf_pair(moe: MoE, args: tuple, output: Tensor) -> tuple[Tensor, None]:
    """The block's output as the HF decoder layer unpacks it: `hidden, _ = self.mlp(hidden)`.

    A bare [B, S, H] tensor would unpack along the batch without an error (two rows for B = 2);
    the second item (HF's router scores) is discarded by the layer, so None stands in for it.
    """
    return output, None


@functools.cache
def _hf_collector_var() -> Any:
    """transformers' private context variable holding the active output collector (what
    `output_router_logits=True` fills), or None where transformers has none.

    transformers records router logits with forward hooks on its router class, which a converted
    model no longer has; this variable is the one place its loss function reads them back from.
    """
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - a transformers without it: HF's forward records no logits
        return None
    return _active_collector


def _feed_hf_router_logits(moe: MoE, args: tuple, output: Tensor) -> None:
    """Give HF's `load_balancing_loss_func` the router logits HF's router would have recorded.

    Only when HF's own forward collects them (meshkit's training path never does): one extra router
    matmul, in the model dtype as HF computes it.
    """
    var = _hf_collector_var()
    collected = None if var is None else var.get()
    if collected is None or "router_logits" not in collected:
        return
    x_TH = args[0].reshape(-1, moe.hidden_size)
    bias = None if moe.gate.bias is None else moe.gate.bias.to(x_TH.dtype)
    collected["router_logits"].append(F.linear(x_TH, moe.gate.weight.to(x_TH.dtype), bias))


def hf_aux_loss(model: nn.Module) -> Tensor | None:
    """HF's auxiliary term `router_aux_loss_coef * load_balancing_loss` of the last training forward.

    None unless the config asks for it (`output_router_logits`). This rank's share: counts are the
    global batch's (summed over each layer's `load_group`), probabilities this rank's, so the shares
    sum over the load group to HF's value on the global batch. Pops the stored statistics, so call
    it once per forward; add it to the loss before backward.
    """
    stats = pop_router_stats(model)
    config = getattr(model, "config", None)
    if not stats or not getattr(config, "output_router_logits", False):
        return None
    return getattr(config, "router_aux_loss_coef", 0.0) * hf_load_balancing_loss(stats)


def to_hf_state_dict(state_dict: dict[str, Tensor], config: Any) -> dict[str, Tensor]:
    """A converted HF model's state dict with exactly HF's keys (shapes and layout already are HF's).

    Converted names are HF's; the one thing to drop is meshkit-only state: DeepSeek-V3's
    `expert_bias` (only present with `bias_update_rate > 0`), for which these HF models have no
    slot. Llama-MoE state dicts are returned as they are: there is no HF class to map them to.
    """
    if _is_llama_moe(config) or getattr(config, "model_type", None) not in MOE_MODEL_TYPES:
        return dict(state_dict)
    return {k: v for k, v in state_dict.items() if not k.endswith(".expert_bias")}


def init_moe_buffers(module: nn.Module, device: torch.device | str | None = None, *, hf_buffers: bool = False) -> None:
    """Set the MoE balancing buffers (DeepSeek-V3 `expert_bias`, its load counts) to their initial zeros.

    For meta-device models: after `to_empty` they hold garbage, and no HF init knows them (they are
    not HF's), so whoever initialises parameters calls this too; a checkpoint's `expert_bias`, if any,
    loads afterwards. Buffers still on meta are replaced on `device` (left alone without one).
    `hf_buffers` zeroes HF's own `gate.e_score_correction_bias` too (HF initialises it to zeros), for
    a fresh initialisation; conversion leaves it alone, since it may hold a loaded checkpoint's bias.
    """
    for moe in [module] if isinstance(module, MoE) else moe_layers(module):
        owned = [(moe, "expert_bias", torch.float32), (moe, "load_counts_E", torch.int64)]
        if hf_buffers:
            owned.append((moe.gate, "e_score_correction_bias", torch.float32))
        for owner, name, dtype in owned:
            buf = getattr(owner, name, None)
            if buf is None:
                continue
            if not buf.is_meta:
                buf.zero_()
            elif device is not None and torch.device(device).type != "meta":
                setattr(owner, name, torch.zeros(moe.num_experts, dtype=dtype, device=device))


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


# How HF writes expert weights to disk (per expert, legacy layout), for meshkit.hf_io:
# (block infix, gate, up, down) names; and the fused parameters of a converted block.
HF_EXPERT_FILE_FORMATS = (
    (".mlp.", "gate_proj", "up_proj", "down_proj"),  # Qwen2/3-MoE family
    (".block_sparse_moe.", "w1", "w3", "w2"),  # Mixtral
)
HF_MOE_PARAM_NAME = re.compile(r"(.*)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)")
