"""Pipeline schedules as plain data: one strict action format and the generators that emit it.

Why meshkit owns a format: torch's pipelining action lists are private, have changed meaning between
releases (`B` became `I`, `BW` became `B`) and are parsed leniently (`2BW0` silently reads as `2B`).
A meshkit schedule is a value that `meshkit.pipeline.simulate.check` can prove complete and
deadlock-free before any process starts, and that the runtime adapts in exactly one place.

A schedule is, per pipeline rank, the ordered list of actions that rank runs. An action's `stage` is
always a stage that lives on the rank running it, so a communication action names the local end:

    SEND_F3.1  stage 3 sends its output activations of microbatch 1 to stage 4
    RECV_F3.1  stage 3 receives its input activations of microbatch 1 from stage 2
    SEND_B3.1  stage 3 sends the gradient of its input to stage 2
    RECV_B3.1  stage 3 receives the gradient of its output from stage 4

Sends are non-blocking (isend); a receive blocks until its data arrives, so a runtime must post
sends without waiting for the peer and wait on a receive just before the compute that consumes it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum


class ScheduleError(ValueError):
    """A schedule (or its text) that cannot run; the message says where and why."""


class ActionKind(Enum):
    """What an action does: compute (F, B, W, BW) or move data (SEND/RECV of F or B)."""
    F = "F"  # forward
    B = "B"  # backward for the input gradient only; frees the critical path, W comes later
    W = "W"  # weight gradient of a microbatch whose B already ran
    BW = "BW"  # full backward: B and W back to back, as 1F1B and GPipe do
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


COMPUTE_KINDS = frozenset({ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW})
_FORWARD_KINDS = frozenset({ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F})
_KIND_BY_TEXT = {kind.value: kind for kind in ActionKind}
# ASCII digits only (`\d` would accept other scripts' digits) and no leading zeros, so that every
# accepted string is the canonical form of exactly one action.
_ACTION_RE = re.compile(r"([A-Z_]+)(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)")


@dataclass(frozen=True)
class Action:
    """One step of one rank: `kind` on global `stage` for `microbatch`. Text form: `F3.1`."""

    kind: ActionKind
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ActionKind):
            raise ScheduleError(f"Action kind={self.kind!r}: must be an ActionKind, e.g. ActionKind.F")
        for field in ("stage", "microbatch"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ScheduleError(f"Action {field}={value!r}: must be an int >= 0")

    @property
    def is_compute(self) -> bool:
        """True for F, B, W and BW; False for sends and receives."""
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        return f"{self.kind.value}{self.stage}.{self.microbatch}"


def parse_action(text: str) -> Action:
    """Read `KIND<stage>.<microbatch>` exactly; anything else (prefixes, case, spaces) is an error."""
    match = _ACTION_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ScheduleError(
            f"{text!r} is not an action: expected KIND<stage>.<microbatch> such as 'F3.1' or "
            f"'RECV_B2.0' (KIND one of {', '.join(_KIND_BY_TEXT)}; no spaces, no leading zeros)"
        )
    kind_text, stage, microbatch = match.groups()
    if kind_text not in _KIND_BY_TEXT:
        raise ScheduleError(f"{text!r}: unknown action kind {kind_text!r}; known kinds: {', '.join(_KIND_BY_TEXT)}")
    return Action(_KIND_BY_TEXT[kind_text], int(stage), int(microbatch))


@dataclass(frozen=True)
class Schedule:
    """Per pipeline rank, the actions it runs in order; `ranks[r]` is rank r's list.

    The constructor only checks that each action fits the declared sizes, so that hand-written
    (possibly broken) schedules can be built and handed to `check`, which explains what is wrong.
    """

    ranks: tuple[tuple[Action, ...], ...]
    num_stages: int
    num_microbatches: int
    name: str = "custom"
    forward_only: bool = False  # evaluation: forwards and their transfers only, no backward expected

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(tuple(actions) for actions in self.ranks))
        for field in ("num_stages", "num_microbatches"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"Schedule {field}={value!r}: must be an int >= 1")
        if not self.ranks:
            raise ScheduleError("Schedule ranks=(): needs at least one rank")
        for rank, actions in enumerate(self.ranks):
            for position, action in enumerate(actions):
                if not isinstance(action, Action):
                    raise ScheduleError(f"rank {rank} position {position}: {action!r} is not an Action")
                if self.forward_only and action.kind not in _FORWARD_KINDS:
                    raise ScheduleError(f"rank {rank} position {position}: {action} in a forward-only schedule; "
                                        f"it may hold only F, SEND_F and RECV_F")
                if action.stage >= self.num_stages or action.microbatch >= self.num_microbatches:
                    raise ScheduleError(
                        f"rank {rank} position {position}: {action} is outside num_stages="
                        f"{self.num_stages}, num_microbatches={self.num_microbatches}"
                    )

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks the schedule has action lists for."""
        return len(self.ranks)

    def stage_ranks(self) -> dict[int, set[int]]:
        """Which ranks compute each stage (a valid schedule has exactly one per stage)."""
        owners: dict[int, set[int]] = {stage: set() for stage in range(self.num_stages)}
        for rank, actions in enumerate(self.ranks):
            for action in actions:
                if action.is_compute:
                    owners[action.stage].add(rank)
        return owners

    def stage_to_rank(self) -> tuple[int, ...]:
        """The rank of every stage; raises if a stage is computed on no rank or on several."""
        placement = []
        for stage, ranks in self.stage_ranks().items():
            if len(ranks) != 1:
                where = f"on ranks {sorted(ranks)}" if ranks else "on no rank"
                raise ScheduleError(f"stage {stage} is computed {where}; each stage must live on one rank")
            placement.append(next(iter(ranks)))
        return tuple(placement)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(self.ranks))


