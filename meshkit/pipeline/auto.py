"""zb_auto: a zero-bubble schedule built for measured costs and a memory limit (Zero Bubble, section 3.1).

The handcrafted ZB-H1 and ZB-H2 are right for TF = TB = TW; with real costs (a heavier LM-head stage,
W cheaper than B, a P2P latency) the gaps fall elsewhere. The Zero Bubble paper builds the schedule
from the measured F, B, W and P2P times and a memory limit with a heuristic (and an ILP seeded by it).
`zb_auto` is that heuristic, written from the paper's description, one stage per rank:

- warm-up: every rank runs microbatch 0's forward, then as many further forwards as fit before its
  first B can arrive, within the memory limit; stage r always keeps at least one forward more than
  stage r+1. A binary knob says whether a forward that would end after the B arrives may still go.
- steady phase, microbatch by microbatch: each rank adds one forward (top down) and microbatch i's B
  (bottom up). Before each, deferred Ws fill the rank's wait for that action's input when they fit
  whole; a knob says whether a W that does not fit still goes when the rank's idle so far is already
  the largest of all ranks (the paper's "largest cumulative bubble" rule); and a W always goes first
  when a forward would exceed the memory limit. A knob lets a rank two or more forwards ahead of the
  next skip its forward when it would delay its next B.
- drain: the remaining Ws.

Every combination of the three knobs, plus a timed greedy list scheduling under the same limit
(`list_schedule`, at these costs and at unit costs), is timed exactly in the simulator's execution
model (`step_time`, in integer ticks, with the P2P latency), and the fastest schedule whose peak stays
within the limit is kept (ties: the lower peak, then the candidates' order); `schedules.zb_auto` adds
ZB-H1 and ZB-H2 where they fit. The memory limit counts microbatches whose activations a rank holds, from F until W,
as `SimulationResult.peak_activations` does; it must be at least 1 (one microbatch at a time: the
rank waits for each backward before the next forward). The paper's exact ILP is not implemented: it
needs a MILP solver, and none is a dependency of meshkit.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from fractions import Fraction

from meshkit.pipeline.actions import Action, ActionKind, Schedule, compute_only, with_communication
from meshkit.pipeline.simulate import Costs, check

ZB_AUTO = "zb_auto"
F, B, W = ActionKind.F, ActionKind.B, ActionKind.W
MIN_MEMORY_LIMIT = 1


def memory_limit_problem(limit: int | None) -> str | None:
    """Why `pp_memory_limit` cannot bound a zb_auto schedule, with the fix; None if it can (None = default)."""
    if limit is None:
        return None
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < MIN_MEMORY_LIMIT:
        return (f"pp_memory_limit={limit!r}: zb_auto's limit counts the microbatches whose activations a rank holds at "
                f"once (from F until W); every schedule holds at least one, so the smallest valid value is "
                f"{MIN_MEMORY_LIMIT}; fix: pp_memory_limit={MIN_MEMORY_LIMIT} or more (default: pp, 1F1B's first rank)")
    return None


def ticks(pp: int, costs: Costs) -> tuple[list[dict[ActionKind, int]], int]:
    """Each stage's F, B and W time and the P2P latency as integers (all scaled by one common factor):
    exact, and an order of magnitude faster than Fractions in the builders' inner loops. The costs are
    read per (kind, stage), from microbatch 0."""
    times = [{k: Fraction(costs.duration(Action(k, s, 0))) for k in (F, B, W)} for s in range(pp)]
    scale = math.lcm(Fraction(costs.p2p_latency).denominator, *(t.denominator for d in times for t in d.values()))
    return [{k: int(t * scale) for k, t in d.items()} for d in times], int(costs.p2p_latency * scale)


class _Builder:
    """One run of the heuristic for one setting of the knobs: per-rank orders and their end times."""

    def __init__(self, pp: int, m: int, costs: Costs, limit: int, knobs: tuple[bool, bool, bool]):
        self.pp, self.m, self.limit = pp, m, limit
        self.late_forward, self.skip_forward, self.fill_partial = knobs
        self.times, self.latency = ticks(pp, costs)
        self.end = [0] * pp  # when each rank is next free
        self.done: dict[tuple[ActionKind, int, int], int] = {}
        self.forwards, self.backwards = [0] * pp, [0] * pp
        self.pending: list[deque[int]] = [deque() for _ in range(pp)]
        self.idle = [0] * pp
        self.orders: list[list[Action]] = [[] for _ in range(pp)]

    def cost(self, kind: ActionKind, r: int, mb: int) -> int:
        return self.times[r][kind]

    def held(self, r: int) -> int:
        return self.forwards[r] - (self.backwards[r] - len(self.pending[r]))

    def ready(self, kind: ActionKind, r: int, mb: int) -> int | None:
        """When the input of (kind, r, mb) is there, or None if its producer is not placed yet."""
        if kind is F:
            return 0 if r == 0 else self._arrival((F, r - 1, mb))
        if kind is B:
            return self.done.get((F, r, mb)) if r == self.pp - 1 else self._arrival((B, r + 1, mb))
        return self.done.get((B, r, mb))

    def _arrival(self, key: tuple[ActionKind, int, int]) -> int | None:
        end = self.done.get(key)
        return None if end is None else end + self.latency

    def put(self, kind: ActionKind, r: int) -> None:
        mb = {F: self.forwards, B: self.backwards}[kind][r] if kind is not W else self.pending[r].popleft()
        start = max(self.end[r], self.ready(kind, r, mb))
        if self.forwards[r] > 0:
            self.idle[r] += start - self.end[r]
        self.end[r] = self.done[(kind, r, mb)] = start + self.cost(kind, r, mb)
        self.orders[r].append(Action(kind, r, mb))
        if kind is F:
            self.forwards[r] += 1
        elif kind is B:
            self.backwards[r] += 1
            self.pending[r].append(mb)

    def fill(self, r: int, kind: ActionKind) -> None:
        """Ws before the next `kind` on rank r: to free memory for a forward, then into the wait for its input."""
        mb = (self.forwards if kind is F else self.backwards)[r]
        if kind is F:
            while self.held(r) + 1 > self.limit and self.pending[r]:
                self.put(W, r)
        arrives = self.ready(kind, r, mb)
        while self.pending[r] and self.end[r] + self.cost(W, r, self.pending[r][0]) <= arrives:
            self.put(W, r)
        if self.pending[r] and self.end[r] < arrives:
            # The first stage's B feeds no one: once its forwards are done, a late B costs nothing.
            free = r == 0 and self.forwards[r] == self.m
            if free or (self.fill_partial and self.idle[r] + (arrives - self.end[r]) >= max(self.idle)):
                self.put(W, r)

    def warm_up(self) -> None:
        pp, m = self.pp, self.m
        for r in range(pp):
            self.put(F, r)
        extra = [0] * pp
        b_arrives = 0
        for r in reversed(range(pp)):
            if r == pp - 1:
                b_arrives = self.done[(F, r, 0)] + self.cost(B, r, 0)
                continue
            arrives, busy = b_arrives + self.latency, self.end[r]
            while self.forwards[r] + extra[r] < m and self.held(r) + extra[r] + 1 <= self.limit:
                step = self.cost(F, r, self.forwards[r] + extra[r])
                if (busy + step > arrives) if not self.late_forward else (busy >= arrives):
                    break
                busy += step
                extra[r] += 1
            b_arrives = max(busy, arrives) + self.cost(B, r, 0)
        for r in range(1, pp):  # stage r keeps at least one forward more than stage r+1
            extra[r] = max(0, min(extra[r], extra[r - 1] - 1))
        for r in range(pp):
            for _ in range(extra[r]):
                self.put(F, r)
        for r in reversed(range(pp)):
            self.put(B, r)

    def steady(self, i: int) -> None:
        pp, m = self.pp, self.m
        for r in range(pp):
            f = self.forwards[r]
            if f >= m or (r > 0 and self.forwards[r - 1] <= f):
                continue  # no forward left, or its input is not placed yet
            needed = f <= i  # microbatch i's B below needs it
            if not needed and self.held(r) + 1 > self.limit and not self.pending[r]:
                continue
            if not needed and self.skip_forward and r + 1 < pp and f >= self.forwards[r + 1] + 2:
                b_arrives = self.ready(B, r, self.backwards[r])
                if b_arrives is not None and self.end[r] + self.cost(F, r, f) > b_arrives:
                    continue
            self.fill(r, F)
            self.put(F, r)
        for r in reversed(range(pp)):
            self.fill(r, B)
            self.put(B, r)

    def run(self) -> Schedule:
        self.warm_up()
        for i in range(1, self.m):
            self.steady(i)
        for r in range(self.pp):
            while self.pending[r]:
                self.put(W, r)
        return Schedule(tuple(map(tuple, self.orders)), self.pp, self.m, ZB_AUTO)


def candidates(pp: int, m: int, costs: Costs, limit: int) -> list[Schedule]:
    """The heuristic's schedule for every setting of its three knobs, and the greedy list schedule
    under the same limit (`list_schedule`) at these costs and at unit costs (ZB-H2's order when the
    limit is 2p-1); duplicates dropped."""
    out: list[Schedule] = []
    orders = [_Builder(pp, m, costs, limit, knobs).run().ranks for knobs in itertools.product((False, True), repeat=3)]
    for ranks in [*orders, list_schedule(pp, m, costs, limit), list_schedule(pp, m, Costs(), limit)]:
        schedule = with_communication(Schedule(ranks, pp, m, ZB_AUTO))
        if schedule not in out:
            out.append(schedule)
    return out


def list_schedule(pp: int, m: int, costs: Costs, cap: int) -> tuple[tuple[Action, ...], ...]:
    """Per-rank orders from a timed list scheduling with priorities B > F (under `cap`) > W.

    Each pick is the rank that can start something soonest; an action is ready once what it consumes
    has arrived (the previous stage's F, the next stage's B, plus the P2P latency; its own B for a W).
    B goes first (it is the critical path), then a forward while fewer than `cap` microbatches are held,
    then the oldest deferred W. At unit costs and cap 2p-1 this is ZB-H2 (`schedules.zb_h2`); at
    measured costs it is the greedy counterpart of the phase-by-phase heuristic, which it beats when
    one stage is much slower than the others (it lets every rank run ahead as far as memory allows).
    """
    times, latency = ticks(pp, costs)
    free = [0] * pp
    finished: dict[tuple[ActionKind, int, int], int] = {}
    next_f, next_b, held = [0] * pp, [0] * pp, [0] * pp
    pending_w: list[deque[int]] = [deque() for _ in range(pp)]
    orders: list[list[Action]] = [[] for _ in range(pp)]

    def arrival(key: tuple[ActionKind, int, int], hop: bool) -> int | None:
        end = finished.get(key)
        return None if end is None else end + (latency if hop else 0)

    for _ in range(3 * m * pp):
        best: tuple[int, int, ActionKind, int] | None = None  # (start, rank, kind, microbatch)
        for r in range(pp):
            ready: list[tuple[int, int, ActionKind, int]] = []  # (start, priority, kind, microbatch)
            if next_b[r] < next_f[r]:
                j = next_b[r]
                after = arrival((F, r, j), False) if r == pp - 1 else arrival((B, r + 1, j), True)
                if after is not None:
                    ready.append((max(free[r], after), 0, B, j))
            if next_f[r] < m and held[r] < cap:
                j = next_f[r]
                after = 0 if r == 0 else arrival((F, r - 1, j), True)
                if after is not None:
                    ready.append((max(free[r], after), 1, F, j))
            if pending_w[r]:
                ready.append((free[r], 2, W, pending_w[r][0]))
            if ready:
                start = min(start for start, *_ in ready)
                _, _, kind, j = min(c for c in ready if c[0] == start)
                if best is None or start < best[0]:
                    best = (start, r, kind, j)
        if best is None:  # unreachable: the rank holding the oldest unfinished work can always start it
            raise RuntimeError(f"list scheduling stalled at pp={pp}, microbatches={m}, cap={cap}")
        start, r, kind, j = best
        free[r] = finished[(kind, r, j)] = start + times[r][kind]
        orders[r].append(Action(kind, r, j))
        if kind is F:
            next_f[r] += 1
            held[r] += 1
        elif kind is B:
            next_b[r] += 1
            pending_w[r].append(j)
        else:
            pending_w[r].popleft()
            held[r] -= 1
    return tuple(map(tuple, orders))


def step_time(ranks: tuple[tuple[Action, ...], ...], times: list[dict[ActionKind, int]], latency: int) -> int | None:
    """The step time (in `ticks`) of one-stage-per-rank compute orders, or None if they cannot run: the
    simulator's execution model (sends at their producer's end, a consumer waits for its input plus the
    latency), in integers, to rank the candidates fast (`simulate.simulate` checks the chosen one)."""
    pp, end = len(ranks), {}
    clock, position = [0] * pp, [0] * pp
    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(ranks):
            while position[r] < len(actions):
                a = actions[position[r]]
                if a.kind is F:
                    needed, hop = (None, False) if r == 0 else ((F, r - 1, a.microbatch), True)
                elif a.kind is B:
                    needed, hop = ((F, r, a.microbatch), False) if r == pp - 1 else ((B, r + 1, a.microbatch), True)
                else:
                    needed, hop = (B, r, a.microbatch), False
                if needed is not None and needed not in end:
                    break
                ready = 0 if needed is None else end[needed] + (latency if hop else 0)
                clock[r] = end[(a.kind, r, a.microbatch)] = max(clock[r], ready) + times[r][a.kind]
                position[r] += 1
                progress = True
    return max(clock) if all(p == len(a) for p, a in zip(position, ranks)) else None


def peak(actions: tuple[Action, ...]) -> int:
    """Microbatches one rank holds at most, from F until W (`SimulationResult.peak_activations`)."""
    held = most = 0
    for a in actions:
        held += {F: 1, W: -1}.get(a.kind, 0)
        most = max(most, held)
    return most


def best_of(schedules: list[Schedule], costs: Costs, limit: int) -> Schedule:
    """The fastest of `schedules` (one stage per rank) within `limit`, ties to the lower peak and then
    the first; renamed zb_auto and proved by `simulate.check`."""
    times, latency = ticks(schedules[0].num_ranks, costs)
    ranked = []
    for i, schedule in enumerate(schedules):
        orders = compute_only(schedule).ranks
        top = max(peak(actions) for actions in orders)
        step = step_time(orders, times, latency)
        if step is not None and top <= limit:
            ranked.append((step, top, i))
    if not ranked:  # unreachable: the heuristic frees memory with Ws before every forward
        raise RuntimeError(f"zb_auto: no candidate stays within memory_limit={limit}")
    best = schedules[min(ranked)[2]]
    chosen = Schedule(best.ranks, best.num_stages, best.num_microbatches, ZB_AUTO)
    check(chosen)
    return chosen


__all__ = ["MIN_MEMORY_LIMIT", "ZB_AUTO", "best_of", "candidates", "list_schedule", "memory_limit_problem", "peak",
           "step_time", "ticks"]
