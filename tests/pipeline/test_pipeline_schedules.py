"""Pipeline schedules and their simulator: every generator is valid, and the bubble formulas hold exactly.

Pure Python (no processes), exact rational arithmetic, so formulas are compared with `==`.
The profile comes from the environment through conftest (`HYPOTHESIS_PROFILE`, derandomized `ci` by
default). These tests are cheap, so each runs at least its own example count (more if the profile
asks for more) and the whole file still takes seconds.
"""

from __future__ import annotations

import pickle
import re
from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from meshkit.pipeline.schedules import (
    SCHEDULES,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    build_schedule,
    compute_only,
    forward_only,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    parse_action,
    parse_schedule,
    splits_weight_grad,
    with_communication,
    zb_h1,
)
from meshkit.pipeline.simulate import Costs, check, render_png, render_text, simulate


def _examples(count: int) -> settings:
    return settings(max_examples=max(settings().max_examples, count), deadline=None)


@st.composite
def shapes(draw, min_m_per_p: int = 1) -> tuple[int, int]:
    """(p, m) with p in 1..8 and m in p..3p (or from 1 when min_m_per_p=0)."""
    p = draw(st.integers(1, 8))
    return p, draw(st.integers(p if min_m_per_p else 1, 3 * p))


def exact_costs(max_value: int = 6) -> st.SearchStrategy[Fraction]:
    return st.builds(Fraction, st.integers(1, max_value), st.sampled_from([1, 2, 3]))


def all_schedules(p: int, m: int, v: int) -> list[Schedule]:
    return [gpipe(p, m), one_f_one_b(p, m), zb_h1(p, m), interleaved_1f1b(p, m, v)]


# ------------------------------------------------------------------------------------ generators


@_examples(40)
@given(shapes(), st.integers(1, 4))
def test_every_generator_passes_check(shape, v):
    p, m = shape
    for schedule in all_schedules(p, m, v):
        check(schedule)
        placement = schedule.stage_to_rank()
        assert placement == tuple(s % p for s in range(schedule.num_stages))
        assert with_communication(compute_only(schedule)) == schedule
        for rank, actions in enumerate(schedule.ranks):
            for i, action in enumerate(actions):
                if action.kind in (ActionKind.SEND_F, ActionKind.SEND_B):  # right after its producer
                    assert actions[i - 1].stage == action.stage and actions[i - 1].is_compute
                if action.kind in (ActionKind.RECV_F, ActionKind.RECV_B):  # right before its consumer
                    assert actions[i + 1].stage == action.stage and actions[i + 1].is_compute
            assert all(placement[a.stage] == rank for a in actions)


@pytest.mark.parametrize("name", SCHEDULES)
def test_whether_a_schedule_defers_weight_gradients_is_known_from_its_name(name):
    """parallelize picks the TP implementation from `splits_weight_grad` before building any schedule."""
    v = 2 if name == "interleaved_1f1b" else 1
    schedule = build_schedule(name, 4, 8, v)
    has_w = any(a.kind is ActionKind.W for actions in schedule.ranks for a in actions)
    assert splits_weight_grad(name) == has_w


def test_one_rank_needs_no_communication():
    for schedule in all_schedules(1, 3, 3):
        check(schedule)
        assert all(action.is_compute for action in schedule.ranks[0])


def test_zb_h1_w_trails_b_by_rank():
    schedule = compute_only(zb_h1(4, 8))
    for rank, actions in enumerate(schedule.ranks):
        kinds = [a.kind for a in actions]
        first_w = kinds.index(ActionKind.W)
        assert kinds[:first_w].count(ActionKind.B) == rank + 1
        assert kinds[: (4 - 1 - rank)] == [ActionKind.F] * (4 - 1 - rank)


