"""The MoE layer's activation bytes, identified on a few-expert proxy, against the real expert count.

`estimate.moe` never runs a layer of the model's expert count (256 for DeepSeek-V3): it measures a
proxy with the model's top-k and options and extrapolates in the expert count, the widths and the
tokens. Here the model's own converted layer, with its real 64 experts, runs at a token count and
widths the proxy never ran, and every part must match the identification byte for byte. (Before the
proxy carried the router bias, the shared-expert gate and gpt-oss's expert variants, Qwen2-MoE and
gpt-oss measured short of their real layers.)
"""

from __future__ import annotations

import pytest
import torch
import transformers

from meshkit._compat.subclasses import storage_key
from meshkit.estimate import moe
from meshkit.estimate.trace import Recorder, by_part, recording
from meshkit.models.moe import convert_moe_blocks
from meshkit.plan import DTYPES
from meshkit.testing.families import family_spec
from meshkit.testing.reference import ModelSpec

# Every HF MoE family meshkit converts, each with 64 routed experts (far past the proxy's top-k + 1 ..
# top-k + 11), in alternating dtypes: Mixtral, Qwen2-MoE's gated shared expert, OLMoE, gpt-oss's biased
# router and experts (transposed, interleaved, clamped SwiGLU), DeepSeek-V3's sigmoid group-limited
# routing with a shared expert.
CASES = [("mixtral", "float32"), ("mixtral", "bfloat16"), ("qwen2_moe", "bfloat16"), ("olmoe", "float32"),
         ("gpt_oss", "bfloat16"), ("deepseek_v3", "float32")]


def _config(kind: str):
    spec = ModelSpec(kind="mixtral", experts=64, intermediate=24) if kind == "mixtral" else \
        family_spec(kind, experts=64, intermediate=24)
    config = spec.config()
    if kind == "qwen2_moe":
        config.mlp_only_layers = []  # block 0 an MoE block too
    return config


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


@pytest.mark.parametrize("kind, dtype", CASES)
def test_proxy_identification_matches_the_real_expert_count(kind: str, dtype: str) -> None:
    config = _config(kind)
    assert moe.layer_options(config)["num_experts"] == 64
    tokens = 101
    measured = _real_layer_bytes(config, tokens, dtype)
    assert measured, "the real layer saved nothing: the comparison would be empty"
    for ac in ("none", "selective"):
        real = {k.split("/", 1)[1]: n for k, n in measured.items() if k.startswith(ac + "/") and n}
        assert moe.layer_activations(config, tokens, dtype, ac) == real, (kind, dtype, ac)
    assert moe.layer_activations(config, tokens, dtype, "full") == {}
