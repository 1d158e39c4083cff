"""Pipeline schedule generators: each returns a `Schedule` (see `actions` for the format) that
`simulate.check` proves complete and deadlock-free before any process starts.

One stage per rank: GPipe, 1F1B, ZB-H1, ZB-H2 and zb_auto (built for measured costs and a memory
limit, in `auto`). Several stages per rank: interleaved 1F1B (stage s on rank s % p, here), the
V-shaped ZB-V and DualPipeV (stage s and 2p-1-s on one rank, in `v_shape`) and DualPipe (two
pipelines in opposite directions, each chunk of layers on two ranks, in `bidirectional`).
`build_schedule` is the one entry point a Plan uses; `stage_placement`, `stage_chunks` and
`splits_weight_grad` answer from the name alone what the model splitter and the TP path need first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

from meshkit.pipeline import auto, bidirectional
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
from meshkit.pipeline.bidirectional import dualpipe
from meshkit.pipeline.simulate import Costs
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
    return with_communication(Schedule(auto.list_schedule(pp, m, Costs(), cap=2 * pp - 1), pp, m, "zb_h2"))


@functools.lru_cache(maxsize=64)
def zb_auto(pp: int, microbatches: int, costs: Costs | None = None, memory_limit: int | None = None) -> Schedule:
    """zb_auto (`auto`): the fastest schedule at `costs` (unit F, B, W and no P2P latency by default) whose
    ranks hold at most `memory_limit` microbatches from F until W (default pp: 1F1B's first rank).

    The candidates are the heuristic's (`auto.candidates`) and the handcrafted ZB-H1 and ZB-H2, each
    kept only where its peak fits the limit, so zb_auto is never slower than those at its costs.
    Cached: the same arguments give the same (immutable) schedule without rebuilding it.
    """
    pp, m = schedule_sizes(pp, microbatches)
    limit = pp if memory_limit is None else memory_limit
    problem = auto.memory_limit_problem(limit)
    if problem:
        raise ValueError(problem)
    costs = Costs() if costs is None else costs
    handcrafted = [build(pp, m) for build, held in ((zb_h1, pp), (zb_h2, 2 * pp - 1)) if min(held, m) <= limit]
    return auto.best_of([*auto.candidates(pp, m, costs, limit), *handcrafted], costs, limit)


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


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", *V_SCHEDULES, bidirectional.DUALPIPE, auto.ZB_AUTO)
#: Schedules with two stages per rank whatever `virtual_stages` says (the V's, DualPipe's two directions).
TWO_STAGES = (*V_SCHEDULES, bidirectional.DUALPIPE)
# The schedules that split a backward into B (input gradient) and a deferred W (weight gradient).
WEIGHT_GRAD_SPLIT = ("zb_h1", "zb_h2", *V_SCHEDULES, bidirectional.DUALPIPE, auto.ZB_AUTO)


def splits_weight_grad(name: str) -> bool:
    """Whether schedule `name` defers weight gradients (W actions), known from its name alone so that
    parallelize can choose a layer implementation before any schedule is built."""
    return name in WEIGHT_GRAD_SPLIT


def stages_per_rank(name: str, virtual_stages: int = 1) -> int:
    """How many stages each rank holds under schedule `name` (V schedules and DualPipe always hold two)."""
    return 2 if name in TWO_STAGES else virtual_stages


def stage_placement(name: str, pp: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The rank of every stage under schedule `name`: `s % pp`, or the V (s and 2p-1-s on one rank,
    also DualPipe's: its up pipeline's chunk k, stage p+k, is on rank p-1-k).

    Equal to `build_schedule(...).stage_to_rank()`; the splitter calls it before any schedule exists.
    """
    if name in TWO_STAGES:
        return v_placement(pp)
    return tuple(s % pp for s in range(pp * virtual_stages))


def stage_chunks(name: str, pp: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The chunk of layers every stage runs, the model being cut into `max(chunks) + 1` chunks: each
    stage its own chunk, except under DualPipe, whose two pipelines run the same p chunks (s mod p)."""
    if name == bidirectional.DUALPIPE:
        return bidirectional.mirrored_chunks(pp)
    return tuple(range(pp * stages_per_rank(name, virtual_stages)))


def pipelines(name: str) -> int:
    """How many chains of stages the schedule runs, each fed its share of the microbatches (DualPipe: 2)."""
    return 2 if name == bidirectional.DUALPIPE else 1


def first_pipeline(name: str, pp: int, virtual_stages: int = 1) -> range:
    """The stages one microbatch of the first pipeline passes through, in order: every stage, except
    under DualPipe (the down pipeline's p stages; the up pipeline runs the same chunks in reverse)."""
    stages = pp * stages_per_rank(name, virtual_stages)
    return range(stages // pipelines(name))


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1, *, costs: Costs | None = None,
                   memory_limit: int | None = None) -> Schedule:
    """The schedule a Plan names (`pp_schedule`), with its microbatch and virtual-stage counts.

    V schedules and DualPipe hold two stages per rank whatever `virtual_stages` says, so they accept 1
    (the default) or 2 and nothing else. `costs` and `memory_limit` are zb_auto's (ignored otherwise).
    """
    if name == "interleaved_1f1b":
        return interleaved_1f1b(pp, microbatches, virtual_stages)
    builders: dict[str, Callable[[int, int], Schedule]] = {
        "gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1, "zb_h2": zb_h2, "zb_v": zb_v, "dualpipe_v": dualpipe_v,
        bidirectional.DUALPIPE: dualpipe, auto.ZB_AUTO: lambda p, m: zb_auto(p, m, costs, memory_limit)}
    if name not in builders:
        raise ValueError(f"pp_schedule={name!r}: unknown schedule; choose one of {', '.join(SCHEDULES)}")
    allowed = (1, 2) if name in TWO_STAGES else (1,)
    if virtual_stages not in allowed:
        fix = ("it always runs two stages per rank; use virtual_stages=1 or 2" if name in TWO_STAGES else
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
    "TWO_STAGES",
    "V_SCHEDULES",
    "build_schedule",
    "compute_only",
    "dualpipe",
    "dualpipe_v",
    "first_pipeline",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "parse_action",
    "parse_schedule",
    "pipelines",
    "splits_weight_grad",
    "stage_chunks",
    "stage_placement",
    "stages_per_rank",
    "with_communication",
    "zb_h1",
    "zb_auto",
    "zb_h2",
    "zb_v",
)