def test_v_shaped_placement_needs_no_p2p_at_the_bottom_of_the_v():
    """The format is not tied to s % p: stages 0,3 on rank 0 and 1,2 on rank 1 (ZB-V's placement)."""
    compute = parse_schedule(
        "rank 0: F0.0 F0.1 F3.0 F3.1 BW3.0 BW3.1 BW0.0 BW0.1\n"
        "rank 1: F1.0 F2.0 F1.1 F2.1 BW2.0 BW1.0 BW2.1 BW1.1"
    )
    schedule = with_communication(compute)
    check(schedule)
    assert schedule.stage_to_rank() == (0, 1, 1, 0)
    assert parse_action("SEND_F1.0") not in schedule.ranks[1]  # stage 1 -> 2 stays on rank 1
    assert parse_action("RECV_F3.0") in schedule.ranks[0]  # stage 2 -> 3 crosses back to rank 0
    assert simulate(schedule).step_time > 0


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: interleaved_1f1b(4, 3, 2), ["microbatches=3", "pp=4", "microbatches >= 4"]),
        (lambda: interleaved_1f1b(4, 8, 0), ["virtual_stages=0", ">= 1"]),
        (lambda: one_f_one_b(0, 4), ["pp=0", ">= 1"]),
        (lambda: gpipe(2, 0), ["microbatches=0", ">= 1"]),
        (lambda: zb_h1(True, 4), ["pp=True"]),
        (lambda: build_schedule("1F1B", 2, 4), ["pp_schedule='1F1B'", "1f1b"]),
        (lambda: build_schedule("zb_h1", 2, 4, virtual_stages=2), ["virtual_stages=2", "interleaved_1f1b"]),
        (lambda: Costs(forward=-1), ["forward=-1", ">= 0"]),
    ],
)
def test_bad_arguments_name_argument_value_and_fix(call, words):
    with pytest.raises(ValueError) as error:
        call()
    for word in words:
        assert word in str(error.value)


# ------------------------------------------------------------------------------------ text format


@_examples(60)
@given(st.sampled_from(list(ActionKind)), st.integers(0, 10**6), st.integers(0, 10**6))
def test_action_text_round_trips(kind, stage, microbatch):
    action = Action(kind, stage, microbatch)
    assert parse_action(str(action)) == action
    assert str(parse_action(str(action))) == str(action)


@pytest.mark.parametrize(
    "text",
    ["2BW0", "BW", "F3", "F3.", "F.1", "f3.1", "F03.1", "F3.01", " F3.1", "F3.1 ", "F3.1.2", "BWX3.1",
     "SEND3.1", "RECV_F-1.0", "F3,1", "F\uff13.1", "", "B W3.1", "FW3.1", "I3.1", "F3.1\n", "SEND_F_3.1"],
)
def test_malformed_action_text_is_refused(text):
    with pytest.raises(ScheduleError, match="action"):
        parse_action(text)


@_examples(20)
@given(shapes(), st.integers(1, 3))
def test_schedule_text_round_trips(shape, v):
    p, m = shape
    for schedule in all_schedules(p, m, v):
        text = str(schedule)
        assert parse_schedule(text, schedule.num_stages, schedule.num_microbatches, schedule.name) == schedule
        assert parse_schedule(text, name=schedule.name) == schedule


def test_cached_hash_agrees_with_equality_and_is_not_pickled():
    """The runtime's per-call caches key on the schedule, whose hash is cached on first use: equal
    schedules still hash equal (whichever was hashed first), unequal ones differ, and a pickled copy
    (sent to another process, where string hashes differ) carries no stale hash."""
    a, b = build_schedule("zb_v", 3, 4), build_schedule("zb_v", 3, 4)
    hash(a)
    assert a == b and hash(a) == hash(b) == hash(a)
    assert hash(build_schedule("zb_v", 3, 5)) != hash(a) and {a: 1}[b] == 1
    copy = pickle.loads(pickle.dumps(a))
    assert copy == a and "_hash" not in copy.__getstate__() and hash(copy) == hash(a)


@pytest.mark.parametrize("text", ["rank 1: F0.0", "rank 0:F0.0", "rank 0: F0.0  BW0.0", "F0.0 BW0.0", ""])
def test_malformed_schedule_text_is_refused(text):
    with pytest.raises(ScheduleError):
        parse_schedule(text)


