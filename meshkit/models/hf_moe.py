"""HF sparse MoE blocks as meshkit `MoE` layers: the block formats, the in-place conversion, HF's
auxiliary loss fed from meshkit's router statistics, and the export back to HF's keys.

Like `llama.py`, a module that knows Hugging Face names. HF MoE models (`mixtral`, `qwen3_moe`,
`qwen2_moe`, `olmoe`, `deepseek_v3`, `gpt_oss`): each decoder block's `mlp` is a sparse block with a
`gate` router ([E, H] weight) and fused `experts` (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I];
Qwen2/3-MoE keep dense MLPs in `mlp_only_layers`; Qwen2-MoE adds a `shared_expert` scaled by
sigmoid(`shared_expert_gate`), which `MoE` has as options). `convert_hf_block` replaces one sparse
block with an `MoE` that holds *the same Parameter objects* (no copy, works on the meta device)
under the same names, so `model.state_dict()` keeps exactly HF's keys, shapes and dtypes and
checkpoints load and save with HF's own code. gpt-oss's block (`router` with a bias, experts stored
transposed with gate/up interleaved, biased, with a clamped SwiGLU) is read from what its experts
class declares (`is_transposed`, `is_concatenated`, `has_bias`) and the config's `swiglu_alpha` /
`swiglu_limit`, through `expert_parallel.expert_variants`.

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

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshkit.expert_parallel import (
    ClampedSwiGLU,
    ExpertLayout,
    MoE,
    hf_load_balancing_loss,
    moe_layers,
    pop_router_stats,
)

__all__ = [
    "HF_EXPERT_FILE_FORMATS",
    "HF_MOE_PARAM_NAME",
    "MOE_MODEL_TYPES",
    "convert_hf_block",
    "hf_aux_loss",
    "identity_stand_in",
    "init_moe_buffers",
    "is_hf_moe_block",
    "to_hf_state_dict",
    "zero_width_shared_expert_shapes",
]

MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")


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
CONVERT_OPTIONS = ("capacity_factor", "aux_loss_coef", "z_loss_coef", "bias_update_rate", "expert_backend")

def is_hf_moe_block(module: nn.Module) -> bool:
    """Whether `module` is an HF sparse MoE block this module converts (by class name: no HF import)."""
    return type(module).__name__ in _HF_BLOCKS


def _check_hf_config(config: Any) -> None:
    problems = []
    if getattr(config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config.hidden_act!r}: meshkit experts are SwiGLU; fix: use a silu model")
    if getattr(config, "router_jitter_noise", 0.0):
        problems.append(f"router_jitter_noise={config.router_jitter_noise}: meshkit's router adds no noise; "
                        "fix: set config.router_jitter_noise = 0.0 before converting")
    if problems:
        raise ValueError("cannot convert the MoE blocks losslessly:\n  - " + "\n  - ".join(problems))


def convert_hf_block(block: nn.Module, config: Any, **options: Any) -> MoE:
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
    if shared is not None and shared.down_proj.in_features == 0:
        # A zero-width shared expert (DeepSeek-V3 with n_shared_experts=0, Qwen2-MoE with
        # shared_expert_intermediate_size=0) adds exactly zero; HF builds it (and its gate) all the same,
        # with empty weights, which FSDP2 cannot shard: the converted layer leaves them out, so its state
        # dict lacks those zero-element keys.
        shared = None
    n_group, topk_group = (int(getattr(config, f) or 1) for f in fmt.group_fields) if fmt.group_fields else (1, 1)
    moe = MoE(hidden, inter, num_experts, config.num_experts_per_tok, score_func=fmt.score_func,
              route_scale=float(getattr(config, fmt.scale_field)) if fmt.scale_field else 1.0,
              n_group=n_group, topk_group=topk_group, bias_in_gate=fmt.bias_in_gate,
              shared_intermediate_size=0 if shared is None else shared.down_proj.in_features,
              shared_expert_gate=fmt.shared_gate is not None and shared is not None, shared_expert_name=fmt.shared or "shared_expert",
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
    if fmt.shared_gate is not None and shared is not None:
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
class _PairIdentity(nn.Module):
    """Identity shaped like a block that returns (hidden, router scores): its decoder layer unpacks two."""

    def forward(self, hidden: Tensor) -> tuple[Tensor, None]:
        return hidden, None


def identity_stand_in(mlp: nn.Module) -> nn.Module:
    """What replaces an HF MoE block when its routing is costed elsewhere (the estimator's trace):
    an identity that returns what the decoder layer unpacks (a pair for gpt-oss)."""
    fmt = _HF_BLOCKS.get(type(mlp).__name__)
    return _PairIdentity() if fmt is not None and fmt.returns_pair else nn.Identity()


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

    Converted names are HF's; what differs is meshkit-only state to drop, DeepSeek-V3's
    `expert_bias` (only present with `bias_update_rate > 0`), for which these HF models have no
    slot, and the zero-width shared experts conversion left out, to add back
    (`zero_width_shared_expert_shapes`: empty weights, and a Qwen2-MoE gate of zeros, which scales
    a zero output). Llama-MoE state dicts are returned as they are: there is no HF class to map them to.
    """
    if getattr(config, "model_type", None) not in MOE_MODEL_TYPES:
        return dict(state_dict)
    out = {k: v for k, v in state_dict.items() if not k.endswith(".expert_bias")}
    for name, (block, shape) in zero_width_shared_expert_shapes(config, state_dict).items():
        like = state_dict.get(f"{block}.experts.gate_up_proj", state_dict[f"{block}.gate.weight"])
        out[name] = torch.zeros(shape, dtype=like.dtype, device=like.device)
    return out


# HF builds a block's shared expert even at zero width (DeepSeek-V3 with n_shared_experts=0, Qwen2-MoE
# with shared_expert_intermediate_size=0), with empty weights, and Qwen2-MoE its [1, H] sigmoid gate
# too; `convert_hf_block` leaves both out. model_type -> (shared expert's name, its gate's or None).
_ZERO_WIDTH_SHARED = {"deepseek_v3": ("shared_experts", None), "qwen2_moe": ("shared_expert", "shared_expert_gate")}
_ROUTER_KEY = re.compile(r"(.*\.mlp)\.gate\.weight")


def _shared_width(config: Any) -> int:
    if config.model_type == "deepseek_v3":
        return int(config.moe_intermediate_size) * int(config.n_shared_experts or 0)
    return int(config.shared_expert_intermediate_size or 0)


def zero_width_shared_expert_shapes(config: Any, keys: Any) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF's tensors that a zero-width shared expert has and a converted layer does not: name ->
    (the block's `...mlp` prefix, shape), for the MoE blocks whose router (`...mlp.gate.weight`) is
    among `keys` (a state dict's or a checkpoint's names). Empty unless the config's shared expert has
    zero width.

    The export writes them back, so `from_pretrained` finds the directory HF itself would write (it
    otherwise reports them MISSING and initialises them); the import accepts them in HF's files.
    """
    names = _ZERO_WIDTH_SHARED.get(getattr(config, "model_type", None))
    if names is None or _shared_width(config):
        return {}
    shared, gate = names
    hidden = int(config.hidden_size)
    out = {}
    for key in keys:
        match = _ROUTER_KEY.fullmatch(key)
        if match is None:
            continue
        block = match[1]
        out.update({f"{block}.{shared}.gate_proj.weight": (block, (0, hidden)),
                    f"{block}.{shared}.up_proj.weight": (block, (0, hidden)),
                    f"{block}.{shared}.down_proj.weight": (block, (hidden, 0))})
        if gate is not None:
            out[f"{block}.{gate}.weight"] = (block, (1, hidden))
    return out


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


# How HF writes expert weights to disk (per expert, legacy layout), for meshkit.state.hf_checkpoint:
# (block infix, gate, up, down) names; and the fused parameters of a converted block.
HF_EXPERT_FILE_FORMATS = (
    (".mlp.", "gate_proj", "up_proj", "down_proj"),  # Qwen2/3-MoE family
    (".block_sparse_moe.", "w1", "w3", "w2"),  # Mixtral
)
HF_MOE_PARAM_NAME = re.compile(r"(.*)\.mlp\.(experts\.gate_up_proj|experts\.down_proj|gate\.weight)")
