"""The MoE layer's activation bytes, identified on a few-expert proxy, against the real expert count.

`estimate.moe` never runs a layer of the model's expert count (256 for DeepSeek-V3): it measures a
proxy with the model's top-k and options and extrapolates in the expert count, the widths and the
tokens. Here the model's own converted layer, with its real 64 experts, runs at a token count and
widths the proxy never ran, and every part must match the identification byte for byte.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from meshkit._compat import storage_key
from meshkit.estimate import moe
from meshkit.estimate.spec import DTYPES
from meshkit.estimate.trace import Recorder, by_part, recording
from meshkit.models.moe import convert_moe_blocks

# Mixtral-shaped (softmax, top-2) and DeepSeek-V3-shaped (sigmoid, top-8, route scale, a shared
# expert), each with 64 routed experts: far past the proxy's top-k + 1 .. top-k + 11.
CONFIGS = {
    "mixtral": ("mixtral", dict(hidden_size=96, intermediate_size=88, num_local_experts=64, num_experts_per_tok=2,
                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                vocab_size=128)),
    "deepseek_v3": ("deepseek_v3", dict(hidden_size=96, intermediate_size=160, moe_intermediate_size=88,
                                        n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
                                        n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=0,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                        v_head_dim=8, vocab_size=128)),
}


def _real_layer_bytes(config, tokens: int, dtype: str) -> dict[str, int]:
    """What the model's converted MoE layer saves for one forward, by "mode/part" (the estimator's
    instrument, on the real layer rather than the proxy). The router stays fp32, as in meshkit's `MoE`."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    layer = convert_moe_blocks(model)[0].to(DTYPES[dtype])
    layer.gate.float()
    recorder = Recorder({storage_key(p) for p in layer.parameters()})
    parts = {getattr(layer, name): part for name, part in moe.MOE_PARTS.items() if getattr(layer, name, None) is not None}
    x = torch.randn(tokens, config.hidden_size, dtype=DTYPES[dtype], requires_grad=True)
    with moe._one_thread(), recording(recorder, parts, moe.DEFAULT_PART):
        layer.experts.backend = "loop"
        layer(x)
    return {f"{mode}/{part}": n for mode, entries in (("none", recorder.saved), ("selective", recorder.cached))
            for part, n in by_part(entries, set()).items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_proxy_identification_matches_the_real_expert_count(name: str, dtype: str) -> None:
    model_type, fields = CONFIGS[name]
    config = transformers.AutoConfig.for_model(model_type, **fields)
    options = moe.layer_options(config)
    assert options["num_experts"] == 64
    tokens = 101
    measured = _real_layer_bytes(config, tokens, dtype)
    assert measured, "the real layer saved nothing: the comparison would be empty"
    for ac in ("none", "selective"):
        real = {k.split("/", 1)[1]: n for k, n in measured.items() if k.startswith(ac + "/") and n}
        assert moe.layer_activations(config, tokens, dtype, ac) == real, (name, dtype, ac)
    assert moe.layer_activations(config, tokens, dtype, "full") == {}
