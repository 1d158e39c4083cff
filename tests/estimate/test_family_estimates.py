"""The estimator on every supported family: its parameter count equals the built model's, the whole
estimate runs (Gemma-3's rotary per layer type, MLA, shared experts), and where the config names every
parameter the FLOP formula's active block parameters equal the ones measured on the model."""

from __future__ import annotations

import pytest

import meshkit
from meshkit import metrics
from meshkit.estimate import Workload, estimate, model_state
from meshkit.models.moe import moe_spec
from meshkit.testing.families import FAMILY_FIELDS, MOE_KINDS, family_spec

# The estimator models uniform stacks: the MoE families' tiny configs with every block sparse.
UNIFORM = {"qwen2_moe": {"mlp_only_layers": []}, "deepseek_v3": {"first_k_dense_replace": 0}}


def _spec(kind: str, **fields):
    spec = family_spec(kind)
    spec.extra = tuple({**dict(spec.extra), **UNIFORM.get(kind, {}), **fields}.items())
    return spec


@pytest.mark.parametrize("kind", sorted(FAMILY_FIELDS))
def test_parameter_count_on_every_family(kind):
    spec = _spec(kind)
    measured = sum(p.numel() for p in spec.build(device="meta").parameters())
    assert model_state(spec.config(), meshkit.Plan()).params == measured


# The MoE estimates measure meshkit's MoE layer on real tensors: 30-90 s each on 2 loaded cores.
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in MOE_KINDS else k
                                  for k in sorted(FAMILY_FIELDS)])
def test_estimate_runs_on_every_family(kind):
    est = estimate(_spec(kind).config(), meshkit.Plan(), 1, Workload(seq=16))
    assert est.peak_bytes > 0 and est.flops.model > 0


def _active_block_params(model, config) -> int:
    """One MoE block's parameters as a token's matmuls touch them, counted on the built model."""
    block = model.model.layers[-1]
    total = sum(p.numel() for p in block.parameters())
    experts = sum(p.numel() for p in block.mlp.experts.parameters())
    spec = moe_spec(config)
    return total - experts + experts * spec.top_k // spec.num_experts


@pytest.mark.parametrize("kind, fields", [("deepseek_v3", {}), ("qwen2_moe", {"qkv_bias": False})])
def test_active_parameters_of_mla_and_shared_experts(kind, fields):
    """MLA's latent projections and norms, the shared expert and Qwen2-MoE's shared-expert gate are in
    the FLOP formula: its active block parameters equal the built block's."""
    spec = _spec(kind, **fields)
    config = spec.config()
    model = spec.build(device="meta")
    assert metrics.active_block_params(config, config.num_hidden_layers - 1) == _active_block_params(model, config)


def test_mixed_dense_and_moe_stacks_are_refused_by_name():
    config = family_spec("deepseek_v3").config()  # first_k_dense_replace=1: block 0 dense
    with pytest.raises(ValueError, match="uniform stacks"):
        estimate(config, meshkit.Plan(), 1, Workload(seq=16))
