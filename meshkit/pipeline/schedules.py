"""Pipeline schedule generators: each returns a `Schedule` (see `actions` for the format) that
`simulate.check` proves complete and deadlock-free before any process starts.

One stage per rank: GPipe, 1F1B, ZB-H1 and ZB-H2. Several stages per rank: interleaved 1F1B (stage
s on rank s % p, here) and the V-shaped ZB-V and DualPipeV (stage s and 2p-1-s on one rank, in
`v_shape`). `build_schedule` is the one entry point a Plan uses; `stage_placement` says which rank
holds each stage without building the schedule (the model splitter needs it first).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from meshkit.pipeline.actions import (
    COMPUTE_KINDS,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    compute_only,
    forward_only,
    parse_action,
    parse_schedule,
    require_int,
    schedule_sizes,
    with_communication,
)
from meshkit.pipeline.v_shape import V_SCHEDULES, dualpipe_v, v_placement, zb_v


def _single_stage(name: str, pp: int, m: int, rank_order: Callable[[int], list[Action]]) -> Schedule:
    compute = Schedule(tuple(tuple(rank_order(r)) for r in range(pp)), pp, m, name)
    return with_communication(compute)


def gpipe(pp: int, microbatches: int) -> Schedule:
    """All forwards, then all full backwards: the baseline, holding every microbatch's activations."""
    pp, m = schedule_sizes(pp, microbatches)

    def order(r: int) -> list[Action]:
        return [Action(ActionKind.F, r, i) for i in range(m)] + [Action(ActionKind.BW, r, i) for i in range(m)]

    return _single_stage("gpipe", pp, m, order)


def _one_f_one_b_order(rank: int, pp: int, m: int, backward: Callable[[int], Iterable[Action]]) -> list[Action]:
    """Rank `rank`'s 1F1B order: p-1-r warm-up forwards, then F/backward pairs, then the rest."""
    warmup = min(pp - 1 - rank, m)
    order = [Action(ActionKind.F, rank, i) for i in range(warmup)]
    for j in range(m - warmup):
        order.append(Action(ActionKind.F, rank, warmup + j))
        order.extend(backward(j))
    for j in range(m - warmup, m):
        order.extend(backward(j))
    return order


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """1F1B: GPipe's bubble, but rank r holds at most p-r microbatches' activations instead of m."""
    pp, m = schedule_sizes(pp, microbatches)
    return _single_stage(
        "1f1b", pp, m, lambda r: _one_f_one_b_order(r, pp, m, lambda j: [Action(ActionKind.BW, r, j)])
    )


