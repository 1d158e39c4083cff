"""Plan: validation messages, dp_shard filling, TOML / string / CLI loading. Single process, no mesh."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import LlamaConfig

from meshkit import Plan, PlanError


def _config(**kw) -> LlamaConfig:
    base = dict(hidden_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, vocab_size=120)
    base.update(kw)
    return LlamaConfig(**base)


@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2, 3]), st.integers(1, 4))
def test_dp_shard_fills_the_world(tp, dp_replicate, pp_unused, fill):
    world = tp * dp_replicate * fill
    plan = Plan(tp=tp, dp_replicate=dp_replicate, dp_shard=-1).resolve(world)
    assert plan.dp_shard == fill
    assert plan.world_size == world
    assert plan.dp == dp_replicate * fill


def test_world_mismatch_names_the_fix():
    with pytest.raises(ValueError, match=r"needs .* = 4 processes.*nproc-per-node 4"):
        Plan(tp=2, dp_shard=2).validate(world_size=8)


def test_dp_shard_fill_that_cannot_divide():
    with pytest.raises(ValueError, match="does not divide"):
        Plan(tp=3, dp_shard=-1).resolve(8)


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(tp=4), r"num_attention_heads=6.*largest tp that works is 2; fix: use a tp in \[1, 2, 6\]"),
        (dict(tp=3), r"num_key_value_heads=2"),
        (dict(tp=2, dp_shard=1), None),
    ],
)
def test_tp_must_divide_heads(kw, pattern):
    cfg = _config()
    plan = Plan(**kw)
    if pattern is None:
        plan.validate(cfg, world_size=plan.world_size)
    else:
        with pytest.raises(ValueError, match=pattern):
            plan.validate(cfg, world_size=plan.world_size)


def test_every_violation_is_listed_at_once():
    cfg = _config(intermediate_size=99, vocab_size=121, num_key_value_heads=3)
    with pytest.raises(PlanError) as info:
        Plan(tp=2).validate(cfg, world_size=2)
    text = str(info.value)
    for field in ("num_key_value_heads=3", "intermediate_size=99", "vocab_size=121"):
        assert field in text
    assert "pad the vocabulary to 122" in text


def test_sequence_parallel_needs_divisible_seq_len():
    with pytest.raises(ValueError, match="multiple of 4.*pad or cut sequences to 12"):
        Plan(tp=4, dp_shard=1).validate(_config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4), 4, seq_len=10)
    Plan(tp=4, sequence_parallel=False).validate(_config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4), 4, 10)


def test_expert_parallelism_folds_over_data_and_context_ranks():
    assert Plan(ep=4, dp_shard=2, cp=2).validate(world_size=4).world_size == 4  # ep adds no ranks
    with pytest.raises(ValueError, match=r"ep=3: expert parallelism folds over dp_shard x cp = 4"):
        Plan(ep=3, dp_shard=4).validate(world_size=4)
    from transformers import MixtralConfig

    mixtral = MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, num_local_experts=6)
    with pytest.raises(ValueError, match="does not divide num_experts=6"):
        Plan(ep=4, dp_shard=4).validate(mixtral, world_size=4)


def test_pipeline_options_are_checked():
    with pytest.raises(ValueError, match="pp_virtual_stages=1: interleaved_1f1b"):
        Plan(pp=2, pp_schedule="interleaved_1f1b").validate(world_size=2)
    with pytest.raises(ValueError, match="pp_microbatches=1: interleaved 1F1B needs at least pp=2"):
        Plan(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, pp_microbatches=1).validate(world_size=2)
    with pytest.raises(ValueError, match="pp_virtual_stages=2 with pp_schedule='zb_h1'"):
        Plan(pp=2, pp_schedule="zb_h1", pp_virtual_stages=2).validate(world_size=2)
    with pytest.raises(ValueError, match="pp_schedule='dualpipe2'"):
        Plan(pp=2, pp_schedule="dualpipe2")
    with pytest.raises(ValueError, match=r"pp=3: DualPipe pairs rank r with rank pp-1-r.*fix: pp=4 or pp=2"):
        Plan(pp=3, pp_schedule="dualpipe").validate(world_size=3)
    with pytest.raises(ValueError, match=r"pp_split=\[1, 2, 3\]: 2 stages need 1 split points"):
        Plan(pp=2, pp_schedule="dualpipe", pp_split=(1, 2, 3)).validate(world_size=2)
    with pytest.raises(ValueError, match=r"8 pipeline stages need at least 6 decoder layers"):
        Plan(pp=4, pp_schedule="interleaved_1f1b", pp_virtual_stages=2).validate(_config(num_hidden_layers=2), 4)
    assert Plan.from_string("pp=2,pp_split=3").pp_split == (3,)
    assert Plan(pp=4, pp_split="1/2/3").pp_split == (1, 2, 3)  # a TOML preset may write the string form


@pytest.mark.parametrize("split", [(5,), (0,), (-1,)])
def test_pp_split_is_checked_against_the_model_by_validate(split):
    # Before any mesh exists: every rank reaches the same verdict from the plan and the config alone.
    with pytest.raises(PlanError, match=rf"pp_split=\[{split[0]}\]: need 1 strictly increasing first-layer "
                                        r"indices in \[1, 4\].*fix: e.g. \[2\]"):
        Plan(pp=2, pp_split=split).validate(_config(num_hidden_layers=4), world_size=2)


def test_pp_split_order_is_checked_and_good_splits_pass():
    with pytest.raises(PlanError, match=r"pp_split=\[3, 2, 1\]: need 3 strictly increasing"):
        Plan(pp=4, pp_split=(3, 2, 1)).validate(_config(num_hidden_layers=4), world_size=4)
    with pytest.raises(PlanError, match=r"pp_split=\[1, 2, 2\]: need 3 strictly increasing"):
        Plan(pp=4, pp_split="1/2/2").validate(_config(num_hidden_layers=4), world_size=4)
    Plan(pp=2, pp_split=(4,)).validate(_config(num_hidden_layers=4), world_size=2)  # last stage: the head alone
    Plan(pp=4, pp_split=(1, 2, 3)).validate(_config(num_hidden_layers=4), world_size=4)
    assert Plan(pp=4).microbatches == 4 and Plan().microbatches == 1


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(tp=0), "tp=0: must be >= 1"),
        (dict(dp_shard=-2), "dp_shard=-2"),
        (dict(activation_checkpointing="some"), "activation_checkpointing='some'"),
        (dict(param_dtype="fp8"), "param_dtype='fp8'"),
        (dict(sequence_parallel="yes"), "sequence_parallel='yes'"),
    ],
)
def test_bad_option_values(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        Plan(**kw)


def test_dropout_is_refused():
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        Plan().validate(_config(attention_dropout=0.1), world_size=1)


def test_non_llama_config_is_refused():
    class Other:
        hidden_size = 8

    with pytest.raises(ValueError, match="lacks"):
        Plan().validate(Other(), world_size=1)


def test_from_string_toml_and_cli(tmp_path):
    plan = Plan.from_string("tp=2, dp_shard=-1, activation_checkpointing=full, sequence_parallel=false")
    assert (plan.tp, plan.dp_shard, plan.activation_checkpointing, plan.sequence_parallel) == (2, -1, "full", False)
    path = tmp_path / "p.toml"
    path.write_text('[plan]\ntp = 2\ndp_replicate = 2\nparam_dtype = "bfloat16"\n')
    toml_plan = Plan.from_toml(path)
    assert (toml_plan.tp, toml_plan.dp_replicate, toml_plan.param_dtype) == (2, 2, "bfloat16")
    parser = Plan.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--tp", "4", "--reshard-after-forward", "false"])
    merged = Plan.from_cli_args(args, base=toml_plan)
    assert (merged.tp, merged.dp_replicate, merged.reshard_after_forward) == (4, 2, False)
    assert Plan.from_dict(merged.to_dict()) == merged


def test_unknown_keys_are_named():
    with pytest.raises(ValueError, match=r"unknown option.*tensor_parallel"):
        Plan.from_string("tensor_parallel=2")
    with pytest.raises(ValueError, match="must be an int"):
        Plan.from_string("tp=two")
    with pytest.raises(ValueError, match=r"tp='2 dp_shard=2': one option per key=value, separated by commas"):
        Plan.from_string("tp=2 dp_shard=2")


def test_compile_under_tensor_parallel_is_refused_with_the_fix():
    """Compiled blocks under tp fail in backward (DTensor's redistribute gets a plain gradient): the plan
    is refused before any collective, naming both ways out; compile without tp stays allowed."""
    with pytest.raises(PlanError, match=r"compile=True with tp=2.*fix: compile=False, or tp=1"):
        Plan(tp=2, compile=True).validate(world_size=2)
    Plan(dp_shard=2, compile=True).validate(world_size=2)
    Plan(tp=2).validate(world_size=2)
