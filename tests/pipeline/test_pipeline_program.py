"""`meshkit.pipeline.program`: where each rank's transfers are posted, resolved once per schedule.

Checked against the action lists themselves and the simulator's timeline (independent of the
compiler): every action appears exactly once, computes in list order, sends right after their
producer, each receive before its consumer and no earlier than the window allows, and a receive
moved early only into a step the simulator has the rank start after waiting.
"""

from __future__ import annotations

import pytest

from meshkit.pipeline.actions import ActionKind, compute_only
from meshkit.pipeline.program import compile_rank, idle_before
from meshkit.pipeline.runtime import RECEIVE_WINDOW
from meshkit.pipeline.schedules import build_schedule
from meshkit.pipeline.simulate import simulate

K = ActionKind
CASES = [("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zb_v", 2), ("dualpipe_v", 2), ("dualpipe", 2)]


def _consumer_step(schedule, rank: int) -> dict:
    """Each receive's consumer, as the index of the compute that takes it (F or B/BW of that stage, mb)."""
    computes = compute_only(schedule).ranks[rank]
    index = {(a.kind, a.stage, a.microbatch): j for j, a in enumerate(computes)}
    out = {}
    for a in schedule.ranks[rank]:
        if a.kind is K.RECV_F:
            out[a] = index[(K.F, a.stage, a.microbatch)]
        elif a.kind is K.RECV_B:
            out[a] = index.get((K.B, a.stage, a.microbatch), index.get((K.BW, a.stage, a.microbatch)))
    return out


@pytest.mark.parametrize("name,v", CASES)
@pytest.mark.parametrize("window", [0, 3, 16, RECEIVE_WINDOW])
def test_steps_keep_the_order_and_post_receives_within_the_window(name, v, window):
    schedule = build_schedule(name, 4 if name == "dualpipe" else 3, 6, v)  # DualPipe: pp even
    timeline = simulate(schedule).timeline
    moved = 0
    for rank, actions in enumerate(schedule.ranks):
        steps = compile_rank(schedule, rank, 1, window)
        computes = [c.action for _, c in steps if c is not None]
        assert computes == list(compute_only(schedule).ranks[rank])
        posted = [p.action for posts, _ in steps for p in posts]
        assert sorted(map(str, posted)) == sorted(str(a) for a in actions if not a.is_compute)
        spans = timeline[rank]
        waits = {j for j, s in enumerate(spans) if s.start > (spans[j - 1].end if j else 0)}
        consumer = _consumer_step(schedule, rank)
        for step, (posts, _) in enumerate(steps):
            for p in posts:
                if p.send:  # right after its producer: the step after the compute that made it
                    producer = next(j for j, a in enumerate(computes) if a.stage == p.stage
                                    and a.microbatch == p.microbatch and (a.kind is K.F) == p.forward)
                    assert step == producer + 1, (rank, p.action)
                else:
                    usual = max(consumer[p.action] - 1, 0)
                    assert step <= consumer[p.action] and usual - window <= step <= usual, (rank, p.action)
                    assert step == usual or step in waits, (rank, p.action, step)
                    moved += step < usual
    # ranks after the first wait for their first input: with a window, receives move into that wait
    assert (moved > 0) == (window > 0)


@pytest.mark.parametrize("name,v", CASES)
def test_gloo_window_takes_every_receive_of_a_waiting_rank_off_its_busy_steps(name, v):
    """The runtime's gloo window at pp=4, m=8: a rank whose first compute waits for its input posts
    every one of its receives in a step where it waits anyway (the simulator's), none between two
    busy computes (the first test checks each still precedes its consumer). Under DualPipe the last
    rank starts at once too (its up pipeline's first stage): the middle ranks wait."""
    schedule = build_schedule(name, 4, 8, v)
    for rank in (1, 2) if name == "dualpipe" else (1, 2, 3):
        waits = idle_before(schedule)[rank]
        assert 0 in waits, (name, rank)
        steps = compile_rank(schedule, rank, 1, RECEIVE_WINDOW)
        receives = [(j, p.action) for j, (posts, _) in enumerate(steps) for p in posts if not p.send]
        assert receives and all(j in waits for j, _ in receives), (name, rank)


@pytest.mark.parametrize("name", ["zb_v", "dualpipe_v"])
def test_the_v_tip_is_handed_over_locally_never_through_the_transport(name):
    """Rank p-1 holds stages p-1 and p (the V's tip): stage p's forward input and stage p-1's output
    gradient are this rank's own tensors, so no step posts a transfer for that boundary and no
    transfer anywhere has its own rank as the peer."""
    p = 4
    schedule = build_schedule(name, p, 8, 2)
    for rank in range(p):
        for posts, compute in compile_rank(schedule, rank, 1, RECEIVE_WINDOW):
            assert all(post.peer != rank for post in posts), (rank, posts)
            if compute is not None and rank == p - 1 and compute.stage in (p - 1, p):
                local = (compute.kind is K.F and compute.stage == p) or (
                    compute.kind in (K.B, K.BW) and compute.stage == p - 1)
                assert not local or compute.received is None, compute.action
        if rank == p - 1:
            tip = [post for posts, _ in compile_rank(schedule, rank, 1, RECEIVE_WINDOW) for post in posts
                   if post.boundary == p - 1]
            assert tip == [], tip
