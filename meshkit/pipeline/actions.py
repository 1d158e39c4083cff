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

A schedule may run several pipelines over the same ranks (`Schedule.pipelines`, DualPipe's two
directions): then "the next stage" is the next one of the stage's own chain, and a chain's last stage
ends its microbatches' forward (`Schedule.upstream` / `downstream` / `visits`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
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
FORWARD_KINDS = frozenset({ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F})
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
    # Independent chains of stages, each fed its own share of the microbatches (DualPipe: 2, one per
    # direction). Chain c is stages [c*S/k, (c+1)*S/k) and microbatches [c*m/k, (c+1)*m/k).
    pipelines: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(tuple(actions) for actions in self.ranks))
        for field in ("num_stages", "num_microbatches", "pipelines"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"Schedule {field}={value!r}: must be an int >= 1")
        if self.num_stages % self.pipelines or self.num_microbatches % self.pipelines:
            raise ScheduleError(f"Schedule pipelines={self.pipelines}: must divide num_stages={self.num_stages} and "
                                f"num_microbatches={self.num_microbatches} (each chain gets an equal share)")
        if not self.ranks:
            raise ScheduleError("Schedule ranks=(): needs at least one rank")
        for rank, actions in enumerate(self.ranks):
            for position, action in enumerate(actions):
                if not isinstance(action, Action):
                    raise ScheduleError(f"rank {rank} position {position}: {action!r} is not an Action")
                if self.forward_only and action.kind not in FORWARD_KINDS:
                    raise ScheduleError(f"rank {rank} position {position}: {action} in a forward-only schedule; "
                                        f"it may hold only F, SEND_F and RECV_F")
                if action.stage >= self.num_stages or action.microbatch >= self.num_microbatches:
                    raise ScheduleError(
                        f"rank {rank} position {position}: {action} is outside num_stages="
                        f"{self.num_stages}, num_microbatches={self.num_microbatches}"
                    )

    def __hash__(self) -> int:
        """Cached: the runtime's per-call caches key on the schedule, and hashing it afresh walks every
        action (hundreds of Python-level hashes) at the start of every step."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.ranks, self.num_stages, self.num_microbatches, self.name, self.forward_only,
                           self.pipelines))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        """Pickled without the cached hash: string hashes differ between processes."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks the schedule has action lists for."""
        return len(self.ranks)

    def upstream(self, stage: int) -> int | None:
        """The stage feeding `stage` its input, None for the first stage of a chain."""
        return None if stage % (self.num_stages // self.pipelines) == 0 else stage - 1

    def downstream(self, stage: int) -> int | None:
        """The stage taking `stage`'s output, None for the last stage of a chain (it computes the loss)."""
        return None if (stage + 1) % (self.num_stages // self.pipelines) == 0 else stage + 1

    def visits(self, stage: int, microbatch: int) -> bool:
        """Whether `microbatch` passes through `stage`: every pair with one chain, its own chain's otherwise."""
        per_chain = self.num_stages // self.pipelines
        return stage // per_chain == microbatch // (self.num_microbatches // self.pipelines)

    def stage_ranks(self) -> dict[int, set[int]]:
        """Which ranks compute each stage (a valid schedule has exactly one per stage)."""
        owners: dict[int, set[int]] = {stage: set() for stage in range(self.num_stages)}
        for rank, actions in enumerate(self.ranks):
            for action in actions:
                if action.is_compute:
                    owners[action.stage].add(rank)
        return owners

    def stage_to_rank(self) -> tuple[int, ...]:
        """The rank of every stage; raises if a stage is computed on no rank or on several.

        Cached on the (immutable) schedule: the runtime asks at every call."""
        cached = self.__dict__.get("_placement")
        if cached is not None:
            return cached
        placement = []
        for stage, ranks in self.stage_ranks().items():
            if len(ranks) != 1:
                where = f"on ranks {sorted(ranks)}" if ranks else "on no rank"
                raise ScheduleError(f"stage {stage} is computed {where}; each stage must live on one rank")
            placement.append(next(iter(ranks)))
        object.__setattr__(self, "_placement", tuple(placement))
        return self.__dict__["_placement"]

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(self.ranks))


def parse_schedule(
    text: str, num_stages: int | None = None, num_microbatches: int | None = None, name: str = "custom",
    pipelines: int = 1,
) -> Schedule:
    """Read the `str(schedule)` form: one `rank <r>: <action> <action> ...` line per rank, in order.

    Sizes default to the largest stage and microbatch mentioned; pass them to catch a schedule that
    forgets the last stage or microbatch entirely. The text does not carry `pipelines` (DualPipe's 2).
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
    return Schedule(tuple(ranks), num_stages, num_microbatches, name, pipelines=pipelines)


def compute_only(schedule: Schedule) -> Schedule:
    """The same schedule without its sends and receives: the order of the work itself."""
    ranks = tuple(tuple(a for a in actions if a.is_compute) for actions in schedule.ranks)
    return Schedule(ranks, schedule.num_stages, schedule.num_microbatches, schedule.name, schedule.forward_only,
                    schedule.pipelines)


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of a training schedule and their transfers, in the same order: evaluation.

    Forwards depend only on forwards, so the subsequence of a deadlock-free schedule is deadlock-free
    (`check` replays it anyway), and each rank's forward order (interleaved chunks included) is the
    one the training schedule already proved.
    """
    ranks = tuple(tuple(a for a in actions if a.kind in FORWARD_KINDS) for actions in schedule.ranks)
    return Schedule(ranks, schedule.num_stages, schedule.num_microbatches, f"{schedule.name}/forward", True,
                    schedule.pipelines)


def with_communication(schedule: Schedule) -> Schedule:
    """Insert the P2P actions a compute-only schedule needs between stages on different ranks.

    Each send goes right after the compute that produces its data (so the peer can start as early as
    possible) and each receive right before the compute that consumes it (so a rank never blocks
    on data it does not need yet).
    """
    owner = schedule.stage_to_rank()
    ranks = []
    for rank, actions in enumerate(schedule.ranks):
        out: list[Action] = []
        for action in actions:
            if not action.is_compute:
                raise ScheduleError(f"rank {rank}: {action} is already communication; pass a compute-only schedule")
            s, mb = action.stage, action.microbatch
            up, down = schedule.upstream(s), schedule.downstream(s)
            receives_from_up = up is not None and owner[up] != rank
            sends_down = down is not None and owner[down] != rank
            if action.kind is ActionKind.F:
                if receives_from_up:
                    out.append(Action(ActionKind.RECV_F, s, mb))
                out.append(action)
                if sends_down:
                    out.append(Action(ActionKind.SEND_F, s, mb))
            elif action.kind in (ActionKind.B, ActionKind.BW):
                if sends_down:
                    out.append(Action(ActionKind.RECV_B, s, mb))
                out.append(action)
                if receives_from_up:
                    out.append(Action(ActionKind.SEND_B, s, mb))
            else:
                out.append(action)
        ranks.append(tuple(out))
    return Schedule(tuple(ranks), schedule.num_stages, schedule.num_microbatches, schedule.name,
                    schedule.forward_only, schedule.pipelines)


def require_int(name: str, value: object, minimum: int, fix: str) -> int:
    """A generator argument checked as the Plan checks its fields: name, value and fix in the error."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: must be an int >= {minimum}; {fix}")
    return value


def schedule_sizes(pp: int, microbatches: int) -> tuple[int, int]:
    """`(pp, microbatches)` after the checks every generator shares."""
    require_int("pp", pp, 1, "it is the number of pipeline ranks")
    require_int("microbatches", microbatches, 1, "use at least pp microbatches to keep every rank busy")
    return pp, microbatches


__all__: Sequence[str] = (
    "Action",
    "ActionKind",
    "COMPUTE_KINDS",
    "FORWARD_KINDS",
    "Schedule",
    "ScheduleError",
    "compute_only",
    "forward_only",
    "parse_action",
    "parse_schedule",
    "require_int",
    "schedule_sizes",
    "with_communication",
)