def zb_h1(pp: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with every backward split into B and W, rank r's W trailing its B by r positions.

    B alone is all the upstream stage waits for, so backwards ripple up the pipeline faster; the
    deferred W passes then fill what would be the cooldown bubble. The trail of r keeps p microbatches
    in flight on every rank, the peak of 1F1B's first rank.
    """
    pp, m = schedule_sizes(pp, microbatches)

    def order(r: int) -> list[Action]:
        def backward(j: int) -> list[Action]:
            split = [Action(ActionKind.B, r, j)]
            if j >= r:
                split.append(Action(ActionKind.W, r, j - r))
            if j == m - 1:  # flush the Ws still trailing behind the last B
                split.extend(Action(ActionKind.W, r, i) for i in range(max(0, m - r), m))
            return split

        return _one_f_one_b_order(r, pp, m, backward)

    return _single_stage("zb_h1", pp, m, order)


def zb_h2(pp: int, microbatches: int) -> Schedule:
    """ZB-H2: ZB-H1 with up to 2p-1 microbatches in flight per rank, so no rank waits inside its span.

    Built by list scheduling at unit F, B and W times: whenever a rank is free it runs an input
    gradient B if one has arrived (B is the critical path), else a forward if one has arrived and
    fewer than 2p-1 microbatches are in flight, else its oldest pending W. The extra warm-up forwards
    fill the wait for the first B and the pending Ws fill every later gap, so each rank is busy from
    its first action to its last: the parallelogram of the Zero Bubble paper. Within one step, rank
    r still starts r forwards late; that skew (the step is 3m + p - 1 units, ZB-H1's at equal times)
    disappears only when consecutive steps overlap, which needs the paper's optimizer post-validation
    (meshkit synchronises the loss and the gradient norm after each step, so it does not).
    The price is memory: rank r peaks at min(m, 2p-1) microbatches' activations (ZB-H1: min(m, p)).
    """
    pp, m = schedule_sizes(pp, microbatches)
    return with_communication(Schedule(_list_schedule(pp, m, cap=2 * pp - 1), pp, m, "zb_h2"))


def _list_schedule(pp: int, m: int, cap: int) -> tuple[tuple[Action, ...], ...]:
    """Per-rank orders from a unit-time list scheduling with priorities B > F (under `cap`) > W.

    Each pick is the free rank that can start soonest; an action is ready once what it consumes has
    finished (the previous stage's F, the next stage's B, its own B), so the order it emits is
    executable and `with_communication` only adds the transfers the timed run already implied.
    """
    K = ActionKind
    free = [0] * pp
    finished: dict[tuple[ActionKind, int, int], int] = {}
    next_f, next_b, in_flight = [0] * pp, [0] * pp, [0] * pp
    pending_w: list[list[int]] = [[] for _ in range(pp)]
    orders: list[list[Action]] = [[] for _ in range(pp)]
    for _ in range(3 * m * pp):
        best: tuple[int, int, ActionKind, int] | None = None  # (start, rank, kind, microbatch)
        for r in range(pp):
            ready: list[tuple[int, int, ActionKind, int]] = []  # (start, priority, kind, microbatch)
            if next_b[r] < next_f[r]:
                j = next_b[r]
                after = finished.get((K.F, r, j) if r == pp - 1 else (K.B, r + 1, j))
                if after is not None:
                    ready.append((max(free[r], after), 0, K.B, j))
            if next_f[r] < m and in_flight[r] < cap:
                j = next_f[r]
                after = 0 if r == 0 else finished.get((K.F, r - 1, j))
                if after is not None:
                    ready.append((max(free[r], after), 1, K.F, j))
            if pending_w[r]:
                ready.append((free[r], 2, K.W, pending_w[r][0]))
            if ready:
                start = min(start for start, *_ in ready)
                _, _, kind, j = min(c for c in ready if c[0] == start)
                if best is None or start < best[0]:
                    best = (start, r, kind, j)
        if best is None:  # unreachable: the rank holding the oldest unfinished work can always start it
            raise RuntimeError(f"ZB-H2 list scheduling stalled at pp={pp}, microbatches={m}")
        start, r, kind, j = best
        free[r] = finished[(kind, r, j)] = start + 1
        orders[r].append(Action(kind, r, j))
        if kind is K.F:
            next_f[r] += 1
            in_flight[r] += 1
        elif kind is K.B:
            next_b[r] += 1
            pending_w[r].append(j)
        else:
            pending_w[r].pop(0)
            in_flight[r] -= 1
    return tuple(map(tuple, orders))


def interleaved_1f1b(pp: int, microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B (Megatron's depth-first order): v stages per rank, stage s on rank s % p.

    Each rank runs each of its v stages on a group of microbatches before moving to its next stage,
    then starts the next group. A group of exactly p keeps rank 0 busy until microbatch 0 comes back
    round from rank p-1, which divides the bubble by v (at v times the P2P traffic). When p does not
    divide m, the FIRST group takes the remainder: a larger group costs only warm-up memory, while a
    smaller group anywhere would leave a gap (and a smaller last group deadlocks the 1F1B pairing).
    Warm-up on rank r is 2(p-1-r) + (v-1)g forwards (g = first group's size): just enough that the
    first backward has come back from the last stage when the rank needs it.
    """
    pp, m = schedule_sizes(pp, microbatches)
    v = require_int("virtual_stages", virtual_stages, 1, "it is the number of stages per rank (1 = plain 1F1B)")
    if v == 1:
        return Schedule(one_f_one_b(pp, m).ranks, pp, m, "interleaved_1f1b")
    if m < pp:
        raise ValueError(
            f"microbatches={m!r} is less than pp={pp}: interleaved 1F1B with virtual_stages={v} needs "
            f"at least pp microbatches per group; use microbatches >= {pp} (ideally a multiple of "
            f"{pp}) or virtual_stages=1"
        )
    group_sizes = [pp + m % pp] + [pp] * (m // pp - 1)
    table: list[tuple[int, int]] = []  # (local chunk, microbatch) in forward order
    first = 0
    for size in group_sizes:
        table += [(chunk, mb) for chunk in range(v) for mb in range(first, first + size)]
        first += size
    total = len(table)

    def order(r: int) -> list[Action]:
        def forward(k: int) -> Action:
            chunk, mb = table[k]
            return Action(ActionKind.F, chunk * pp + r, mb)

        def backward(k: int) -> Action:  # same walk as forward, chunks in reverse
            chunk, mb = table[k]
            return Action(ActionKind.BW, (v - 1 - chunk) * pp + r, mb)

        warmup = min(2 * (pp - 1 - r) + (v - 1) * group_sizes[0], total)
        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        actions += [backward(k) for k in range(total - warmup, total)]
        return actions

    compute = Schedule(tuple(tuple(order(r)) for r in range(pp)), pp * v, m, "interleaved_1f1b")
    return with_communication(compute)


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", *V_SCHEDULES)
# The schedules that split a backward into B (input gradient) and a deferred W (weight gradient).
WEIGHT_GRAD_SPLIT = ("zb_h1", "zb_h2", *V_SCHEDULES)


def splits_weight_grad(name: str) -> bool:
    """Whether schedule `name` defers weight gradients (W actions), known from its name alone so that
    parallelize can choose a layer implementation before any schedule is built."""
    return name in WEIGHT_GRAD_SPLIT


def stages_per_rank(name: str, virtual_stages: int = 1) -> int:
    """How many stages each rank holds under schedule `name` (V schedules always hold two)."""
    return 2 if name in V_SCHEDULES else virtual_stages


def stage_placement(name: str, pp: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The rank of every stage under schedule `name`: `s % pp`, or the V (s and 2p-1-s on one rank).

    Equal to `build_schedule(...).stage_to_rank()`; the splitter calls it before any schedule exists.
    """
    if name in V_SCHEDULES:
        return v_placement(pp)
    return tuple(s % pp for s in range(pp * virtual_stages))


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule a Plan names (`pp_schedule`), with its microbatch and virtual-stage counts.

    V schedules hold two stages per rank whatever `virtual_stages` says, so they accept 1 (the
    default) or 2 and nothing else.
    """
    if name == "interleaved_1f1b":
        return interleaved_1f1b(pp, microbatches, virtual_stages)
    builders: dict[str, Callable[[int, int], Schedule]] = {
        "gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1, "zb_h2": zb_h2, "zb_v": zb_v, "dualpipe_v": dualpipe_v}
    if name not in builders:
        raise ValueError(f"pp_schedule={name!r}: unknown schedule; choose one of {', '.join(SCHEDULES)}")
    allowed = (1, 2) if name in V_SCHEDULES else (1,)
    if virtual_stages not in allowed:
        fix = ("V schedules always run two stages per rank; use virtual_stages=1 or 2" if name in V_SCHEDULES else
               "only interleaved_1f1b runs several stages per rank; use virtual_stages=1 or "
               "pp_schedule='interleaved_1f1b'")
        raise ValueError(f"virtual_stages={virtual_stages!r} with pp_schedule={name!r}: {fix}")
    return builders[name](pp, microbatches)


__all__: Sequence[str] = (
    "Action",
    "ActionKind",
    "COMPUTE_KINDS",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "V_SCHEDULES",
    "build_schedule",
    "compute_only",
    "dualpipe_v",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "parse_action",
    "parse_schedule",
    "stage_placement",
    "splits_weight_grad",
    "stages_per_rank",
    "with_communication",
    "zb_h1",
    "zb_h2",
    "zb_v",
)
