"""What a LoRA model or plan rules out: each a ValueError naming the field and the fix, raised by
`parallelize` on every rank before any collective (the checks are pure functions of model and plan)."""

from __future__ import annotations

import pytest
from peft import IA3Config, LoraConfig, get_peft_model

import meshkit
from meshkit.integrations.peft import model as peft_model
from meshkit.models import moe as moe_models
from meshkit.testing.reference import ModelSpec

ALL_RANKS_QUICKLY = 30.0


def _problems(spec: ModelSpec, config, tp: int = 1) -> str:
    model = get_peft_model(spec.build(), config)
    found = peft_model.adapter_problems(model, tp)
    if not found:
        lm = model.get_base_model()
        moe_models.convert_moe_blocks(lm) if moe_models.is_moe_model(lm) else None
        found = peft_model.tp_problems(model, tp)
    return "\n".join(found)


MOE = ModelSpec(kind="qwen2_moe", experts=4, intermediate=16, extra=(("shared_expert_intermediate_size", 16),))
CASES = [
    pytest.param(ModelSpec(), LoraConfig(target_modules=["q_proj", "qproj"]), 1,
                 ["target_modules: ['qproj'] match(es) no layer", "fix: target among", "'down_proj'"], id="no-match"),
    pytest.param(ModelSpec(), LoraConfig(r=40, target_modules=["q_proj"]), 1,
                 ["LoraConfig.r=40 on model.layers.0.self_attn.q_proj", "min(in_features=32, out_features=32)",
                  "fix: r <= 32"], id="r-too-large"),
    pytest.param(ModelSpec(), LoraConfig(target_modules=["q_proj", "lm_head"]), 1,
                 ["LoRA on lm_head", "fix: leave it out of target_modules"], id="lm-head"),
    pytest.param(MOE, LoraConfig(target_modules=["q_proj", "gate_proj"]), 1,
                 ["LoRA on model.layers.0.mlp.shared_expert.gate_proj", "MoE layer", "fix: target attention"],
                 id="moe-shared-expert"),
    pytest.param(ModelSpec(kind="mixtral", experts=4, intermediate=16), LoraConfig(target_modules="all-linear"), 1,
                 ["LoraConfig.target_parameters=", "ParamWrapper", "'all-linear' adds an MoE model's experts"],
                 id="moe-experts-all-linear"),
    pytest.param(MOE, LoraConfig(target_modules=["shared_expert_gate"]), 1,
                 ["LoRA on model.layers.0.mlp.shared_expert_gate", "MoE layer"], id="moe-shared-expert-gate"),
    pytest.param(ModelSpec(heads=4, kv_heads=1), LoraConfig(target_modules=["q_proj", "k_proj"]), 2,
                 ["LoRA on model.layers.0.self_attn.k_proj", "'kv_colwise' layer under tp=2",
                  "K/V heads replicated", "fix:"], id="replicated-kv-heads"),
    pytest.param(ModelSpec(kind="phi3"), LoraConfig(target_modules=["qkv_proj"]), 2,
                 ["self_attn.qkv_proj", "'packed_qkv' layer under tp=2", "packed projections"], id="packed-qkv"),
    pytest.param(ModelSpec(), LoraConfig(target_modules=["q_proj"], use_dora=True), 1,
                 ["LoraConfig.use_dora=True", "fix: use_dora=False"], id="dora"),
    pytest.param(ModelSpec(), IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]), 1,
                 ["peft_type=IA3", "LoRA adapters only", "fix: peft.LoraConfig"], id="ia3"),
    pytest.param(ModelSpec(), LoraConfig(target_modules=["q_proj"], lora_dropout=0.1), 2,
                 ["LoraConfig.lora_dropout=0.1 with tp=2", "fix: lora_dropout=0.0"], id="dropout-under-tp"),
    pytest.param(ModelSpec(), LoraConfig(target_modules=["o_proj"], lora_bias=True), 2,
                 ["LoraConfig.lora_bias=True on model.layers.0.self_attn.o_proj", "fix: lora_bias=False"],
                 id="lora-bias-row-parallel"),
]


@pytest.mark.parametrize(("spec", "config", "tp", "needles"), CASES)
def test_lora_refusals(spec, config, tp, needles):
    message = _problems(spec, config, tp)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_supported_configs_pass():
    assert not _problems(ModelSpec(), LoraConfig(target_modules="all-linear", lora_dropout=0.1,
                                                 exclude_modules=["lm_head"]), 1)
    assert not _problems(ModelSpec(), LoraConfig(target_modules=["q_proj", "up_proj"], lora_bias=True), 2)


def _parallelize(plan: str, targets: list[str]) -> None:
    meshkit.parallelize(get_peft_model(ModelSpec().build(), LoraConfig(target_modules=targets)),
                        meshkit.Plan.from_string(plan))


def test_refused_on_every_rank_before_any_collective(dist):
    pool = dist(2)
    grace, pool.grace = pool.grace, ALL_RANKS_QUICKLY
    try:
        outcomes = pool.run_raw(_parallelize, "tp=2", ["q_proj", "lm_head"], timeout=ALL_RANKS_QUICKLY)
    finally:
        pool.grace = grace
    for o in outcomes:
        assert isinstance(o.value, ValueError) and "LoRA on lm_head" in o.message, o.traceback or o.message
