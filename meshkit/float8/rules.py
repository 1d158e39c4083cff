"""What `Plan.float8` may take and what it needs of the plan and the model.

A leaf (it reads a config through `models.roles` and `models.moe` only) so that `plan.py` checks it at
construction and in `validate`, on every rank, before any collective. Each function returns every
violation with its fix and never raises.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from meshkit.models.moe import moe_spec
from meshkit.models.roles import attention_dims, local_kv_heads

if TYPE_CHECKING:
    from meshkit.plan import Plan

# "tensorwise": one dynamic scale per tensor (FSDP all-gathers the weights in float8); "rowwise": one per
# row of each operand, power-of-two scales (FSDP gathers the high-precision weights).
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
# torch._scaled_mm (cuBLASLt) multiplies float8 matrices whose dims are multiples of 16.
FLOAT8_MULTIPLE = 16


def float8_problems(plan: Plan) -> list[str]:
    """The float8 option's value, torchao's presence, and the plans it contradicts (a Plan's own fields)."""
    if plan.float8 not in FLOAT8_RECIPES:
        return [f"float8={plan.float8!r}: must be one of {FLOAT8_RECIPES}"]
    if plan.float8 == "none":
        return []
    problems = []
    if importlib.util.find_spec("torchao") is None:
        problems.append(f"float8={plan.float8!r}: float8 training runs through torchao, which is not installed; "
                        "fix: pip install 'meshkit[float8]' (or torchao), or float8='none'")
    if plan.float8 == "rowwise" and plan.tp > 1:
        problems.append(
            f"float8='rowwise' with tp={plan.tp}: row-wise scales of the rowwise-split linears (o_proj, down_proj) "
            "would each be taken over one tp rank's slice of the row, not the whole row; fix: float8='tensorwise' "
            "(its scales reduce over the sharded tensor) or tp=1")
    return problems


def linear_dim_problems(name: str, in_features: int, out_features: int, recipe: str) -> list[str]:
    """Why a linear of this rank's shape (after TP) cannot multiply in float8, or nothing."""
    bad = [f"{what}={n}" for what, n in (("in_features", in_features), ("out_features", out_features))
           if n % FLOAT8_MULTIPLE]
    if not bad:
        return []
    return [f"float8={recipe!r}: {name} has {' and '.join(bad)} on each tp rank, and float8 matmuls "
            f"(torch._scaled_mm) need multiples of {FLOAT8_MULTIPLE}; fix: float8='none', another tp, or a model "
            f"whose hidden, head and ffn dims are multiples of {FLOAT8_MULTIPLE} per tp rank"]


def config_problems(plan: Plan, config: Any) -> list[str]:
    """The dense Llama-family projections' per-rank shapes against float8's multiple of 16 (the module
    check at `parallelize` reads every converted linear; this one lets `validate` and the plan search
    see the common case from a config alone)."""
    if plan.float8 == "none" or getattr(config, "hidden_size", None) is None:
        return []
    tp, hidden = plan.tp, config.hidden_size
    heads, _, head_dim = attention_dims(config)
    shapes = {"q_proj": (hidden, heads * head_dim // tp), "k_proj": (hidden, local_kv_heads(config, tp) * head_dim),
              "o_proj": (heads * head_dim // tp, hidden)}
    if moe_spec(config) is None:  # MoE layers stay in high precision
        shapes.update(gate_proj=(hidden, config.intermediate_size // tp), down_proj=(config.intermediate_size // tp, hidden))
    return [p for name, (i, o) in shapes.items() for p in linear_dim_problems(name, i, o, plan.float8)]
