"""The rules a Plan's context-parallel options must satisfy, among themselves and against a model's heads.

Pure functions returning every violation with its fix, as `Plan.validate` collects them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from meshkit.plan import Plan


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


def head_problems(plan: Plan, config: Any) -> list[str]:
    """Whether Ulysses (alone, in USP or inside the all-gather kind) can spread each tp rank's query heads."""
    problems: list[str] = []
    heads, tp = config.num_attention_heads, plan.tp
    degree = plan.ulysses_degree
    if plan.cp > 1 and degree > 1 and (heads // tp) % degree:
        problems.append(
            f"cp_attention={plan.cp_attention!r}: Ulysses spreads the {heads // tp} query heads each tp rank holds "
            f"over {degree} ranks, and {degree} does not divide them; fix: use cp_attention='zigzag' or 'ring', or "
            f"a Ulysses degree that divides {heads // tp}"
        )
    return problems
