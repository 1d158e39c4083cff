"""float8 training of the decoder blocks' projections (`Plan.float8`), through torchao.

`apply_float8` swaps each held block's projections for torchao's `Float8Linear` (`convert_to_float8_training`
with a `module_filter_fn`) before tensor parallelism shards them, as torchtitan orders it:

- Which linears: the q/k/v/o and gate/up/down projections, read by role (`models.roles`): colwise and
  rowwise linears that TP splits plainly. The embedding, the LM head, the norms and every MoE layer
  (router, grouped-GEMM experts, shared expert: its weights are whole on every tp rank, so its
  activation scales could not be global over tp) stay in high precision, and so do packed projections
  and replicated K/V rows (`tensor_parallel.rows`), which meshkit multiplies by row selection.
- Scales: torchao's dynamic scaling, per tensor or per row. Activation scales come from the tokens a
  rank holds, so a data-parallel run equals one device running each data rank's rows separately, not
  one device on the global batch. Under TP the linears are DTensor modules and every amax is reduced
  over the sharded tensor: the scales are global, as on one device. float8 plans take the DTensor
  styles, never the local-shard path (`tensor_parallel.path`), whose plain shards would scale per rank.
- FSDP: with "tensorwise" the weights all-gather in float8 (`enable_fsdp_float8_all_gather`), each shard
  cast with the scale of the whole weight, which `apply_float8_scales` recomputes (one all-reduce of
  every weight's amax per stage) before each forward gathers them, so a scale is never a step stale.
- Selective checkpointing keeps `_scaled_mm` outputs and the amax reductions the casts use
  (`activation_checkpoint.is_saved_op`), so recompute neither re-reduces nor re-scales.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from meshkit._compat.float8 import torchao_float8
from meshkit.expert_parallel import MoE
from meshkit.float8.rules import linear_dim_problems
from meshkit.models import roles as roles_lib

_CONVERTED_ROLES = ("colwise", "kv_colwise", "rowwise")


def float8_linears(block: nn.Module, config, tp: int) -> dict[str, tuple[nn.Linear, str]]:
    """{name in block: (linear, role)} of the projections float8 converts (see the module docstring)."""
    roles = roles_lib.block_roles(block, config)
    rows = roles_lib.selected_rows(roles, config, tp, 0) if tp > 1 else {}
    moe_prefixes = tuple(f"{name}." for name, m in block.named_modules() if isinstance(m, MoE))
    modules = dict(block.named_modules())
    return {name: (modules[name], role) for name, role in roles.items()
            if role in _CONVERTED_ROLES and name not in rows and isinstance(modules.get(name), nn.Linear)
            and not name.startswith(moe_prefixes)}


def module_problems(blocks: Iterable[nn.Module], config, tp: int, recipe: str) -> list[str]:
    """Converted linears whose per-rank dims (after TP's split) are not multiples of 16; each named once."""
    problems: list[str] = []
    for block in blocks:
        for name, (linear, role) in float8_linears(block, config, tp).items():
            i, o = linear.in_features, linear.out_features
            i, o = (i // tp, o) if role == "rowwise" else (i, o // tp)
            for problem in linear_dim_problems(name, i, o, recipe):
                if problem not in problems:
                    problems.append(problem)
    return problems


def float8_config(recipe: str, fsdp_float8_all_gather: bool):
    """torchao's config for `recipe`; FSDP all-gathers float8 weights only with per-tensor scales."""
    ao = torchao_float8()
    config = ao.Float8LinearConfig.from_recipe_name(recipe)
    if fsdp_float8_all_gather and recipe == "tensorwise":
        config = ao.Float8LinearConfig(**{**vars(config), "enable_fsdp_float8_all_gather": True})
    return config


def apply_float8(blocks: Iterable[nn.Module], config, *, recipe: str, tp: int, fsdp: bool) -> None:
    """Convert the projections of `blocks` in place to torchao's `Float8Linear` (their parameters, and
    so their state-dict names, are kept). `fsdp`: whether FSDP will shard them (tensorwise weights then
    all-gather in float8)."""
    ao = torchao_float8()
    ao_config = float8_config(recipe, fsdp)
    blocks = list(blocks)
    chosen = {id(linear) for block in blocks for linear, _ in float8_linears(block, config, tp).values()}
    for block in blocks:
        ao.convert_to_float8_training(block, config=ao_config, module_filter_fn=lambda m, _fqn: id(m) in chosen)


def gathers_in_float8(recipe: str, fsdp: bool) -> bool:
    """Whether FSDP's all-gathers move float8 weights (tensorwise scales under FSDP)."""
    return recipe == "tensorwise" and fsdp


def _precompute_scales(stage: nn.Module, *_args) -> None:
    torchao_float8().precompute_float8_dynamic_scale_for_fsdp(stage)


def apply_float8_scales(stages: Iterable[nn.Module]) -> None:
    """Before every forward of each stage, recompute the float8 weights' scales from the current
    (stepped) weights, so the next all-gather casts with them: a pre-hook on the stage, which runs
    before any of its blocks' all-gathers (FSDP gathers each block in the block's own pre-forward)."""
    for stage in stages:
        stage.register_forward_pre_hook(_precompute_scales)
