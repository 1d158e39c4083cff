"""The rules a Plan must satisfy among its own options and against a model config.

Each returns every violation with its fix (never raises), so `Plan.validate` can list all of them in
one `PlanError`. Pure functions of the plan and the config: every rank reaches the same verdict.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from meshkit.expert_parallel import expert_split_problem
from meshkit.models import llama, roles
from meshkit.models.moe import moe_spec
from meshkit.pipeline.bidirectional import dualpipe_problem
from meshkit.pipeline.split import split_layers

if TYPE_CHECKING:
    from meshkit.plan import Plan


def pp_problems(plan: Plan) -> list[str]:
    """Pipeline options that contradict each other (schedule, virtual stages, microbatches, split)."""
    problems = []
    v, m = plan.pp_virtual_stages, plan.microbatches
    if plan.pp_schedule == "interleaved_1f1b":
        if plan.pp > 1 and v < 2:
            problems.append(
                f"pp_virtual_stages={v}: interleaved_1f1b runs several stages per rank; fix: pp_virtual_stages=2 "
                f"or more, or pp_schedule='1f1b'"
            )
        if plan.pp > 1 and m < plan.pp:
            problems.append(
                f"pp_microbatches={m}: interleaved 1F1B needs at least pp={plan.pp} microbatches; fix: "
                f"pp_microbatches={plan.pp} or more"
            )
    elif plan.pp_schedule in ("zb_v", "dualpipe_v", "dualpipe"):
        if v not in (1, 2):
            where = ("one chunk of each direction" if plan.pp_schedule == "dualpipe" else
                     "stage r and 2*pp-1-r")
            problems.append(
                f"pp_virtual_stages={v} with pp_schedule={plan.pp_schedule!r}: it always holds two stages per "
                f"rank ({where}); fix: leave pp_virtual_stages at 1 or set it to 2"
            )
        if plan.pp_schedule == "dualpipe_v" and plan.pp > 1 and m < 2 * plan.pp:
            problems.append(
                f"pp_microbatches={m}: DualPipeV needs at least 2*pp={2 * plan.pp} microbatches; fix: "
                f"pp_microbatches={2 * plan.pp} or more, or pp_schedule='zb_v'"
            )
        problem = dualpipe_problem(plan.pp, m) if plan.pp_schedule == "dualpipe" and plan.pp > 1 else None
        if problem:
            problems.append(problem)
    elif v != 1:
        problems.append(
            f"pp_virtual_stages={v} with pp_schedule={plan.pp_schedule!r}: only interleaved_1f1b runs several "
            f"stages per rank; fix: pp_virtual_stages=1 or pp_schedule='interleaved_1f1b'"
        )
    if plan.pp_schedule != "zb_auto":
        for name in ("pp_memory_limit", "pp_costs"):
            if getattr(plan, name) not in (None, ()):
                problems.append(f"{name}={getattr(plan, name)!r}: only pp_schedule='zb_auto' builds its schedule from a "
                                f"memory limit and costs; fix: pp_schedule='zb_auto', or leave {name} unset")
    chunks = plan.pp_chunks if plan.pp > 1 else plan.pp * plan.pp_stages_per_rank
    if plan.pp_split and len(plan.pp_split) != chunks - 1:
        problems.append(
            f"pp_split={list(plan.pp_split)}: {chunks} stages need {chunks - 1} split points (the first "
            f"layer of every stage after the first)"
        )
    return problems


def cp_problems(plan: Plan) -> list[str]:
    """Context-parallel options that contradict each other (the Ulysses x outer split of cp)."""
    problems = []
    if plan.cp_attention == "usp":
        if plan.cp > 1 and (plan.cp_ulysses < 2 or plan.cp_ulysses >= plan.cp or plan.cp % plan.cp_ulysses):
            divisors = [d for d in range(2, plan.cp) if plan.cp % d == 0]
            problems.append(
                f"cp_ulysses={plan.cp_ulysses}: USP runs Ulysses over cp_ulysses ranks and a ring over "
                f"cp/cp_ulysses, so cp_ulysses must be a proper divisor of cp={plan.cp} above 1; fix: use one of "
                f"{divisors or 'none (use cp_attention=ulysses or zigzag)'}"
            )
    elif plan.cp_attention == "allgather":
        # Ulysses inside, the K/V all-gather over the cp/cp_ulysses outer ranks; 1 = no Ulysses.
        if plan.cp > 1 and (plan.cp_ulysses >= plan.cp or plan.cp % plan.cp_ulysses):
            divisors = [d for d in range(1, plan.cp) if plan.cp % d == 0]
            problems.append(
                f"cp_ulysses={plan.cp_ulysses}: cp_attention='allgather' runs Ulysses over cp_ulysses ranks and "
                f"gathers K/V over cp/cp_ulysses, so cp_ulysses must be a divisor of cp={plan.cp} below it; fix: "
                f"use one of {divisors}"
            )
    elif plan.cp_ulysses != 1:
        problems.append(
            f"cp_ulysses={plan.cp_ulysses}: only cp_attention='usp' or 'allgather' splits cp into Ulysses x "
            f"ring; fix: set cp_ulysses=1, or cp_attention='usp' or 'allgather'"
        )
    if plan.cp_keep_kv is True and plan.cp_attention not in ("ring", "zigzag"):
        problems.append(
            f"cp_keep_kv=true with cp_attention={plan.cp_attention!r}: only the ring kinds send K/V again in "
            f"backward (the all-gather kind keeps what it gathered, Ulysses moves heads); fix: "
            f"cp_attention='ring' or 'zigzag', or cp_keep_kv=false"
        )
    return problems


def model_problems(plan: Plan, config: Any) -> list[str]:
    """What a model config rules out: heads, ffn and vocabulary TP must split, layers per stage,
    experts per ep rank, heads per Ulysses rank, dropout."""
    problems = []
    need = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")
    missing = [n for n in need if getattr(config, n, None) is None]
    if missing:
        return [f"model config {type(config).__name__} lacks {missing}: meshkit supports Llama-family "
                f"decoder configs (Llama, Qwen2/3, Mistral); fix: pass such a model"]
    heads = config.num_attention_heads
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
    stages = plan.pp_chunks
    if stages > 1:
        if config.num_hidden_layers + 2 < stages:
            per_rank = f" x {plan.pp_stages_per_rank} stages per rank" if stages > plan.pp else ""
            problems.append(
                f"pp={plan.pp}{per_rank}: {stages} pipeline stages need at least "
                f"{stages - 2} decoder layers (embedding and head count as one each); the model has "
                f"{config.num_hidden_layers}; fix: fewer stages"
            )
        elif plan.pp_split and len(plan.pp_split) == stages - 1:
            # The split points only mean something against the model's layer count: checked here, with the
            # plan, so validate() reports them before any rank builds a mesh.
            try:
                split_layers(config.num_hidden_layers, stages, plan.pp_split)
            except ValueError as err:
                problems.append(str(err))
    spec = moe_spec(config)
    ep_problem = expert_split_problem(plan.ep, spec.num_experts) if spec is not None and plan.ep > 1 else None
    if ep_problem:
        problems.append(ep_problem)
    degree = plan.ulysses_degree
    if plan.cp > 1 and degree > 1 and (heads // tp) % degree:
        problems.append(
            f"cp_attention={plan.cp_attention!r}: Ulysses spreads the {heads // tp} query heads each tp rank holds "
            f"over {degree} ranks, and {degree} does not divide them; fix: use cp_attention='zigzag' or 'ring', or "
            f"a Ulysses degree that divides {heads // tp}"
        )
    problems += llama.check_config(config, None, plan.cp_attention if plan.cp > 1 else None)
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if dropout > 0:
        problems.append(
            f"attention_dropout={dropout}: dropout makes sharded and single-device runs differ and is not "
            "supported; fix: set config.attention_dropout=0.0"
        )
    return problems