@_examples(40)
@given(shapes(), st.integers(1, 4), exact_costs())
def test_forward_only_keeps_each_ranks_forward_order_and_fills_the_pipe_once(shape, v, tf):
    """Evaluation runs the forwards of the training schedule: one fill, (m·v + p - 1) chunk forwards."""
    p, m = shape
    for schedule in all_schedules(p, m, v):
        evaluation = forward_only(schedule)
        check(evaluation)
        for train_actions, eval_actions in zip(schedule.ranks, evaluation.ranks):
            assert eval_actions == tuple(a for a in train_actions if a.kind in (
                ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F))
        chunks = schedule.num_stages // p
        assert simulate(evaluation, Costs(tf, 1, 1)).step_time == (m * chunks + p - 1) * tf


def test_forward_only_schedules_refuse_backward_actions_and_report_missing_sends():
    with pytest.raises(ScheduleError, match="BW0.0 in a forward-only schedule"):
        Schedule(((parse_action("F0.0"), parse_action("BW0.0")),), 1, 1, forward_only=True)
    broken = parse_schedule("rank 0: F0.0\nrank 1: RECV_F1.0 F1.0", 2, 1)
    with pytest.raises(ScheduleError, match="SEND_F0.0 is missing on rank 0"):
        check(Schedule(broken.ranks, 2, 1, "broken", forward_only=True))


# ------------------------------------------------------------------------------------ bubble formulas


@_examples(40)
@given(shapes(min_m_per_p=0), exact_costs(), exact_costs(), exact_costs())
def test_1f1b_and_gpipe_bubble_is_p_minus_1_slots(shape, tf, tb, tw):
    """Idle per rank (p-1)(TF+TB+TW), so the bubble is (p-1)/(m+p-1) of the step for any costs."""
    p, m = shape
    for schedule in (one_f_one_b(p, m), gpipe(p, m)):
        result = simulate(schedule, Costs(tf, tb, tw))
        assert result.idle == ((p - 1) * (tf + tb + tw),) * p
        assert result.step_time == (m + p - 1) * (tf + tb + tw)
        assert result.bubble_fraction == Fraction(p - 1, m + p - 1)
    assert simulate(one_f_one_b(p, m)).peak_activations == tuple(min(p - r, m) for r in range(p))
    assert simulate(gpipe(p, m)).peak_activations == (m,) * p


@_examples(40)
@given(shapes(), st.integers(1, 4), exact_costs(), exact_costs(), exact_costs())
def test_interleaved_divides_the_bubble_by_v(shape, v, tf, tb, tw):
    """Same model per rank: each of v stages costs 1/v of 1F1B's, and so does the bubble."""
    p, m = shape
    one_f = simulate(one_f_one_b(p, m), Costs(tf, tb, tw))
    interleaved = simulate(interleaved_1f1b(p, m, v), Costs(tf / v, tb / v, tw / v))
    assert interleaved.busy == one_f.busy
    assert interleaved.idle == tuple(idle / v for idle in one_f.idle)
    # Peak in stage-microbatches (1/v of the rank's activations each): the warm-up forwards plus one.
    first_group = p + m % p
    expected = [min(2 * (p - 1 - r) + (v - 1) * first_group + 1, m * v) for r in range(p)]
    assert interleaved.peak_activations == (tuple(expected) if v > 1 else one_f.peak_activations)


@_examples(40)
@given(shapes(min_m_per_p=0), exact_costs(), exact_costs(), exact_costs())
def test_zb_h1_bubble_and_peak_memory(shape, tf, tb, tw):
    """(p-1)(TF+TB-TW) when TW <= TF, TB; in general (p-1)(TF+TB-min(TF, TB, TW)), for m >= p."""
    p, m = shape
    result = simulate(zb_h1(p, m), Costs(tf, tb, tw))
    if m >= p:
        assert result.idle == ((p - 1) * (tf + tb - min(tf, tb, tw)),) * p
        if tw <= min(tf, tb):
            assert result.idle == ((p - 1) * (tf + tb - tw),) * p
    one_f = simulate(one_f_one_b(p, m), Costs(tf, tb, tw))
    assert result.step_time <= one_f.step_time
    # Every rank holds min(p, m) microbatches at its peak: 1F1B's peak (its first rank), never more.
    assert result.peak_activations == (min(p, m),) * p
    assert max(result.peak_activations) == max(one_f.peak_activations) == one_f.peak_activations[0]


