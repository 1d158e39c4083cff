"""Per-action costs of the real stages, measured once and agreed on by every rank: zb_auto's input.

zb_auto builds its order from the time of each stage's F, B and W and of one P2P transfer. Given in
the plan (`Plan.pp_costs`), they are used as they are. Otherwise the first `forward_backward` is the
profiling run: it runs the schedule built at unit costs with the runtime's trace on (the model's
own work of every F, B and W, `runtime.TraceEvent` "stage"), then each pipeline pair (0, 1), (2, 3),
... bounces one boundary activation a few times to time a transfer, and every rank of the world
gathers every rank's medians. Every rank then computes the same table from the same gathered
numbers (per stage, the median over the ranks running it; times rounded to whole microseconds), so
every rank builds the same schedule: ranks of different pipeline replicas must agree too, since tp,
cp, ep and FSDP collectives inside a stage pair up across them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshkit.pipeline.actions import Action, ActionKind, Schedule
from meshkit.pipeline.p2p import TensorMeta
from meshkit.pipeline.runtime import TraceEvent
from meshkit.pipeline.schedules import build_schedule, forward_only
from meshkit.pipeline.simulate import Costs

if TYPE_CHECKING:
    from meshkit.plan import Plan

K = ActionKind
_KINDS = (K.F, K.B, K.W)
PING_ROUNDS = 5


@dataclass(frozen=True)
class StageTable(Costs):
    """Costs per stage: `table[s]` is stage s's (F, B, W); a full backward BW costs B + W."""

    table: tuple[tuple[Fraction, Fraction, Fraction], ...] = ()

    def duration(self, action: Action) -> Fraction:
        """Stage `action.stage`'s time for the action's kind (sends and receives cost nothing here)."""
        f, b, w = self.table[action.stage]
        return {K.F: f, K.B: b, K.W: w, K.BW: b + w}.get(action.kind, Fraction(0))


def given(costs: Sequence[float]) -> Costs:
    """The plan's `pp_costs` (F, B, W[, P2P] in any one unit) as exact simulator costs."""
    f, b, w, *rest = (Fraction(str(c)) for c in costs)
    return Costs(f, b, w, rest[0] if rest else 0)


def local_times(trace: Sequence[TraceEvent], num_stages: int) -> list[float]:
    """This rank's median stage time (seconds) of F, B and W per stage, NaN for stages it does not run."""
    spans: dict[tuple[int, ActionKind], list[float]] = {}
    for event in trace:
        if event.kind == "stage" and isinstance(event.what, Action) and event.what.kind in _KINDS:
            spans.setdefault((event.what.stage, event.what.kind), []).append(event.end - event.start)
    return [statistics.median(spans[(s, k)]) if (s, k) in spans else math.nan
            for s in range(num_stages) for k in _KINDS]


def p2p_time(pp_group: dist.ProcessGroup, meta: TensorMeta, device: torch.device) -> float:
    """Half the median round trip of one boundary activation between pp ranks 2k and 2k+1 (NaN on the
    others). Collective over the pipeline group: every rank calls it."""
    rank, size = dist.get_rank(pp_group), dist.get_world_size(pp_group)
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    if peer >= size:
        return math.nan
    buffer = torch.zeros(meta.shape, dtype=meta.dtype, device=device)
    other = dist.get_global_rank(pp_group, peer)
    trips = []
    for _ in range(PING_ROUNDS):
        start = time.perf_counter()
        if rank % 2 == 0:
            dist.send(buffer, other, group=pp_group)
            dist.recv(buffer, other, group=pp_group)
        else:
            dist.recv(buffer, other, group=pp_group)
            dist.send(buffer, other, group=pp_group)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips) / 2 if rank % 2 == 0 else math.nan


def agree(local: Sequence[float], num_stages: int, device: torch.device) -> StageTable:
    """Every rank's `local_times` + [its `p2p_time`] gathered over the world, reduced to one table.

    Collective over the default group. The reduction runs on identical gathered numbers, so its
    result (and every schedule built from it) is the same on every rank.
    """
    mine = torch.tensor(list(local), dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    rows = torch.stack(every).cpu().tolist()

    def micros(column: int, fallback: int = 1) -> Fraction:
        values = [row[column] for row in rows if not math.isnan(row[column])]
        return Fraction(max(round(statistics.median(values) * 1e6), 1)) if values else Fraction(fallback)

    table = tuple(tuple(micros(3 * s + k) for k in range(3)) for s in range(num_stages))
    p2p = micros(3 * num_stages, fallback=0)
    return StageTable(1, 1, 1, p2p, table=table)


class PlanSchedules:
    """The schedule a pipelined Plan trains with, and its forward-only part for evaluation.

    zb_auto without `pp_costs` starts from its unit-cost schedule; the first training call asks for a
    trace (`trace_for`) and hands it back (`measured`), which agrees on the costs over the world and
    rebuilds both schedules from them."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.profiling = plan.pp_schedule == "zb_auto" and not plan.pp_costs
        self._build(given(plan.pp_costs) if plan.pp_costs else None)

    def _build(self, costs: Costs | None) -> None:
        plan = self.plan
        self.train = build_schedule(plan.pp_schedule, plan.pp, plan.microbatches, plan.pp_virtual_stages,
                                    costs=costs, memory_limit=plan.pp_memory_limit)
        self.evaluate = forward_only(self.train)

    def trace_for(self, schedule: Schedule) -> list[TraceEvent] | None:
        """A list for `run_schedule(trace=...)` when this call of `schedule` is the profiling run, else None."""
        return [] if self.profiling and not schedule.forward_only else None

    def measured(self, trace: list[TraceEvent], pp_group: dist.ProcessGroup, meta: TensorMeta,
                 device: torch.device) -> None:
        """After the profiling run: time a transfer, agree on every rank's numbers, rebuild (collective
        over the world)."""
        local = local_times(trace, self.train.num_stages)
        local.append(p2p_time(pp_group, meta, device))
        self._build(agree(local, self.train.num_stages, device))
        self.profiling = False


__all__ = ["PING_ROUNDS", "PlanSchedules", "StageTable", "agree", "given", "local_times", "p2p_time"]