def parse_schedule(
    text: str, num_stages: int | None = None, num_microbatches: int | None = None, name: str = "custom"
) -> Schedule:
    """Read the `str(schedule)` form: one `rank <r>: <action> <action> ...` line per rank, in order.

    Sizes default to the largest stage and microbatch mentioned; pass them to catch a schedule that
    forgets the last stage or microbatch entirely.
    """
    ranks: list[tuple[Action, ...]] = []
    for line_number, line in enumerate(text.strip().splitlines(), start=1):
        head, sep, body = line.partition(":")
        if not sep or head != f"rank {len(ranks)}":
            raise ScheduleError(f"line {line_number} {line!r}: expected it to start with 'rank {len(ranks)}:'")
        tokens = body.split(" ")[1:] if body else []
        if body and (not body.startswith(" ") or "" in tokens):
            raise ScheduleError(f"line {line_number} {line!r}: separate actions by single spaces")
        ranks.append(tuple(parse_action(token) for token in tokens))
    if not ranks:
        raise ScheduleError("schedule text is empty: expected one 'rank <r>: ...' line per rank")
    actions = [action for rank_actions in ranks for action in rank_actions]
    if num_stages is None:
        num_stages = 1 + max((a.stage for a in actions), default=0)
    if num_microbatches is None:
        num_microbatches = 1 + max((a.microbatch for a in actions), default=0)
    return Schedule(tuple(ranks), num_stages, num_microbatches, name)


