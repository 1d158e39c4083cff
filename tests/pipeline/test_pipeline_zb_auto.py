"""zb_auto (the Zero Bubble paper's automatic schedule): valid and within its memory limit for any costs,
never slower than the handcrafted ZB-H1 / ZB-H2 that fit the limit, faster where they leave the given
memory unused; ZB-H1 itself at unit costs; bad limits refused; the measured costs agreed on by every
rank; through `parallelize` against one device (its first step is the profiling run).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests_support import assert_matches_reference

import meshkit
from meshkit.estimate.core import StageCosts
from meshkit.pipeline import auto
from meshkit.pipeline.costs import StageTable, agree, local_times
from meshkit.pipeline.costs import given as given_costs
from meshkit.pipeline.runtime import TraceEvent
from meshkit.pipeline.schedules import (
    Action,
    ActionKind,
    build_schedule,
    compute_only,
    splits_weight_grad,
    zb_auto,
    zb_h1,
    zb_h2,
)
from meshkit.pipeline.simulate import Costs, check, simulate
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

K = ActionKind
time_unit = st.builds(Fraction, st.integers(1, 8), st.just(4))


@st.composite
def cases(draw):
    p = draw(st.integers(1, 4))
    m = draw(st.integers(1, 3 * p + 1))
    weights = tuple(draw(st.lists(time_unit, min_size=p, max_size=p)))
    costs = StageCosts(draw(time_unit), draw(time_unit), draw(time_unit), draw(st.sampled_from([0, Fraction(1, 8)])),
                       weights=weights)
    return p, m, costs, draw(st.integers(1, 2 * p + 1))


@settings(max_examples=25, deadline=None)
@given(cases())
def test_valid_within_its_limit_and_never_slower_than_the_handcrafted_that_fit(case):
    p, m, costs, limit = case
    result = simulate(zb_auto(p, m, costs, limit), costs)
    assert max(result.peak_activations) <= limit
    assert all(a.kind is not K.BW for actions in result.schedule.ranks for a in actions)  # B/W split
    for handcrafted in (zb_h1(p, m), zb_h2(p, m)):
        timed = simulate(handcrafted, costs)
        if max(timed.peak_activations) <= limit:
            assert result.step_time <= timed.step_time, handcrafted.name


@settings(max_examples=15, deadline=None)
@given(cases())
def test_candidates_are_ranked_at_the_simulators_times(case):
    """The fast integer timing that ranks the candidates is the simulator's, tick for tick."""
    p, m, costs, limit = case
    times, latency = auto.ticks(p, costs)
    scale = Fraction(times[0][K.F]) / costs.duration(Action(K.F, 0, 0))
    for schedule in auto.candidates(p, m, costs, limit):
        result = simulate(schedule, costs)
        orders = compute_only(schedule).ranks
        assert auto.step_time(orders, times, latency) == result.step_time * scale
        assert tuple(auto.peak(a) for a in orders) == result.peak_activations


def test_unit_costs_at_1f1b_memory_give_zb_h1_and_more_memory_gives_zb_h2():
    for p, m in [(2, 4), (4, 8), (4, 13)]:
        assert simulate(zb_auto(p, m)).step_time == simulate(zb_h1(p, m)).step_time == 3 * m + p - 1
        assert str(zb_auto(p, m, memory_limit=2 * p - 1)).count("W") == str(zb_h2(p, m)).count("W")
        assert simulate(zb_auto(p, m, memory_limit=2 * p - 1)).step_time == simulate(zb_h2(p, m)).step_time


def test_the_heuristic_uses_memory_between_the_handcrafted_points():
    """B twice F and W (attention-heavy backward): with 5 microbatches per rank allowed, ZB-H2 (7) does
    not fit and ZB-H1 uses 4; zb_auto's schedule uses the fifth and is faster than ZB-H1; with less than
    ZB-H1's memory it is still valid, and slower."""
    p, m, costs = 4, 12, Costs(1, 2, 1)
    h1 = simulate(zb_h1(p, m), costs)
    more = simulate(zb_auto(p, m, costs, 5), costs)
    less = simulate(zb_auto(p, m, costs, 2), costs)
    assert max(more.peak_activations) == 5 and more.step_time < h1.step_time
    assert max(less.peak_activations) <= 2 and less.step_time > h1.step_time
    check(less.schedule)


def test_measured_costs_that_favour_another_order():
    """Unequal stages (a light first stage, a heavy last one: embedding vs LM head), B twice F, W half:
    at ZB-H2's memory the heuristic's own candidates beat both handcrafted schedules (65.5 vs 65.75 and
    67.75 time units)."""
    costs = StageCosts(1, 2, Fraction(1, 2), 0, weights=(Fraction(1, 2), 1, 1, Fraction(3, 2)))
    p, m = 4, 12
    best = simulate(zb_auto(p, m, costs, 2 * p - 1), costs).step_time
    assert best < simulate(zb_h2(p, m), costs).step_time and best < simulate(zb_h1(p, m), costs).step_time


