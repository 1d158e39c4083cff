"""Tiny configs of every supported family, with the fields that change its math set so they matter.

Values are chosen so that a quirk left out shows at the test tolerances: soft-caps far below the
scores' range would be invisible, so Gemma-2's attention cap sits near the tiny model's scores;
windows are shorter than the test sequences; Granite's multipliers are far from 1; SmolLM3 skips rope
on one of its two layers. Shapes come from `ModelSpec` (4 query heads, 2 K/V heads, head_dim 8).
"""

from __future__ import annotations

from meshkit.testing.reference import ModelSpec

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
}
# The ModelSpec fields every MoE family's tiny model uses.
MOE_FIELDS = {"experts": 4, "top_k": 2, "intermediate": 16}
MOE_KINDS = ("qwen2_moe", "olmoe")


def family_spec(kind: str, **fields) -> ModelSpec:
    """The tiny `ModelSpec` of family `kind` (any ModelSpec field may be overridden)."""
    defaults = MOE_FIELDS if kind in MOE_KINDS else {}
    return ModelSpec(kind=kind, extra=FAMILY_FIELDS[kind], **{**defaults, **fields})


def ring_refusal(kind: str, seq: int) -> str | None:
    """The phrase meshkit's refusal of the ring kinds of CP contains for this family, or None."""
    fields = dict(FAMILY_FIELDS[kind])
    if fields.get("attn_logit_softcapping"):
        return "attn_logit_softcapping"
    if fields.get("sliding_window") and seq > fields["sliding_window"]:
        return "sliding window"
    return None
