"""The rules a model config imposes on a Plan: heads, ffn and vocabulary that TP must split, experts per
ep rank, dropout. (Attention quirks impose none: sliding windows, soft-capping and sinks run under
every context-parallel kind, and multi-head latent attention under tp.)

Pure functions returning every violation with its fix, as `Plan.validate` collects them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from meshkit.expert_parallel.placement import expert_split_problem
from meshkit.models import roles
from meshkit.models.moe import moe_spec

if TYPE_CHECKING:
    from meshkit.plan import Plan

_NEEDED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")


def unsupported_config(config: Any) -> str | None:
    """Why `config` is not a decoder config the other rules can read, or None."""
    missing = [n for n in _NEEDED if getattr(config, n, None) is None]
    if not missing:
        return None
    return (f"model config {type(config).__name__} lacks {missing}: meshkit supports Llama-family decoder configs "
            f"(Llama, Qwen2/3, Mistral); fix: pass such a model")


def model_problems(plan: Plan, config: Any) -> list[str]:
    """What a model config rules out: heads, ffn and vocabulary TP must split, experts per ep rank,
    dropout."""
    problems = []
    tp = plan.tp
    if tp > 1:
        heads_problem = roles.tp_degree_problem(config, tp)
        if heads_problem:
            problems.append(heads_problem)
        for name, value in (("intermediate_size", config.intermediate_size),):
            if value % tp:
                divisors = [d for d in range(1, value + 1) if value % d == 0]
                problems.append(
                    f"tp={tp}: tensor parallelism splits {name}={value} across ranks, and {tp} does not divide "
                    f"it; fix: use a tp in {divisors}"
                )
        if config.vocab_size % tp:
            problems.append(
                f"tp={tp}: the vocab-parallel embedding and LM head split vocab_size={config.vocab_size}, and {tp} does "
                f"not divide it; fix: pad the vocabulary to {math.ceil(config.vocab_size / tp) * tp}"
            )
    spec = moe_spec(config)
    ep_problem = expert_split_problem(plan.ep, spec.num_experts) if spec is not None and plan.ep > 1 else None
    if ep_problem:
        problems.append(ep_problem)
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        problems.append(
            f"attention_dropout={dropout}: dropout makes sharded and single-device runs differ and is not "
            "supported; fix: set config.attention_dropout=0.0"
        )
    return problems
