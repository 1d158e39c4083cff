"""`benchmarks.pipeline.replay`: a measured step replayed at its own per-action durations.

The records are built from an independent timeline: each rank runs its actions back to back at
uneven durations, every message arriving the moment it is sent (what a runtime with no overhead
would measure), computed here by a plain event loop over the action lists, not by the simulator.
Replaying such records must give the measured step exactly (ratio 1); one kind-mean per action
kind does not, which is why the benchmark replays per action.
"""

from __future__ import annotations

import statistics
from fractions import Fraction

import pytest

from benchmarks.pipeline.replay import (
    ActionTimes,
    action_sleeps,
    replay_ratios,
    sleep_times,
    stage_times,
)
from meshkit.pipeline.actions import Action, ActionKind, compute_only
from meshkit.pipeline.schedules import build_schedule
from meshkit.pipeline.simulate import Costs, simulate

K = ActionKind


def _duration(action: Action) -> Fraction:
    """Uneven, action-specific durations (ms), so that per-kind means differ from each action's own."""
    base = {K.F: 3, K.B: 4, K.W: 2, K.BW: 6}[action.kind]
    return Fraction(base) + Fraction((7 * action.stage + 3 * action.microbatch) % 5, 2)


def _ideal_records(schedule) -> list[dict]:
    """Per rank: what a zero-overhead runtime would record (times in s), from an event loop of its own."""
    owner = schedule.stage_to_rank()
    done: dict[tuple, Fraction] = {}  # (kind, stage, mb) of a compute -> its end (ms)
    clock = [Fraction(0)] * schedule.num_ranks
    position = [0] * schedule.num_ranks
    computes = compute_only(schedule).ranks
    events: list[list[tuple[Action, Fraction, Fraction]]] = [[] for _ in computes]

    def ready(rank: int, a: Action) -> Fraction | None:
        """When `a`'s inputs from another rank are there (None: not yet computed)."""
        mb, up, down = a.microbatch, schedule.upstream(a.stage), schedule.downstream(a.stage)
        if a.kind is K.F and up is not None and owner[up] != rank:
            return done.get((K.F, up, mb))
        if a.kind in (K.B, K.BW) and down is not None and owner[down] != rank:
            return done.get((K.B, down, mb), done.get((K.BW, down, mb)))
        return Fraction(0)

    while any(position[r] < len(computes[r]) for r in range(len(computes))):
        for rank, actions in enumerate(computes):
            while position[rank] < len(actions):
                a = actions[position[rank]]
                at = ready(rank, a)
                if at is None:
                    break
                start = max(clock[rank], at)
                clock[rank] = start + _duration(a)
                done[(a.kind, a.stage, a.microbatch)] = clock[rank]
                events[rank].append((a, start, clock[rank]))
                position[rank] += 1
    records = []
    for rank, (rank_events, sleeps_of) in enumerate(zip(events, action_sleeps(schedule))):
        sleeps = []
        for (_, start, end), (_, kinds) in zip(rank_events, sleeps_of):
            part = (end - start) / len(kinds)
            sleeps += [(kind, float((start + i * part) / 1000), float((start + (i + 1) * part) / 1000))
                       for i, kind in enumerate(kinds)]
        records.append({"t0": 0.0, "t1": float(clock[rank] / 1000), "sleeps": sleeps,
                        "trace": [("stage", str(a), float(s / 1000), float(e / 1000)) for a, s, e in rank_events]})
    return records


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("dualpipe_v", 2),
                                    ("dualpipe", 1)])
def test_replay_of_an_overhead_free_step_is_exact(name, v):
    schedule = build_schedule(name, 4 if name == "dualpipe" else 3, 6, v)  # DualPipe: pp even
    recs = _ideal_records(schedule)
    per_rank = [[rec] for rec in recs]  # one repetition
    assert replay_ratios(schedule, per_rank, stage_times) == [pytest.approx(1.0, abs=1e-9)]
    assert replay_ratios(schedule, per_rank, lambda rep: sleep_times(schedule, rep)) == [
        pytest.approx(1.0, abs=1e-9)]
    times = sleep_times(schedule, recs)
    assert all(times[a] == pytest.approx(_duration(a), abs=1e-3) for a in times)
    assert set(times) == {a for actions in compute_only(schedule).ranks for a in actions}


def test_one_mean_per_kind_misreads_the_step_that_per_action_replay_gets_exactly():
    schedule = build_schedule("zb_h1", 3, 6)
    recs = _ideal_records(schedule)
    times = stage_times(recs)
    means = {kind: statistics.fmean(float(t) for a, t in times.items() if a.kind is kind) for kind in (K.F, K.B, K.W)}
    by_kind = simulate(schedule, Costs(*(Fraction(means[k]).limit_denominator(10**6) for k in (K.F, K.B, K.W))))
    by_action = simulate(schedule, ActionTimes(times=times))
    step_ms = max(r["t1"] for r in recs) * 1000
    assert float(by_action.step_time) == pytest.approx(step_ms, abs=1e-6)
    assert abs(float(by_kind.step_time) - step_ms) > 0.1


def test_a_delayed_message_shows_in_the_ratio():
    """A runtime that adds time between actions: the replay leaves exactly that time in the ratio."""
    schedule = build_schedule("gpipe", 2, 1)
    recs = _ideal_records(schedule)
    step = max(r["t1"] for r in recs)
    late = [dict(r, t1=r["t1"] + 0.005 if r["t1"] == step else r["t1"]) for r in recs]
    assert replay_ratios(schedule, [[r] for r in late], stage_times) == [pytest.approx((step + 0.005) / step)]


def test_sleeps_out_of_order_cannot_be_attributed():
    schedule = build_schedule("1f1b", 2, 2)
    recs = _ideal_records(schedule)
    swapped = dict(recs[1], sleeps=list(reversed(recs[1]["sleeps"])))
    with pytest.raises(ValueError, match="rank 1 slept"):
        sleep_times(schedule, [recs[0], swapped])


def test_torchs_first_stage_split_charges_its_whole_backward_to_w():
    """torch's first stage under ZB: its I sleeps nothing (costs 0) and its W sleeps W then B."""
    schedule = build_schedule("zb_h1", 2, 2)
    sleeps = action_sleeps(schedule, torch_first_stage=True)[0]
    kinds = {a: k for a, k in sleeps}
    assert kinds[Action(K.B, 0, 0)] == "" and kinds[Action(K.W, 0, 0)] == "WB" and kinds[Action(K.F, 0, 1)] == "F"
    rec = {"sleeps": [], "t0": 0.0, "t1": 1.0}
    t = 0.0
    for _, k in sleeps:
        for kind in k:
            rec["sleeps"].append((kind, t, t + 0.002))
            t += 0.002
    other = {"sleeps": [(k, 0.0, 0.001) for _, ks in action_sleeps(schedule, True)[1] for k in ks]}
    times = sleep_times(schedule, [rec, other], torch_first_stage=True)
    assert times[Action(K.B, 0, 0)] == 0 and times[Action(K.W, 0, 1)] == Fraction(4)