def test_zb_h1_is_a_third_of_1f1b_at_equal_times():
    zb, one_f = simulate(zb_h1(4, 8)), simulate(one_f_one_b(4, 8))
    assert zb.idle[0] * 3 == one_f.idle[0] == 9


@_examples(20)
@given(shapes(min_m_per_p=0), exact_costs(), exact_costs(), st.integers(0, 4))
def test_gpipe_pays_latency_twice_per_hop(shape, tf, tb, latency):
    p, m = shape
    result = simulate(gpipe(p, m), Costs(tf, tb, 0, p2p_latency=latency))
    assert result.step_time == (m + p - 1) * (tf + tb) + 2 * (p - 1) * latency


# ------------------------------------------------------------------------------------ broken schedules


def _broken(text: str, name: str = "broken") -> Schedule:
    return parse_schedule(text, name=name)


def _error(schedule: Schedule) -> str:
    with pytest.raises(ScheduleError) as error:
        check(schedule)
    return str(error.value)


def test_missing_receive_is_reported_with_its_peer():
    text = str(one_f_one_b(2, 2)).replace("RECV_F1.1 ", "")
    message = _error(_broken(text))
    assert "RECV_F1.1 is missing on rank 1" in message and "from rank 0" in message


def test_deadlock_names_the_blocked_ranks_and_the_cycle():
    # Rank 0 waits for a gradient before sending the activations rank 1 needs to produce it.
    schedule = _broken("rank 0: F0.0 RECV_B0.0 SEND_F0.0 BW0.0\nrank 1: RECV_F1.0 F1.0 BW1.0 SEND_B1.0")
    message = _error(schedule)
    assert "deadlock" in message
    assert "rank 0 blocks at position 1 on RECV_B0.0, waiting for SEND_B1.0 (rank 1, position 3)" in message
    assert "rank 1 blocks at position 0 on RECV_F1.0, waiting for SEND_F0.0 (rank 0, position 2)" in message
    assert "cycle: rank 0 -> rank 1 -> rank 0" in message


def test_swapped_order_deadlocks():
    ranks = [list(actions) for actions in compute_only(one_f_one_b(2, 2)).ranks]
    assert list(map(str, ranks[0])) == ["F0.0", "F0.1", "BW0.0", "BW0.1"]
    ranks[0][1], ranks[0][2] = ranks[0][2], ranks[0][1]  # rank 0 wants mb 0's gradient before sending mb 1
    ranks[1][1], ranks[1][2] = ranks[1][2], ranks[1][1]  # rank 1 wants mb 1 before returning mb 0's gradient
    message = _error(with_communication(Schedule(tuple(map(tuple, ranks)), 2, 2, "swapped")))
    assert "deadlock in schedule 'swapped'" in message
    assert "rank 0 blocks at position 2 on RECV_B0.0" in message
    assert "rank 1 blocks at position 2 on RECV_F1.1" in message
    assert "cycle: rank 0 -> rank 1 -> rank 0" in message


def test_compute_before_its_input_is_an_order_error():
    ranks = [list(actions) for actions in one_f_one_b(3, 3).ranks]
    ranks[2].reverse()  # the last rank now runs backwards before forwards and sends before computing
    message = _error(Schedule(tuple(map(tuple, ranks)), 3, 3, "reversed"))
    assert "rank 2 position 0: SEND_B2.2 runs before BW2.2" in message


def test_duplicate_forward_is_reported_with_both_positions():
    message = _error(_broken("rank 0: F0.0 F0.0 BW0.0"))
    assert "F0.0 appears 2 times (rank 0 position 0, rank 0 position 1)" in message


