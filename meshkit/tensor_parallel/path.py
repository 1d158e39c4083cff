"""Which implementation a plan's plain TP blocks take: local shards (`tensor_parallel.local`) or the
DTensor ParallelStyles (`tensor_parallel.styles`).

The local-shard path swaps each sharded module's DTensor parameters for their local shards while it
runs. Two things cannot see through that swap: torch.compile (dynamo would trace the parameter
swap) and schedules that split B from W (their deferred weight gradients wrap plain `nn.Linear`
forwards, which the local path replaces). Blocks the local path cannot express (q/k norms,
replicated K/V rows, packed projections, MoE) keep the styles whatever this says. float8 plans take
the styles too: torchao's float8 linears reduce their scales over a DTensor's shards, and a local shard
would scale per rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshkit.pipeline.schedules import splits_weight_grad

if TYPE_CHECKING:
    from meshkit.plan import Plan


def runs_on_local_shards(plan: Plan) -> bool:
    """Whether plain TP blocks of `plan` may run on local shards."""
    if plan.compile or plan.float8 != "none":
        return False
    return plan.pp == 1 or not splits_weight_grad(plan.pp_schedule)
