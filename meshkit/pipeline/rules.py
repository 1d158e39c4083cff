"""The rules a Plan's pipeline options must satisfy, among themselves and against a model's layers.

Each returns every violation with its fix (never raises), so `Plan.validate` lists all of them in one
`PlanError`; pure functions of the plan and the config, so every rank reaches the same verdict.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
            where = "one chunk of each direction" if plan.pp_schedule == "dualpipe" else "stage r and 2*pp-1-r"
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


def layer_problems(plan: Plan, config: Any) -> list[str]:
    """Whether the model has enough decoder layers for the plan's stages, and whether `pp_split`
    fits its layer count (checked with the plan, so no rank builds a mesh first)."""
    problems: list[str] = []
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
            try:
                split_layers(config.num_hidden_layers, stages, plan.pp_split)
            except ValueError as err:
                problems.append(str(err))
    return problems