def test_bad_limits_name_the_field_and_the_smallest_valid_value():
    for bad in (0, -3):
        with pytest.raises(ValueError, match=rf"pp_memory_limit={bad}: .*smallest valid value is 1; fix: "
                                             r"pp_memory_limit=1"):
            zb_auto(4, 8, memory_limit=bad)
        with pytest.raises(ValueError, match=rf"pp_memory_limit={bad}:.*pp_memory_limit=1"):
            meshkit.Plan(pp=4, pp_schedule="zb_auto", pp_memory_limit=bad)
    with pytest.raises(ValueError, match="pp_memory_limit=4: only pp_schedule='zb_auto'"):
        meshkit.Plan(pp=4, pp_memory_limit=4).validate(world_size=4)
    with pytest.raises(ValueError, match="pp_costs=.*F, B, W > 0"):
        meshkit.Plan(pp=2, pp_schedule="zb_auto", pp_costs="1/0/1")
    plan = meshkit.Plan.from_string("pp=2,pp_schedule=zb_auto,pp_memory_limit=1,pp_costs=1/2/1/0.25")
    assert plan.pp_costs == (1.0, 2.0, 1.0, 0.25) and meshkit.Plan.from_string(plan.to_string()) == plan
    assert splits_weight_grad("zb_auto")


def test_costs_from_a_trace_and_from_the_plan():
    """Per stage, the median of each kind's stage time; given costs read exactly (0.1 is 1/10)."""
    f, b, w = Action(K.F, 1, 0), Action(K.B, 1, 0), Action(K.W, 1, 0)
    trace = [TraceEvent("stage", f, 0.0, 0.002), TraceEvent("stage", Action(K.F, 1, 1), 1.0, 1.004),
             TraceEvent("stage", Action(K.F, 1, 2), 2.0, 2.003), TraceEvent("compute", f, 0.0, 0.01),
             TraceEvent("stage", b, 3.0, 3.005), TraceEvent("stage", w, 4.0, 4.001)]
    times = local_times(trace, 2)
    assert all(math.isnan(t) for t in times[:3])
    assert times[3:] == pytest.approx([0.003, 0.005, 0.001])
    costs = given_costs((1.0, 2.0, 1.0, 0.1))
    assert (costs.forward, costs.backward_input, costs.p2p_latency) == (1, 2, Fraction(1, 10))
    table = StageTable(1, 1, 1, 0, table=((Fraction(3), Fraction(5), Fraction(1)),))
    assert table.duration(Action(K.BW, 0, 0)) == 6 and table.duration(Action(K.SEND_F, 0, 0)) == 0


# --------------------------------------------------------------------------- through parallelize


def _compare(plan: str, model: ModelSpec, batch: BatchSpec) -> dict:
    return dataclasses.asdict(compare_training(plan, model, batch))


def _schedule_after_profiling(plan: str) -> str:
    spec = ModelSpec(layers=4)
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    ids, labels = BatchSpec(batch=4, seq=8).make(spec.vocab)
    rows = slice(pm.dp_rank * 4 // pm.dp_size, (pm.dp_rank + 1) * 4 // pm.dp_size)
    pm.forward_backward(ids[rows], labels[rows])
    return f"{pm._schedules.train}\n--\n{pm._schedules.train.name!r}"


def _agree_on_rank() -> tuple:
    rank = torch.distributed.get_rank()
    nan = math.nan
    local = [0.001 * (rank + 1), 0.002, 0.0005, nan, nan, nan] if rank % 2 == 0 else \
        [nan, nan, nan, 0.003, 0.004 + 0.001 * rank, 0.001]
    table = agree(local + [0.0001 * (rank + 1) if rank % 2 == 0 else nan], 2, torch.device("cpu"))
    return table.table, table.p2p_latency


def test_agreed_costs_are_the_medians_over_the_ranks_running_each_stage(dist):
    """Each rank times only its own stage; the gathered table is identical everywhere: per stage and
    kind the median over the ranks that ran it, in whole microseconds, the P2P time likewise."""
    results = dist(4).run(_agree_on_rank)
    assert len(set(results)) == 1
    table, p2p = results[0]
    assert table == ((Fraction(2000), Fraction(2000), Fraction(500)), (Fraction(3000), Fraction(6000), Fraction(1000)))
    assert p2p == Fraction(200)


def test_every_rank_builds_the_same_schedule_from_the_measured_costs(dist):
    """The profiling run's costs are gathered over the whole world: every rank of every pipeline replica
    (here two, over dp_shard) rebuilds the identical schedule, whatever it measured itself."""
    texts = dist(4).run(_schedule_after_profiling, "pp=2,dp_shard=2,pp_schedule=zb_auto,pp_microbatches=2")
    assert len(set(texts)) == 1
    assert texts[0].endswith("'zb_auto'")


@pytest.mark.parametrize(
    "plan, world, model",
    [
        ("pp=2,dp_shard=2,pp_schedule=zb_auto,pp_microbatches=4,pp_memory_limit=3", 4, ModelSpec(tied=True, layers=4)),
        ("pp=4,pp_schedule=zb_auto,pp_microbatches=8,pp_costs=1/2/1/0.1", 4, ModelSpec(layers=6)),
        ("pp=2,tp=2,pp_schedule=zb_auto,pp_microbatches=4,activation_checkpointing=full", 4,
         ModelSpec(layers=4, kind="qwen3")),
    ],
)
def test_zb_auto_matches_one_device(dist, plan, world, model):
    """Step 1 runs the unit-cost schedule and measures; step 2 runs the schedule built from the
    measurement (or, with pp_costs, the given costs' from the start): both equal one device."""
    degrees = meshkit.Plan.from_string(plan)
    batch = BatchSpec(batch=degrees.microbatches * degrees.dp_shard, seq=8, ignore=0.2)
    assert_matches_reference(dist(world).run(_compare, plan, model, batch), f"{plan} on {model}")


def test_the_candidates_differ_by_their_knobs():
    assert len(auto.candidates(3, 6, Costs(1, 2, 1), 3)) >= 2
    assert build_schedule("zb_auto", 3, 6).name == "zb_auto"
