"""What a Trainer run with `plan=` takes: the plan itself (object, compact string, TOML, or a
`--plan` flag parsed with the training arguments), and the training arguments it refuses.

Two requests TRL's configs make by default are honoured rather than refused (`plan_for_arguments`):
`activation_checkpointing=True` means the plan recomputes ('full' unless the plan names a mode; HF's
own checkpointing of the blocks is switched off, since meshkit drives them), and `bf16=True` means
`param_dtype='bfloat16'` unless the plan names one (FSDP2's mixed precision: fp32 master weights and
optimizer, bf16 compute, fp32 gradient reduction, as HF's autocast keeps fp32 weights).

meshkit owns the whole layout (sharding, data ranks, precision, recompute, compilation), so every
training argument that asks accelerate or transformers for one of these would either wrap the
sharded model a second time or be silently ignored. Each is refused with the Plan field that does
the same job. The checks are pure: every rank computes the same list before any collective.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from meshkit.plan import Plan

# Optimizer keyword arguments with which transformers hands the optimizer the model or parameters it
# chose itself (GaLore, LOMO, layer-wise optimizers): they would bypass pm.parameters().
_SELF_BUILDING = ("params", "model", "optimizer_dict")


@dataclass
class PlanArguments:
    """The plan as one command-line flag beside the training arguments.

    `HfArgumentParser((TrainingArguments, PlanArguments)).parse_args_into_dataclasses()` reads
    `--plan tp=2,pp=2,dp_shard=-1` (or `--plan plan.toml`); pass `plan=plan_args.plan` to the trainer.
    """

    plan: str = field(default="", metadata={"help": "meshkit Plan: 'tp=2,pp=2,dp_shard=-1' or a TOML file path"})


def plan_from(value: Any) -> Plan:
    """A Plan from a Plan, a compact string (`"tp=2,dp_shard=-1"`), a TOML file path, a mapping, or
    `PlanArguments`."""
    if isinstance(value, PlanArguments):
        value = value.plan
    if isinstance(value, Plan):
        return value
    if isinstance(value, Mapping):
        return Plan.from_dict(value)
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if text.endswith(".toml") or os.path.isfile(text):
            return Plan.from_toml(text)
        return Plan.from_string(text)
    raise ValueError(f"plan={value!r}: a meshkit Trainer needs a meshkit.Plan (or 'tp=2,dp_shard=-1', a TOML path, a "
                     "dict); fix: plan=meshkit.Plan(...); for a run without meshkit use transformers' own Trainer")


def plan_for_arguments(plan: Plan, args: Any) -> Plan:
    """The plan with the training arguments' recompute and bf16 requests folded in (module docstring)."""
    if getattr(args, "activation_checkpointing", False) and plan.activation_checkpointing == "none":
        plan = dataclasses.replace(plan, activation_checkpointing="full")
    if getattr(args, "bf16", False) and plan.param_dtype == "float32":
        plan = dataclasses.replace(plan, param_dtype="bfloat16")
    return plan


def argument_problems(args: Any, plan: Plan) -> list[str]:
    """Every training argument that conflicts with running under `plan`, each with its fix."""
    if args is None:
        return []
    problems = []

    def given(name: str) -> Any:
        return getattr(args, name, None)

    if given("deepspeed"):
        problems.append(f"deepspeed={given('deepspeed')!r} with plan=: meshkit shards the model itself; fix: drop "
                        "deepspeed (ZeRO stages are Plan(zero=1|2|3), offload Plan(offload=...))")
    if given("fsdp") or given("fsdp_plugin_args"):
        problems.append(f"fsdp={given('fsdp')!r} with plan=: meshkit applies FSDP2 itself; fix: drop fsdp/fsdp_config "
                        "(sharded data parallel is Plan(dp_shard=...))")
    if given("parallelism_config") is not None:
        problems.append("parallelism_config with plan=: the plan is the whole layout; fix: drop parallelism_config "
                        "and put its degrees into the Plan (dp_replicate, dp_shard, cp, tp)")
    if given("fp16"):
        problems.append("fp16=True with plan=: float16 training needs loss scaling, which meshkit does not do; fix: "
                        "bf16=True or Plan(param_dtype='bfloat16') (fp32 master weights, fp32 gradient reduction)")
    if given("torch_compile"):
        problems.append("torch_compile=True with plan=: fix: Plan(compile=True), which compiles each block")
    if given("use_liger_kernel"):
        problems.append("use_liger_kernel=True with plan=: Liger replaces the model's forward, which meshkit drives; "
                        "fix: use_liger_kernel=False")
    if given("neftune_noise_alpha") is not None:
        problems.append("neftune_noise_alpha with plan=: the embedding noise would be drawn differently by ranks "
                        "that share a batch; fix: neftune_noise_alpha=None")
    if given("train_sampling_strategy") == "batch_rebalance":
        problems.append("train_sampling_strategy='batch_rebalance' with plan=: that sampler shards by process, not "
                        "by data rank; fix: 'random', 'sequential' or 'group_by_length'")
    if given("average_tokens_across_devices") is False:
        problems.append("average_tokens_across_devices=False with plan=: meshkit's loss is always the global token "
                        "mean (the data ranks' valid targets counted together); fix: average_tokens_across_devices="
                        "True (the default)")
    if given("precompute_ref_log_probs"):
        problems.append("precompute_ref_log_probs=True with plan=: TRL precomputes them before meshkit shards the "
                        "reference model; fix: precompute_ref_log_probs=False (the reference runs under the same "
                        "plan)")
    dispatch = getattr(given("accelerator_config"), "dispatch_batches", None)
    if dispatch:
        problems.append("accelerator_config.dispatch_batches=True with plan=: rank 0 would send every rank its rows "
                        "over the whole world; fix: dispatch_batches=False (each data rank loads its own rows)")
    per_device = given("per_device_train_batch_size")
    if plan.pp > 1 and isinstance(per_device, int) and per_device % plan.microbatches:
        problems.append(f"per_device_train_batch_size={per_device} with pp={plan.pp}: the rows of a data rank split "
                        f"into pp_microbatches={plan.microbatches}; fix: a multiple of {plan.microbatches}")
    return problems


def optimizer_problem(optimizer_kwargs: Mapping[str, Any], name: Any) -> str | None:
    """Whether transformers' optimizer choice builds itself from the model instead of pm.parameters()."""
    chosen = sorted(set(_SELF_BUILDING) & set(optimizer_kwargs))
    if chosen:
        return (f"optim={name!r} builds its parameter groups itself ({chosen}), around meshkit's sharded parameters; "
                "fix: a torch optimizer (optim='adamw_torch', 'sgd', ...), or parallelize the model yourself and pass "
                "optimizers=(opt, None) built over pm.parameters()")
    return None
