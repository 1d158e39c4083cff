"""ZB-H2, ZB-V and DualPipeV as data: valid for every size, placed as declared, bubbles and peaks as
the papers state them, drawn, and every corrupted version refused by the validator.

Pure Python, exact rational arithmetic (see test_pipeline_schedules.py for the older schedules).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.pipeline.schedules import (
    ActionKind,
    Schedule,
    ScheduleError,
    build_schedule,
    compute_only,
    dualpipe_v,
    forward_only,
    parse_schedule,
    stage_placement,
    with_communication,
    zb_h1,
    zb_h2,
    zb_v,
)
from meshkit.pipeline.simulate import Costs, check, render_png, simulate

NEW = ("zb_h2", "zb_v", "dualpipe_v")
K = ActionKind


def _examples(count: int) -> settings:
    return settings(max_examples=max(settings().max_examples, count), deadline=None)


@st.composite
def sizes(draw, name: str | None = None) -> tuple[str, int, int]:
    name = name or draw(st.sampled_from(NEW))
    p = draw(st.integers(1, 6))
    low = 2 * p if name == "dualpipe_v" else 1
    return name, p, draw(st.integers(low, max(low, 3 * p)))


def unit() -> st.SearchStrategy[Fraction]:
    return st.builds(Fraction, st.integers(1, 5), st.sampled_from([1, 2, 3]))


# ----------------------------------------------------------------------------------------- validity


@_examples(40)
@given(sizes())
def test_every_new_schedule_is_valid_and_placed_as_declared(case):
    name, p, m = case
    schedule = build_schedule(name, p, m)
    check(schedule)
    placement = schedule.stage_to_rank()
    assert placement == stage_placement(name, p)
    if name != "zb_h2":  # the V: rank r holds stage r and stage 2p-1-r, the last stage on rank 0
        assert placement == tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
        assert placement[0] == placement[-1] == 0
    assert with_communication(compute_only(schedule)) == schedule
    assert parse_schedule(str(schedule), schedule.num_stages, m, name) == schedule
    check(forward_only(schedule))


def test_the_bottom_of_the_v_needs_no_transfer():
    schedule = zb_v(4, 8)
    last_rank = schedule.ranks[3]
    assert not any(a.kind is K.SEND_F and a.stage == 3 for a in last_rank)  # stage 3 -> 4 on rank 3
    assert not any(a.kind is K.RECV_F and a.stage == 4 for a in last_rank)
    assert any(a.kind is K.RECV_F and a.stage == 7 for a in schedule.ranks[0])  # stage 6 -> 7 comes back up


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: dualpipe_v(4, 7), ["microbatches=7", "pp=4", "at least 2*pp=8", "zb_v"]),
        (lambda: build_schedule("zb_v", 2, 4, virtual_stages=3), ["virtual_stages=3", "two stages per rank"]),
        (lambda: build_schedule("zb_h2", 2, 4, virtual_stages=2), ["virtual_stages=2", "interleaved_1f1b"]),
        (lambda: zb_h2(0, 4), ["pp=0", ">= 1"]),
        (lambda: zb_v(2, False), ["microbatches=False"]),
    ],
)
def test_bad_arguments_name_argument_value_and_fix(call, words):
    with pytest.raises(ValueError) as error:
        call()
    for word in words:
        assert word in str(error.value)


# ------------------------------------------------------------------------- bubbles and peak memory


@_examples(30)
@given(sizes("zb_h2"), unit())
def test_zb_h2_is_a_parallelogram_with_2p_minus_1_in_flight(case, t):
    """Equal F, B, W times t: no rank idles inside its span (the paper's zero bubble once steps overlap);
    within one step the skew of (p-1) forwards remains, ZB-H1's bubble at these times; peak 2p-1."""
    _, p, m = case
    result = simulate(zb_h2(p, m), Costs(t, t, t))
    h1 = simulate(zb_h1(p, m), Costs(t, t, t))
    assert result.step_time <= h1.step_time
    assert result.peak_activations == (min(m, 2 * p - 1),) * p
    if m >= 2 * p - 1:
        assert result.span_idle == (0,) * p
        assert result.idle == ((p - 1) * t,) * p
        assert result.step_time == (3 * m + p - 1) * t


@_examples(30)
@given(sizes("zb_v"), unit())
def test_zb_v_bubble_tends_to_zero_at_1f1b_memory(case, t):
    """Equal chunk times t (each of the 2 chunks holds half a rank's layers): no idle inside any rank's
    span, (p-1) chunk forwards of start-up skew per step (a sixth of ZB-H1's (p-1)(TF+TB-TW) at equal
    per-rank times), and 2p chunk-microbatches at the peak: p whole microbatches, 1F1B's first rank."""
    _, p, m = case
    result = simulate(zb_v(p, m), Costs(t, t, t))
    assert max(result.peak_activations) <= 2 * p
    if m >= 2 * p - 1:
        assert result.span_idle == (0,) * p
        assert result.idle == ((p - 1) * t,) * p
        assert result.step_time == (6 * m + p - 1) * t
        assert result.bubble_fraction == Fraction(p - 1, 6 * m + p - 1)
        assert result.peak_activations == (2 * p,) * p
        one_f = simulate(build_schedule("1f1b", p, m), Costs(2 * t, 2 * t, 2 * t))  # same work per rank
        assert result.idle[0] * 6 == one_f.idle[0]


@_examples(30)
@given(sizes("dualpipe_v"), unit())
def test_dualpipe_v_pairs_forwards_with_backwards_of_the_other_chunk(case, t):
    """The steady phase is F of one stage then BW of the other stage's microbatch, adjacent: rank r has
    2(m-2p+r+1) + (p-1-r) such pairs. Run back to back (no overlap on CPU), the step equals ZB-V's, and
    each rank peaks at 2p+1 chunk-microbatches (one more than ZB-V: the pair holds both)."""
    _, p, m = case
    schedule = dualpipe_v(p, m)
    for r, actions in enumerate(compute_only(schedule).ranks):
        pairs = sum(1 for a, b in zip(actions, actions[1:])
                    if a.kind is K.F and b.kind is K.BW and a.stage != b.stage and a.microbatch != b.microbatch)
        assert pairs >= 2 * (m - 2 * p + r + 1) + (p - 1 - r)
        kinds = {a.kind for a in actions}
        assert {K.F, K.BW} <= kinds and (K.B in kinds) == (K.W in kinds)
    result = simulate(schedule, Costs(t, t, t))
    assert result.step_time == (6 * m + p - 1) * t
    assert result.peak_activations == (2 * p + 1,) * p


def test_v_schedules_match_the_published_tables_at_p4_m8():
    """Bubble rates the Zero Bubble authors tabulate for TF = TB = TW (once steps overlap): ZB-H2 0,
    ZB-V 0, against 1F1B (p-1)/m and ZB-H1 (p-1)/(3m); activation memory 2x and 1x of 1F1B's."""
    p, m = 4, 8
    one_f, h1 = simulate(build_schedule("1f1b", p, m)), simulate(zb_h1(p, m))
    h2, v = simulate(zb_h2(p, m)), simulate(zb_v(p, m), Costs(Fraction(1, 2), Fraction(1, 2), Fraction(1, 2)))
    work = 3 * m
    assert one_f.idle[0] / work == Fraction(p - 1, m)
    assert h1.idle[0] / work == Fraction(p - 1, 3 * m)
    assert h2.span_idle == v.span_idle == (0,) * p
    assert max(h2.peak_activations) == 2 * p - 1 and max(v.peak_activations) == 2 * max(one_f.peak_activations)


# ------------------------------------------------------------------------------ corrupted versions


def _mutations(schedule: Schedule) -> dict[str, Schedule]:
    """Named corruptions of one schedule, each of which the validator must refuse."""
    ranks = [list(actions) for actions in schedule.ranks]
    out: dict[str, list[list]] = {}

    def edit(name, fn):
        copy = [list(actions) for actions in ranks]
        fn(copy)
        out[name] = copy

    first_b = next(i for i, a in enumerate(ranks[0]) if a.kind in (K.B, K.BW))
    edit("drop a backward", lambda rs: rs[0].pop(first_b))
    edit("duplicate a forward", lambda rs: rs[0].insert(0, next(a for a in rs[0] if a.kind is K.F)))
    edit("backward first", lambda rs: rs[0].insert(0, rs[0].pop(first_b)))
    last = len(ranks) - 1
    if last > 0:  # wait for a gradient before sending anything downstream: a cycle
        edit("receive first", lambda rs: rs[0].insert(0, rs[0].pop(next(
            i for i, a in enumerate(rs[0]) if a.kind is K.RECV_B))))
        edit("drop a send", lambda rs: rs[last].pop(next(
            i for i, a in enumerate(rs[last]) if a.kind in (K.SEND_F, K.SEND_B))))
        edit("stage on two ranks", lambda rs: rs[1].append(next(a for a in rs[0] if a.kind is K.F)))
    w = next((i for i, a in enumerate(ranks[0]) if a.kind is K.W), None)
    if w is not None:
        edit("W before its B", lambda rs: rs[0].insert(0, rs[0].pop(w)))
        edit("W dropped", lambda rs: rs[0].pop(w))
    return {name: Schedule(tuple(map(tuple, rs)), schedule.num_stages, schedule.num_microbatches, name)
            for name, rs in out.items()}


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("p", [2, 4])
def test_the_validator_refuses_corrupted_versions(name, p):
    schedule = build_schedule(name, p, 2 * p)
    mutations = _mutations(schedule)
    assert len(mutations) >= 6
    for label, broken in mutations.items():
        with pytest.raises(ScheduleError) as error:
            check(broken)
        assert str(error.value), label


@_examples(40)
@given(st.sampled_from(NEW), st.sampled_from([2, 3, 4]), st.data())
def test_random_swaps_are_refused_or_still_valid(name, p, data):
    """A swap of two neighbouring actions either still runs (then the simulator times it) or is explained."""
    schedule = build_schedule(name, p, 2 * p)
    ranks = [list(actions) for actions in schedule.ranks]
    rank = data.draw(st.integers(0, p - 1))
    i = data.draw(st.integers(0, len(ranks[rank]) - 2))
    ranks[rank][i], ranks[rank][i + 1] = ranks[rank][i + 1], ranks[rank][i]
    perturbed = Schedule(tuple(map(tuple, ranks)), schedule.num_stages, schedule.num_microbatches, "swapped")
    try:
        check(perturbed)
    except ScheduleError as error:
        assert "rank" in str(error)
    else:
        simulate(perturbed)


# ------------------------------------------------------------------------------------------ drawing


@pytest.mark.parametrize("name", NEW)
def test_png_timelines(tmp_path, name):
    pytest.importorskip("matplotlib")
    path = render_png(simulate(build_schedule(name, 2, 4)), tmp_path / f"{name}.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