def compute_only(schedule: Schedule) -> Schedule:
    """The same schedule without its sends and receives: the order of the work itself."""
    ranks = tuple(tuple(a for a in actions if a.is_compute) for actions in schedule.ranks)
    return Schedule(ranks, schedule.num_stages, schedule.num_microbatches, schedule.name, schedule.forward_only)


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of a training schedule and their transfers, in the same order: evaluation.

    Forwards depend only on forwards, so the subsequence of a deadlock-free schedule is deadlock-free
    (`check` replays it anyway), and each rank's forward order (interleaved chunks included) is the
    one the training schedule already proved.
    """
    ranks = tuple(tuple(a for a in actions if a.kind in _FORWARD_KINDS) for actions in schedule.ranks)
    return Schedule(ranks, schedule.num_stages, schedule.num_microbatches, f"{schedule.name}/forward", True)


def with_communication(schedule: Schedule) -> Schedule:
    """Insert the P2P actions a compute-only schedule needs between stages on different ranks.

    Each send goes right after the compute that produces its data (so the peer can start as early as
    possible) and each receive right before the compute that consumes it (so a rank never blocks
    on data it does not need yet).
    """
    owner = schedule.stage_to_rank()
    last = schedule.num_stages - 1
    ranks = []
    for rank, actions in enumerate(schedule.ranks):
        out: list[Action] = []
        for action in actions:
            if not action.is_compute:
                raise ScheduleError(f"rank {rank}: {action} is already communication; pass a compute-only schedule")
            s, mb = action.stage, action.microbatch
            if action.kind is ActionKind.F:
                if s > 0 and owner[s - 1] != rank:
                    out.append(Action(ActionKind.RECV_F, s, mb))
                out.append(action)
                if s < last and owner[s + 1] != rank:
                    out.append(Action(ActionKind.SEND_F, s, mb))
            elif action.kind in (ActionKind.B, ActionKind.BW):
                if s < last and owner[s + 1] != rank:
                    out.append(Action(ActionKind.RECV_B, s, mb))
                out.append(action)
                if s > 0 and owner[s - 1] != rank:
                    out.append(Action(ActionKind.SEND_B, s, mb))
            else:
                out.append(action)
        ranks.append(tuple(out))
    return Schedule(tuple(ranks), schedule.num_stages, schedule.num_microbatches, schedule.name,
                    schedule.forward_only)


# ---------------------------------------------------------------------------------------- generators


def _require_int(name: str, value: object, minimum: int, fix: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an int >= {minimum}; {fix}")
    return value


def _sizes(pp: int, microbatches: int) -> tuple[int, int]:
    _require_int("pp", pp, 1, "it is the number of pipeline ranks")
    _require_int("microbatches", microbatches, 1, "use at least pp microbatches to keep every rank busy")
    return pp, microbatches


def _single_stage(name: str, pp: int, m: int, rank_order: Callable[[int], list[Action]]) -> Schedule:
    compute = Schedule(tuple(tuple(rank_order(r)) for r in range(pp)), pp, m, name)
    return with_communication(compute)


def gpipe(pp: int, microbatches: int) -> Schedule:
    """All forwards, then all full backwards: the baseline, holding every microbatch's activations."""
    pp, m = _sizes(pp, microbatches)

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
    pp, m = _sizes(pp, microbatches)
    return _single_stage(
        "1f1b", pp, m, lambda r: _one_f_one_b_order(r, pp, m, lambda j: [Action(ActionKind.BW, r, j)])
    )


def zb_h1(pp: int, microbatches: int) -> Schedule:
    """ZB-H1: 1F1B with every backward split into B and W, rank r's W trailing its B by r positions.

    B alone is all the upstream stage waits for, so backwards ripple up the pipeline faster; the
    deferred W passes then fill what would be the cooldown bubble. The trail of r keeps p microbatches
    in flight on every rank, the peak of 1F1B's first rank.
    """
    pp, m = _sizes(pp, microbatches)

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
    pp, m = _sizes(pp, microbatches)
    v = _require_int("virtual_stages", virtual_stages, 1, "it is the number of stages per rank (1 = plain 1F1B)")
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


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


def build_schedule(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule a Plan names (`pp_schedule`), with its microbatch and virtual-stage counts."""
    if name == "interleaved_1f1b":
        return interleaved_1f1b(pp, microbatches, virtual_stages)
    builders: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb_h1": zb_h1}
    if name not in builders:
        raise ValueError(f"pp_schedule={name!r}: unknown schedule; choose one of {', '.join(SCHEDULES)}")
    if virtual_stages != 1:
        raise ValueError(
            f"virtual_stages={virtual_stages!r} with pp_schedule={name!r}: only interleaved_1f1b runs "
            f"several stages per rank; use virtual_stages=1 or pp_schedule='interleaved_1f1b'"
        )
    return builders[name](pp, microbatches)


__all__: Sequence[str] = (
    "Action",
    "ActionKind",
    "COMPUTE_KINDS",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "build_schedule",
    "compute_only",
    "forward_only",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "parse_action",
    "parse_schedule",
    "with_communication",
    "zb_h1",
)
