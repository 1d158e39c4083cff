"""A measured step replayed in meshkit's simulator at the durations its actions actually took.

Issue #20's runtime-overhead ratio is a measured step over the simulator's step for the same action
lists. Fed the configured sleep costs, the simulator leaves everything a loaded machine adds in the
ratio (oversleeping, code running cold after a sleep); fed one mean per action kind, it misses that
the critical path picks up the slow actions, not the average ones. So each repetition is replayed
at its own per-action durations, read from the records of that very step:

- `sleep_times`: what each action's sleeps took (any runtime: the i-th sleep on a rank belongs to
  the action whose expected sleeps it is, which the benchmark's order check confirms);
- `stage_times`: what each action's model work took, sleeps and the stage code around them (the
  stage module and the loss, the autograd backward, the deferred weight-gradient matmuls), from
  meshkit's `run_schedule(trace=...)` "stage" events.

At stage times, the simulator runs every action back to back with zero-latency messages, so
measured / replayed is exactly what the runtime adds on the critical path: dispatch, posting
transfers, messages in flight while the receiver waits, the loop, entry checks and final waits.
Nothing here measures; it reads records (see `benchmarks.pipeline.ranks.record`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from meshkit.pipeline.actions import Action, ActionKind, Schedule, compute_only, parse_action
from meshkit.pipeline.simulate import Costs, simulate

MS = 1000.0
#: The sleeps one action of each kind triggers in SleepStage (a full backward fires W's hook first).
SLEEPS_OF = {ActionKind.F: "F", ActionKind.B: "B", ActionKind.W: "W", ActionKind.BW: "WB"}

Times = dict[Action, Fraction]


def exact_ms(seconds: float) -> Fraction:
    """Milliseconds to the microsecond, exact, so the simulator's rendering stays readable."""
    return Fraction(round(seconds * MS * 1000), 1000)


@dataclass(frozen=True)
class ActionTimes(Costs):
    """Costs given per action: what each compute of one measured repetition took (ms)."""

    times: Mapping[Action, Fraction] = field(default_factory=dict)

    def duration(self, action: Action) -> Fraction:
        if not action.is_compute:
            return Fraction(0)
        return self.times[action]


def action_sleeps(schedule: Schedule, torch_first_stage: bool = False) -> list[list[tuple[Action, str]]]:
    """Per rank, each compute action with the sleeps it triggers in `SleepStage`, in order.

    On a meshkit rank whose list has W actions (DualPipeV mixes B/W with BW), the linears defer their
    weight gradients in every backward, so a BW sleeps B first and then runs its W (the hook) at once.
    torch's first stage under a B/W split sleeps nothing in B (its I does nothing) and both in W.
    """
    out = []
    for actions in compute_only(schedule).ranks:
        sleeps = dict(SLEEPS_OF)
        if not torch_first_stage and any(a.kind is ActionKind.W for a in actions):
            sleeps[ActionKind.BW] = "BW"
        first = {**sleeps, ActionKind.B: "", ActionKind.W: "WB"} if torch_first_stage else sleeps
        out.append([(a, (first if a.stage == 0 else sleeps)[a.kind]) for a in actions])
    return out


def expected_sequences(schedule: Schedule, torch_first_stage: bool = False) -> list[str]:
    """Per rank, the sleep kinds its actions trigger, in order (see `action_sleeps`)."""
    return ["".join(kinds for _, kinds in rank) for rank in action_sleeps(schedule, torch_first_stage)]


def sleep_times(schedule: Schedule, rep: Sequence[Mapping[str, Any]], torch_first_stage: bool = False) -> Times:
    """One repetition's per-action sleep durations (every rank's record of the same step).

    Raises ValueError if a rank's sleeps are not the ones its action list triggers, in that order:
    then no sleep can be attributed to an action.
    """
    times: Times = {}
    for rank, (rec, expected) in enumerate(zip(rep, action_sleeps(schedule, torch_first_stage))):
        sleeps = rec["sleeps"]
        got = "".join(kind for kind, _, _ in sleeps)
        want = "".join(kinds for _, kinds in expected)
        if got != want:
            raise ValueError(f"rank {rank} slept {got[:12]!r}..., its actions sleep {want[:12]!r}...")
        i = 0
        for action, kinds in expected:
            times[action] = exact_ms(sum(end - start for _, start, end in sleeps[i:i + len(kinds)]))
            i += len(kinds)
    return times


def stage_times(rep: Sequence[Mapping[str, Any]]) -> Times:
    """One repetition's per-action model time (sleeps plus stage code), from meshkit's trace."""
    return {parse_action(what): exact_ms(end - start)
            for rec in rep for kind, what, start, end in rec["trace"] if kind == "stage"}


def step_of(rep: Sequence[Mapping[str, Any]]) -> float:
    """The measured step (s): the last rank's end minus the first rank's start."""
    return max(r["t1"] for r in rep) - min(r["t0"] for r in rep)


def replay_ratios(schedule: Schedule, per_rank: Sequence[Sequence[Mapping[str, Any]]],
                  times_of: Callable[[Sequence[Mapping[str, Any]]], Times]) -> list[float]:
    """Per repetition: measured step / the simulator's step at that repetition's own action times."""
    ratios = []
    for rep in zip(*per_rank):
        simulated = simulate(schedule, ActionTimes(times=times_of(rep))).step_time
        ratios.append(step_of(rep) * MS / float(simulated))
    return ratios


def spread(values: Sequence[float], digits: int = 3) -> str:
    """Median [min-max]: on a shared machine the spread is part of the result."""
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


__all__ = ["ActionTimes", "action_sleeps", "exact_ms", "expected_sequences", "replay_ratios", "sleep_times",
           "spread", "stage_times", "step_of"]
