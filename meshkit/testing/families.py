"""Tiny configs of every supported family, with the fields that change its math set so they matter.

Values are chosen so that a quirk left out shows at the test tolerances: soft-caps far below the
scores' range would be invisible, so Gemma-2's attention cap sits near the tiny model's scores;
windows are shorter than the test sequences; Granite's multipliers are far from 1; SmolLM3 skips rope
on one of its two layers. Shapes come from `ModelSpec` (4 query heads, 2 K/V heads, head_dim 8).
"""

from __future__ import annotations

from meshkit.testing.reference import LoraSpec, ModelSpec

# model_type -> (config field, value) pairs that make its quirks matter in a tiny model.
FAMILY_FIELDS: dict[str, tuple] = {
    "llama": (),
    "qwen2": (),
    "qwen3": (),
    "mistral": (("sliding_window", 4),),
    "gemma": (),
    "gemma2": (("sliding_window", 4), ("attn_logit_softcapping", 0.005), ("final_logit_softcapping", 2.0),
               ("query_pre_attn_scalar", 8)),
    "gemma3_text": (("sliding_window", 4), ("layer_types", ["sliding_attention", "full_attention"]),
                    ("query_pre_attn_scalar", 8)),
    "phi3": (),
    "olmo2": (),
    "granite": (("embedding_multiplier", 3.0), ("residual_multiplier", 0.5), ("attention_multiplier", 0.2),
                ("logits_scaling", 2.0)),
    "smollm3": (("no_rope_layers", [1, 0]),),
    "glm4": (),
    "helium": (),
    # MoE families (4 experts, top-2; `MOE_FIELDS`): Qwen2-MoE's gated shared expert and a dense first
    # layer, un-normalised top-k; OLMoE's whole-projection q/k norms with clipped q/k/v.
    "qwen2_moe": (("shared_expert_intermediate_size", 24), ("mlp_only_layers", [0]), ("norm_topk_prob", False)),
    "olmoe": (("clip_qkv", 0.5), ("norm_topk_prob", False)),
    # DeepSeek-V3: MLA with q/kv latents, decoupled interleaved rope and v_head_dim != qk head dim;
    # 2 groups of 2 experts, 1 group kept, routed scaling, a shared expert, one dense first layer.
    "deepseek_v3": (("q_lora_rank", 16), ("kv_lora_rank", 12), ("qk_rope_head_dim", 4), ("qk_nope_head_dim", 8),
                    ("v_head_dim", 6), ("n_group", 2), ("topk_group", 1), ("routed_scaling_factor", 2.5),
                    ("n_shared_experts", 1), ("first_k_dense_replace", 1)),
    # gpt-oss: per-head attention sinks, a sliding layer then a full one (window shorter than the
    # sequence), attention biases, a biased router; biased experts stored transposed and interleaved
    # with a clamped SwiGLU whose limit sits inside the tiny model's pre-activations (about 0.1).
    "gpt_oss": (("sliding_window", 4), ("layer_types", ["sliding_attention", "full_attention"]),
                ("swiglu_limit", 0.05), ("attention_bias", True),
                ("rope_parameters", {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 2.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})),
}
# The ModelSpec fields every MoE family's tiny model uses.
MOE_FIELDS = {"experts": 4, "top_k": 2, "intermediate": 16}
MOE_KINDS = ("qwen2_moe", "olmoe", "deepseek_v3", "gpt_oss")
# Families whose attention has no K/V grouping (MLA: every head has its own K and V).
_KV_HEADS = {"deepseek_v3": 4}


# A LoRA adapter on every attention linear and every dense MLP's (a regular expression: PEFT's
# "all-linear" would add an MoE model's experts, which meshkit refuses to adapt), B non-zero.
LORA = LoraSpec(targets=r".*\.(self_attn|mlp)\.[a-z_]+_proj")
# Families whose linears tensor parallelism row-selects (packed projections): LoRA under tp is refused.
_PACKED = {"phi3": "'packed_qkv' layer", "glm4": "'packed_gate_up' layer"}


def family_spec(kind: str, **fields) -> ModelSpec:
    """The tiny `ModelSpec` of family `kind` (any ModelSpec field may be overridden)."""
    defaults = {**(MOE_FIELDS if kind in MOE_KINDS else {}),
                **({"kv_heads": _KV_HEADS[kind]} if kind in _KV_HEADS else {})}
    return ModelSpec(**{"kind": kind, "extra": FAMILY_FIELDS[kind], **defaults, **fields})


def plan_refusal(kind: str, shape: str) -> tuple[str, str] | None:
    """(a phrase of the reason, a phrase of the fix) meshkit's refusal of family `kind` under the family
    test's plan shape `shape` contains, or None when meshkit runs it (only LoRA refuses families)."""
    if shape == "lora" and kind == "deepseek_v3":  # PEFT turns the MLP targets into the experts' parameters
        return "target_parameters", "target_parameters=None"
    if shape == "lora" and kind in _PACKED:
        return _PACKED[kind], "leave it out of target_modules"
    return None