@pytest.mark.parametrize(
    "text, words",
    [
        ("rank 0: BW0.0 F0.0", ["position 0: BW0.0 runs before F0.0 (rank 0, position 1)"]),
        ("rank 0: F0.0 W0.0 B0.0", ["W0.0 runs before B0.0"]),
        ("rank 0: F0.0 B0.0", ["B0.0 has no W0.0"]),
        ("rank 0: F0.0 B0.0 W0.0 BW0.0", ["a backward is either BW or a B/W pair"]),
        ("rank 0: F0.0", ["no backward for stage 0 microbatch 0"]),
        ("rank 0: F0.0 BW0.0 F1.0 BW1.0\nrank 1: F1.0 BW1.0", ["stage 1 is computed on ranks [0, 1]"]),
        ("rank 0: F0.0 BW0.0\nrank 1: F1.0 BW1.0", ["no sends or receives at all", "with_communication"]),
        ("rank 0: F0.0 F1.0 SEND_F0.0 BW1.0 BW0.0", ["SEND_F0.0 is not needed", "both live on rank 0"]),
        ("rank 0: F0.0 SEND_F0.0 BW0.0", ["SEND_F0.0 has no peer: stage 1 does not exist"]),
        ("rank 0: F0.0 RECV_F1.0 BW0.0\nrank 1: F1.0 BW1.0", ["RECV_F1.0 names stage 1, which lives on rank 1"]),
    ],
)
def test_broken_schedules_are_explained(text, words):
    message = _error(_broken(text))
    for word in words:
        assert word in message


def test_missing_last_microbatch_is_caught_when_sizes_are_given():
    text = str(one_f_one_b(2, 3))
    kept = "\n".join(" ".join(t for t in line.split(" ") if not t.endswith(".2")) for line in text.splitlines())
    check(parse_schedule(kept))  # a valid 2-microbatch schedule...
    assert "F0.2 is missing" in _error(parse_schedule(kept, num_microbatches=3))  # ...but not 3


@_examples(60)
@given(st.sampled_from(["gpipe", "1f1b", "zb_h1", "interleaved_1f1b"]), shapes(), st.data())
def test_perturbed_schedules_are_refused_or_still_valid(name, shape, data):
    """Swapping, dropping or duplicating an action never crashes check: it runs or it explains."""
    p, m = shape
    schedule = build_schedule(name, p, m, 2 if name == "interleaved_1f1b" else 1)
    ranks = [list(actions) for actions in schedule.ranks]
    rank = data.draw(st.integers(0, p - 1))
    assume(len(ranks[rank]) >= 2)
    i = data.draw(st.integers(0, len(ranks[rank]) - 2))
    edit = data.draw(st.sampled_from(["swap", "drop", "duplicate"]))
    if edit == "swap":
        ranks[rank][i], ranks[rank][i + 1] = ranks[rank][i + 1], ranks[rank][i]
    elif edit == "drop":
        del ranks[rank][i]
    else:
        ranks[rank].insert(i, ranks[rank][i])
    perturbed = Schedule(tuple(map(tuple, ranks)), schedule.num_stages, m, "perturbed")
    try:
        check(perturbed)
    except ScheduleError as error:
        assert str(error)
        assert edit == "swap" or re.search("missing|appears|no backward|has no|computed on", str(error))
    else:
        assert edit == "swap"
        simulate(perturbed)


# ------------------------------------------------------------------------------------ rendering


@_examples(20)
@given(st.sampled_from(["gpipe", "1f1b", "zb_h1", "interleaved_1f1b"]), shapes(), exact_costs(3), exact_costs(3))
def test_text_timeline_draws_time_to_scale(name, shape, tf, tb):
    p, m = shape
    result = simulate(build_schedule(name, p, m, 2 if name == "interleaved_1f1b" else 1), Costs(tf, tb, tf))
    lines = render_text(result).splitlines()
    rows = [line.split("|", 1)[1] for line in lines if line.startswith("rank ")]
    assert len(rows) == p and len({len(row) for row in rows}) == 1
    columns_per_time = len(rows[0]) / result.step_time
    for row, idle, spans in zip(rows, result.idle, result.timeline):
        dots_in_labels = len(spans) if result.schedule.num_stages > p else 0  # "F5.1" names the stage
        assert row.count(".") - dots_in_labels == idle * columns_per_time
    assert f"step={result.step_time.numerator}" in lines[0] or f"step={result.step_time}" in lines[0]


def test_text_timeline_example():
    text = render_text(simulate(one_f_one_b(2, 2)))
    assert text.splitlines()[1:3] == [
        "rank 0 |F0 |F1 |........BW0    |....BW1    |",
        "rank 1 |....F0 |BW0    |F1 |BW1    |........",
    ]


def test_png_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    path = render_png(simulate(interleaved_1f1b(2, 4, 2)), tmp_path / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
