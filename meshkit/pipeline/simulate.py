"""Check and time a pipeline schedule without starting a process.

`check` proves a schedule can run: every (stage, microbatch) is computed exactly once per kind, every
compute comes after what it consumes, every cross-rank edge has its send and receive, and executing
the ranks with non-blocking sends and blocking receives never deadlocks. `simulate` replays the same
execution with per-action costs in exact rational arithmetic, so bubble formulas can be tested for
equality rather than closeness.

The replay advances each rank through its list until it blocks on a receive whose send has not run
yet. A compute action never waits on another rank (its inputs arrive through receives on its own
rank), so each rank's clock only jumps at receives, to the matching send's time plus the P2P latency:
the same times an event-driven simulation gives, whatever order the ranks are advanced in.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from meshkit.pipeline.actions import Action, ActionKind, Schedule, ScheduleError

F, B, W, BW = ActionKind.F, ActionKind.B, ActionKind.W, ActionKind.BW
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
_MAX_PROBLEMS = 12


def _exact(name: str, value: int | float | Fraction) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, int | float | Fraction) or value < 0:
        raise ValueError(f"{name}={value!r}: must be a number >= 0 (an int or Fraction keeps results exact)")
    return Fraction(value)


@dataclass(frozen=True)
class Costs:
    """Time of each action kind on any stage; a full backward BW costs B + W.

    Subclass and override `duration` for stage-dependent costs (e.g. a heavier LM-head stage).
    Floats are converted exactly, but ints or Fractions keep formulas readable in results.
    """

    forward: int | float | Fraction = 1
    backward_input: int | float | Fraction = 1
    backward_weight: int | float | Fraction = 1
    p2p_latency: int | float | Fraction = 0  # from a send's start until the receiver may use the data

    def __post_init__(self) -> None:
        for field in ("forward", "backward_input", "backward_weight", "p2p_latency"):
            object.__setattr__(self, field, _exact(field, getattr(self, field)))

    def duration(self, action: Action) -> Fraction:
        """Time one compute action takes (BW costs B + W); sends and receives cost nothing here."""
        return {
            F: self.forward,
            B: self.backward_input,
            W: self.backward_weight,
            BW: self.backward_input + self.backward_weight,
        }.get(action.kind, Fraction(0))


@dataclass(frozen=True)
class Span:
    """One action's start and end on one rank's timeline."""
    action: Action
    start: Fraction
    end: Fraction


@dataclass(frozen=True)
class SimulationResult:
    """Timing of one step. Activations count (stage, microbatch) sets held from F until W or BW ends.

    For B/W-split schedules that count bounds only the peak: after B a microbatch still pins most of
    its activations (the inputs W needs), but not all, so memory between peaks is overstated.
    """

    schedule: Schedule
    costs: Costs
    timeline: tuple[tuple[Span, ...], ...]  # per rank, compute spans in order
    step_time: Fraction
    busy: tuple[Fraction, ...]
    peak_activations: tuple[int, ...]

    @property
    def idle(self) -> tuple[Fraction, ...]:
        """Per-rank idle time: step time minus busy time."""
        return tuple(self.step_time - busy for busy in self.busy)

    @property
    def span_idle(self) -> tuple[Fraction, ...]:
        """Per-rank idle between the rank's first and last action, leaving out its late start and early end.

        It is what remains of the bubble when consecutive steps overlap, rank r starting step k+1
        while later ranks still finish step k: the Zero Bubble paper's optimizer post-validation.
        The paper's "zero bubble" (ZB-H2, ZB-V at equal F, B and W times) is this being zero; within
        one synchronous step, as meshkit runs it, the start-up skew remains (see `idle`).
        """
        return tuple(
            (spans[-1].end - spans[0].start - busy) if spans else Fraction(0)
            for spans, busy in zip(self.timeline, self.busy)
        )

    @property
    def bubble_fraction(self) -> Fraction:
        """Idle time over total time, summed over ranks: the share of the step the devices waste."""
        total = self.step_time * len(self.busy)
        return sum(self.idle, Fraction(0)) / total if total else Fraction(0)


def _describe(action: Action, where: dict[Action, tuple[int, int]]) -> str:
    rank, position = where[action]
    return f"{action} (rank {rank}, position {position})"


class _Replay:
    """One execution of a structurally valid schedule; raises on order errors and deadlock."""

    def __init__(self, schedule: Schedule, costs: Costs) -> None:
        self.schedule = schedule
        self.owner = schedule.stage_to_rank()
        self.where = {a: (r, i) for r, actions in enumerate(schedule.ranks) for i, a in enumerate(actions)}
        self.backward_kind = {(a.stage, a.microbatch): a.kind for a in self.where if a.kind in (B, BW)}
        self.costs = costs

    def _needs(self, action: Action, rank: int) -> list[Action]:
        """What must already have run on `rank` before `action`: only local facts, never a wait."""
        s, mb = action.stage, action.microbatch
        up, down = self.schedule.upstream(s), self.schedule.downstream(s)
        if action.kind is F:
            if up is None:
                return []
            return [Action(F, up, mb) if self.owner[up] == rank else Action(RECV_F, s, mb)]
        if action.kind in (B, BW):
            if down is None:
                return [Action(F, s, mb)]
            later = Action(self.backward_kind[(down, mb)], down, mb)
            return [Action(F, s, mb), later if self.owner[down] == rank else Action(RECV_B, s, mb)]
        if action.kind in (W, SEND_B):
            return [Action(self.backward_kind[(s, mb)] if action.kind is SEND_B else B, s, mb)]
        return [Action(F, s, mb)]  # SEND_F

    def run(self) -> tuple[tuple[tuple[Span, ...], ...], Fraction]:
        ranks = self.schedule.ranks
        clock = [Fraction(0)] * len(ranks)
        next_index = [0] * len(ranks)
        spans: list[list[Span]] = [[] for _ in ranks]
        done: set[Action] = set()
        sent_at: dict[Action, Fraction] = {}
        progress = True
        while progress:
            progress = False
            for rank, actions in enumerate(ranks):
                while next_index[rank] < len(actions):
                    action = actions[next_index[rank]]
                    if action.kind in (RECV_F, RECV_B):
                        send = _matching_send(action)
                        if send not in sent_at:
                            break  # blocked: another rank has not sent yet
                        clock[rank] = max(clock[rank], sent_at[send] + self.costs.p2p_latency)
                    else:
                        for needed in self._needs(action, rank):
                            if needed not in done:
                                raise ScheduleError(self._order_error(action, needed, rank, next_index[rank]))
                        start = clock[rank]
                        clock[rank] += self.costs.duration(action)
                        if action.is_compute:
                            spans[rank].append(Span(action, start, clock[rank]))
                        else:
                            sent_at[action] = start
                    done.add(action)
                    next_index[rank] += 1
                    progress = True
        stuck = [r for r, actions in enumerate(ranks) if next_index[r] < len(actions)]
        if stuck:
            raise ScheduleError(self._deadlock_error(stuck, next_index))
        step_time = max((rank_spans[-1].end for rank_spans in spans if rank_spans), default=Fraction(0))
        return tuple(map(tuple, spans)), step_time

    def _order_error(self, action: Action, needed: Action, rank: int, position: int) -> str:
        why = {
            RECV_F: f"stage {action.stage} takes its input from stage {action.stage - 1} on another rank",
            RECV_B: f"stage {action.stage} takes its output gradient from stage {action.stage + 1} on another rank",
        }.get(needed.kind, f"{action} consumes what {needed} produces")
        return (
            f"rank {rank} position {position}: {action} runs before {_describe(needed, self.where)}, "
            f"which must come earlier on rank {rank} ({why})"
        )

    def _deadlock_error(self, stuck: list[int], next_index: list[int]) -> str:
        waits_on: dict[int, int] = {}
        lines = []
        for rank in stuck:
            blocked = self.schedule.ranks[rank][next_index[rank]]
            send = _matching_send(blocked)
            waits_on[rank] = self.where[send][0]
            lines.append(
                f"  rank {rank} blocks at position {next_index[rank]} on {blocked}, waiting for "
                f"{_describe(send, self.where)}"
            )
        path, rank = [], stuck[0]
        while rank not in path:
            path.append(rank)
            rank = waits_on[rank]
        cycle = path[path.index(rank) :] + [rank]
        return (
            f"deadlock in schedule {self.schedule.name!r}: ranks {stuck} wait on each other\n"
            + "\n".join(lines)
            + "\n  cycle: "
            + " -> ".join(f"rank {r}" for r in cycle)
            + "\n  reorder so each send is reached before the receive that waits for it"
        )


def _matching_send(receive: Action) -> Action:
    if receive.kind is RECV_F:
        return Action(SEND_F, receive.stage - 1, receive.microbatch)
    return Action(SEND_B, receive.stage + 1, receive.microbatch)


def _structure_problems(schedule: Schedule) -> list[str]:
    """Everything wrong that does not depend on order: placement, counts, missing P2P partners."""
    owners = schedule.stage_ranks()
    problems = [
        f"stage {s} is computed on {f'ranks {sorted(rs)}' if rs else 'no rank'}; each stage lives on one rank"
        for s, rs in owners.items()
        if len(rs) != 1
    ]
    if problems:
        return problems
    owner = schedule.stage_to_rank()
    seen: dict[Action, list[tuple[int, int]]] = defaultdict(list)
    for rank, actions in enumerate(schedule.ranks):
        for position, action in enumerate(actions):
            seen[action].append((rank, position))
            s = action.stage
            if not schedule.visits(s, action.microbatch):
                problems.append(f"rank {rank} position {position}: {action}: microbatch {action.microbatch} runs "
                                f"through another pipeline, never through stage {s}")
                continue
            if action.is_compute:
                continue
            if owner[s] != rank:
                problems.append(
                    f"rank {rank} position {position}: {action} names stage {s}, which lives on rank "
                    f"{owner[s]}; a send or receive names a stage of the rank that runs it"
                )
                continue
            peer = schedule.downstream(s) if action.kind in (SEND_F, RECV_B) else schedule.upstream(s)
            if peer is None:
                beyond = s + 1 if action.kind in (SEND_F, RECV_B) else s - 1
                where = "does not exist" if not 0 <= beyond < schedule.num_stages else "is in another pipeline"
                problems.append(f"rank {rank} position {position}: {action} has no peer: stage {beyond} {where}")
            elif owner[peer] == rank:
                problems.append(
                    f"rank {rank} position {position}: {action} is not needed: stages {s} and {peer} "
                    f"both live on rank {rank}"
                )
    for action, places in seen.items():
        if len(places) > 1:
            at = ", ".join(f"rank {r} position {i}" for r, i in places)
            problems.append(f"{action} appears {len(places)} times ({at}); each action runs exactly once")

    def missing(kind: ActionKind, s: int, mb: int, why: str) -> None:
        if Action(kind, s, mb) not in seen:
            problems.append(f"{Action(kind, s, mb)} is missing on rank {owner[s]}: {why}")

    has_p2p = any(not a.is_compute for a in seen)
    for s in range(schedule.num_stages):
        down = schedule.downstream(s)
        for mb in range(schedule.num_microbatches):
            if not schedule.visits(s, mb):
                continue
            missing(F, s, mb, f"stage {s} must run forward on microbatch {mb}")
            cross = down is not None and owner[down] != owner[s]
            src, dst = owner[s], owner[down] if down is not None else None
            if cross:
                missing(SEND_F, s, mb, f"stage {down} on rank {dst} needs microbatch {mb}'s activations")
                missing(RECV_F, down, mb, f"stage {down} needs microbatch {mb}'s activations from rank {src}")
            if schedule.forward_only:
                continue
            full, split_b, split_w = (Action(k, s, mb) in seen for k in (BW, B, W))
            if full and (split_b or split_w):
                problems.append(f"BW{s}.{mb} and B/W{s}.{mb} both present: a backward is either BW or a B/W pair")
            elif not full and not split_b and not split_w:
                problems.append(f"no backward for stage {s} microbatch {mb}: add BW{s}.{mb} or B{s}.{mb} + W{s}.{mb}")
            elif split_b != split_w:
                problems.append(f"{'B' if split_b else 'W'}{s}.{mb} has no {'W' if split_b else 'B'}{s}.{mb}")
            if cross:
                missing(SEND_B, down, mb, f"stage {s} on rank {src} needs microbatch {mb}'s gradient")
                missing(RECV_B, s, mb, f"stage {s} needs microbatch {mb}'s gradient from rank {dst}")
    if problems and not has_p2p and schedule.num_ranks > 1:
        problems.append("the schedule has no sends or receives at all: with_communication() adds them")
    return problems


def check(schedule: Schedule) -> None:
    """Raise ScheduleError explaining every reason `schedule` cannot run; return None if it can."""
    problems = _structure_problems(schedule)
    if problems:
        shown = problems[:_MAX_PROBLEMS]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise ScheduleError(
            f"schedule {schedule.name!r} is invalid:\n" + "\n".join(f"  - {p}" for p in shown) + more
        )
    _Replay(schedule, Costs()).run()


def _peak_activations(actions: tuple[Action, ...]) -> int:
    held = peak = 0
    for action in actions:
        if action.kind is F:
            held += 1
            peak = max(peak, held)
        elif action.kind in (W, BW):
            held -= 1
    return peak


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimulationResult:
    """Check `schedule`, then time one step of it under `costs` (unit F, B and W by default)."""
    costs = Costs() if costs is None else costs
    check(schedule)
    timeline, step_time = _Replay(schedule, costs).run()
    busy = tuple(sum((s.end - s.start for s in spans), Fraction(0)) for spans in timeline)
    peaks = tuple(_peak_activations(actions) for actions in schedule.ranks)
    return SimulationResult(schedule, costs, timeline, step_time, busy, peaks)


# ----------------------------------------------------------------------------------------- rendering


def _label(action: Action, one_stage_per_rank: bool) -> str:
    """Microbatch number as in the Playbook's figures; the stage too when a rank holds several."""
    return f"{action.kind.value}{action.microbatch}" if one_stage_per_rank else str(action)


def _one_stage_per_rank(result: SimulationResult) -> bool:
    return result.schedule.num_stages == result.schedule.num_ranks


def render_text(result: SimulationResult) -> str:
    """An ASCII timeline, one row per rank: each span is its label padded to its length, '.' is idle."""
    single = _one_stage_per_rank(result)
    spans = [span for rank_spans in result.timeline for span in rank_spans if span.end > span.start]
    times = [t for span in spans for t in (span.start, span.end)] + [result.step_time]
    denominator = math.lcm(*(t.denominator for t in times))
    unit = Fraction(math.gcd(*(int(t * denominator) for t in times)) or 1, denominator)
    widest = max((len(_label(s.action, single)) for s in spans), default=1) + 1
    shortest = min((int((s.end - s.start) / unit) for s in spans), default=1)
    cell = -(-widest // shortest)  # characters per time unit, so the shortest span fits its label
    rows = []
    for rank, rank_spans in enumerate(result.timeline):
        row, cursor = [], Fraction(0)
        for span in rank_spans:
            if span.end == span.start:
                continue
            row.append("." * (int((span.start - cursor) / unit) * cell))
            width = int((span.end - span.start) / unit) * cell
            row.append(_label(span.action, single).ljust(width - 1)[: width - 1] + "|")
            cursor = span.end
        row.append("." * (int((result.step_time - cursor) / unit) * cell))
        rows.append(f"rank {rank} |" + "".join(row))
    summary = (
        f"{result.schedule.name}: p={result.schedule.num_ranks} m={result.schedule.num_microbatches} "
        f"stages={result.schedule.num_stages}  step={_number(result.step_time)}  "
        f"bubble={float(result.bubble_fraction):.1%}  peak activations per rank={list(result.peak_activations)}"
    )
    legend = "F forward, B input grad, W weight grad, BW full backward, '.' idle; one column = " + _number(
        unit / cell
    )
    return "\n".join([summary, *rows, legend])


def _number(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value} (~{float(value):.3g})"


_COLORS = {F: "#4C72B0", B: "#55A868", W: "#C99A2E", BW: "#8172B3"}


def render_png(result: SimulationResult, path: str | Path, seconds_per_unit: float | None = None) -> Path:
    """Draw the timeline as a PNG chart (matplotlib is imported only here, so the core needs none)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("render_png needs matplotlib: pip install matplotlib") from error
    single = _one_stage_per_rank(result)
    ranks = result.schedule.num_ranks
    step = float(result.step_time) or 1.0
    figure = Figure(figsize=(min(4 + step * 0.35, 40), 0.6 * ranks + 1.2))
    axes = figure.add_subplot()
    chunks = max(1, result.schedule.num_stages // ranks)
    for rank, spans in enumerate(result.timeline):
        for span in spans:
            start, length = float(span.start), float(span.end - span.start)
            chunk = span.action.stage // ranks
            alpha = 1.0 - 0.45 * chunk / max(1, chunks - 1) if chunks > 1 else 1.0
            axes.broken_barh(
                [(start, length)], (rank - 0.4, 0.8), facecolors=_COLORS[span.action.kind], alpha=alpha,
                edgecolor="white",
            )
            if length > 0:
                axes.text(
                    start + length / 2, rank, _label(span.action, single), ha="center", va="center",
                    fontsize=7, color="white",
                )
    axes.set_ylim(ranks - 0.5, -0.5)  # rank 0 on top, like the Playbook's figures
    axes.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    axes.set_xlim(0, step)
    axes.set_xlabel("time" if seconds_per_unit is None else f"time (x {seconds_per_unit} s)")
    axes.set_title(
        f"{result.schedule.name}: p={ranks}, m={result.schedule.num_microbatches}, "
        f"bubble {float(result.bubble_fraction):.1%}"
    )
    used = [kind for kind in _COLORS if any(span.action.kind is kind for spans in result.timeline for span in spans)]
    handles = [Patch(color=_COLORS[kind], label=kind.value) for kind in used]
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    return path


__all__ = ["Costs", "SimulationResult", "Span", "check", "render_png", "render_text", "simulate"]
