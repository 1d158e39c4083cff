"""DualPipe (DeepSeek-V3's bidirectional schedule): as data (valid at every size it accepts, invalid
below, mirrored, its bubble and peak as the report states them), drawn, refused when corrupted; run by
the runtime (both copies' gradients summed give the single process's); through `parallelize` against
one device, with fsdp, tp, cp, ep, tied embeddings and activation checkpointing; one copy in
checkpoints.

The schedule tests are pure Python in exact arithmetic; the multi-rank ones are a few small cases in
CI, the rest slow (tests/ci_subset.py).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from tests_support import assert_matches_reference
from torch import nn

import meshkit
from meshkit.pipeline.actions import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    compute_only,
    forward_only,
    parse_schedule,
    with_communication,
)
from meshkit.pipeline.bidirectional import dualpipe, min_microbatches, unchecked
from meshkit.pipeline.runtime import TensorMeta, run_schedule
from meshkit.pipeline.schedules import (
    build_schedule,
    dualpipe_v,
    splits_weight_grad,
    stage_chunks,
    stage_placement,
)
from meshkit.pipeline.simulate import Costs, check, render_png, simulate
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

K = ActionKind


@st.composite
def sizes(draw) -> tuple[int, int]:
    p = draw(st.sampled_from([2, 4, 6, 8]))
    return p, draw(st.integers(min_microbatches(p) // 2, 2 * p)) * 2


def _mirror(action: Action, p: int, m: int) -> Action:
    """The same action on the mirror rank: down stage s <-> up stage p+s, microbatch j <-> j +- m/2."""
    stage = action.stage + p if action.stage < p else action.stage - p
    return Action(action.kind, stage, (action.microbatch + m // 2) % m)


# ------------------------------------------------------------------------------------------ as data


@settings(max_examples=40, deadline=None)
@given(sizes())
def test_dualpipe_is_valid_placed_and_mirrored(size):
    p, m = size
    schedule = dualpipe(p, m)
    check(schedule)
    assert schedule.pipelines == 2 and schedule.num_stages == 2 * p
    assert schedule.stage_to_rank() == stage_placement("dualpipe", p) == tuple(range(p)) + tuple(reversed(range(p)))
    assert stage_chunks("dualpipe", p) == tuple(range(p)) * 2
    for r, actions in enumerate(compute_only(schedule).ranks):
        # rank r runs chunk r of the down pipeline and chunk p-1-r of the up pipeline, each on its half
        assert {(a.stage % p, a.stage // p) for a in actions} == {(r, 0), (p - 1 - r, 1)}
        assert all((a.stage < p) == (a.microbatch < m // 2) for a in actions)
        assert [_mirror(a, p, m) for a in actions] == list(compute_only(schedule).ranks[p - 1 - r])
    assert with_communication(compute_only(schedule)) == schedule
    assert parse_schedule(str(schedule), 2 * p, m, "dualpipe", pipelines=2) == schedule
    check(forward_only(schedule))
    assert splits_weight_grad("dualpipe") and any(a.kind is K.W for a in schedule.ranks[0])


def test_the_smallest_microbatch_count_is_the_one_the_order_needs():
    """Even m >= 2(p-1): at m = 2(p-1) - 2 the same (folded DualPipeV) order deadlocks or breaks."""
    for p in (4, 6, 8):
        check(dualpipe(p, 2 * (p - 1)))
        with pytest.raises(ScheduleError):
            check(unchecked(p, 2 * (p - 1) - 2))


@pytest.mark.parametrize(
    "pp, m, words",
    [
        (3, 6, ["pp=3", "even", "pp=4 or pp=2", "dualpipe_v"]),
        (4, 7, ["pp_microbatches=7", "even", "at least 2*(pp-1)=6", "pp_microbatches=8"]),
        (4, 4, ["pp_microbatches=4", "pp_microbatches=6"]),
        (8, 12, ["pp_microbatches=12", "at least 2*(pp-1)=14", "pp_microbatches=14"]),
    ],
)
def test_bad_sizes_name_the_field_and_the_smallest_valid_value(pp, m, words):
    with pytest.raises(ValueError) as error:
        dualpipe(pp, m)
    for word in words:
        assert word in str(error.value)
    with pytest.raises(ValueError) as plan_error:  # the Plan says the same, before any rank starts
        meshkit.Plan(pp=pp, pp_schedule="dualpipe", pp_microbatches=m).validate(world_size=pp)
    assert str(error.value) in str(plan_error.value)


def test_a_microbatch_in_the_wrong_pipeline_is_explained():
    p, m = 2, 4
    ranks = [list(actions) for actions in dualpipe(p, m).ranks]
    i = next(i for i, a in enumerate(ranks[0]) if a.kind is K.F and a.stage == 0)
    ranks[0][i] = Action(K.F, 0, m - 1)  # an up microbatch on the down pipeline's first stage
    with pytest.raises(ScheduleError, match=f"microbatch {m - 1} runs through another pipeline"):
        check(Schedule(tuple(map(tuple, ranks)), 2 * p, m, "broken", pipelines=2))
    ranks = [list(actions) for actions in dualpipe(p, m).ranks]
    ranks[1].insert(0, Action(K.SEND_F, 1, 0))  # the down pipeline's last stage has no next stage
    with pytest.raises(ScheduleError, match="SEND_F1.0 has no peer: stage 2 is in another pipeline"):
        check(Schedule(tuple(map(tuple, ranks)), 2 * p, m, "broken", pipelines=2))
    with pytest.raises(ScheduleError, match="pipelines=2: must divide"):
        Schedule(dualpipe(p, m).ranks, 2 * p, m + 1, "odd", pipelines=2)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([2, 4, 6]), st.data())
def test_random_swaps_are_refused_or_still_valid(p, data):
    schedule = dualpipe(p, 2 * p)
    ranks = [list(actions) for actions in schedule.ranks]
    rank = data.draw(st.integers(0, p - 1))
    i = data.draw(st.integers(0, len(ranks[rank]) - 2))
    ranks[rank][i], ranks[rank][i + 1] = ranks[rank][i + 1], ranks[rank][i]
    perturbed = Schedule(tuple(map(tuple, ranks)), 2 * p, 2 * p, "swapped", pipelines=2)
    try:
        check(perturbed)
    except ScheduleError as error:
        assert "rank" in str(error)
    else:
        simulate(perturbed)


# ------------------------------------------------------------------------------- bubble and memory


@settings(max_examples=30, deadline=None)
@given(sizes(), st.builds(Fraction, st.integers(1, 5), st.sampled_from([1, 2, 3])))
def test_bubble_is_the_reports_formula_with_overlapped_pairs(size, t):
    """DeepSeek-V3's Table 2: DualPipe's bubble (PP/2-1)(F&B + B - 3W), B a full backward, F&B the time
    of an overlapped forward-backward pair; parameters 2x, activations PP+1 per device.

    At F = B = W = t (B full = 2t) the simulator's idle on every rank is (p/2-1)*t: the formula with
    F&B = 2t, a pair as long as its backward alone (the report's premise: the forward hidden in it).
    meshkit runs a pair back to back on CPU (F&B = 3t) and still idles only (p/2-1)*t: the middle
    ranks' first input crossing p/2-1 ranks, which no synchronous step can avoid, so the formula at
    F&B = 3t, 2(p/2-1)*t, is an upper bound here. The timeline is DualPipeV's on p/2 ranks with m/2
    microbatches, mirrored."""
    p, m = size
    result = simulate(dualpipe(p, m), Costs(t, t, t))
    f, b_full, w = t, 2 * t, t
    assert result.idle == ((p // 2 - 1) * (2 * t + b_full - 3 * w),) * p  # the formula with F&B = 2t
    assert result.step_time == 3 * m * t + (p // 2 - 1) * t
    assert (p // 2 - 1) * ((f + b_full) + b_full - 3 * w) >= result.idle[0]  # back-to-back pairs: upper bound
    assert max(result.peak_activations) <= p + 1  # the report's PP+1, reached once m >= 2p
    if m >= 2 * p:
        assert result.peak_activations == (p + 1,) * p
        assert simulate(dualpipe_v(p // 2, m // 2), Costs(t, t, t)).step_time == result.step_time
    one_f = simulate(build_schedule("1f1b", p, m), Costs(t, t, t))  # the same chunk per rank and microbatch
    assert one_f.idle[0] == 3 * (p - 1) * t


def test_steady_phase_pairs_a_forward_with_a_backward_of_the_other_direction():
    p, m = 4, 12
    for r, actions in enumerate(compute_only(dualpipe(p, m)).ranks):
        h = min(r, p - 1 - r)
        pairs = sum(1 for a, b in zip(actions, actions[1:])
                    if a.kind is K.F and b.kind is K.BW and a.stage // p != b.stage // p)
        assert pairs >= 2 * (m // 2 - p + h + 1) + (p // 2 - 1 - h)


def test_png_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    path = render_png(simulate(dualpipe(4, 8)), tmp_path / "dualpipe.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------- the runtime

DIM, ROWS, LAYERS = 5, 2, 8


def _toy_chunks(p: int) -> list[nn.Sequential]:
    torch.manual_seed(0)
    per = LAYERS // p
    return [nn.Sequential(*[nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(per)]) for _ in range(p)]


def _toy_data(m: int):
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(ROWS, DIM, generator=gen) for _ in range(m)], [torch.randn(ROWS, DIM, generator=gen)
                                                                       for _ in range(m)]


def _runtime_worker(m: int) -> tuple[list[float], list[torch.Tensor]]:
    """Each rank holds its two chunks (copies of the model's), runs its part twice (accumulating)."""
    p, rank = dist.get_world_size(), dist.get_rank()
    schedule = build_schedule("dualpipe", p, m)
    chunks = _toy_chunks(p)
    stages = {s: chunks[c] for s, c in enumerate(stage_chunks("dualpipe", p)) if schedule.stage_to_rank()[s] == rank}
    xs, ys = _toy_data(m)
    losses = []
    for _ in range(2):
        out = run_schedule(schedule, stages, pp_group=dist.group.WORLD, microbatch_inputs=xs,
                           loss_fn=lambda y, mb: (y - ys[mb]).square().sum() / m,
                           shapes=TensorMeta((ROWS, DIM), torch.float32))
        losses += [t.item() for t in out]
    grads = [q.grad.clone() if q.grad is not None else torch.zeros_like(q) for chunk in chunks for q in chunk.parameters()]
    return losses, grads


@pytest.mark.parametrize("p, m", [(2, 4), (4, 6)])
def test_runtime_copies_sum_to_the_single_process_gradient(dist, p, m):
    """Half the microbatches run down, half up; each rank's copies hold partial gradients whose sum over
    the mirror pair is the single process's (the sum `parallelize` makes with one all-reduce)."""
    results = dist(p).run(_runtime_worker, m)
    chunks = _toy_chunks(p)
    xs, ys = _toy_data(m)
    ref_losses = []
    for _ in range(2):
        total = 0
        for x, y in zip(xs, ys):
            for chunk in chunks:
                x = chunk(x)
            loss = (x - y).square().sum() / m
            total = total + loss
            ref_losses.append(loss.item())
        total.backward()
    losses = sorted(v for r in results for v in r[0])
    assert losses == pytest.approx(sorted(ref_losses), rel=1e-5, abs=1e-6)
    summed = [sum(r[1][i] for r in results) for i in range(len(results[0][1]))]
    reference = [q.grad for chunk in chunks for q in chunk.parameters()]
    for got, want in zip(summed, reference):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- through parallelize


def _compare(plan: str, model: ModelSpec, batch: BatchSpec) -> dict:
    return dataclasses.asdict(compare_training(plan, model, batch))


MOE = ModelSpec(layers=4, experts=4, top_k=2, intermediate=16, bias_update_rate=0.01)
CASES = [  # CI runs the first two (tests/ci_subset.py names what covers the others' paths there)
    ("pp=2,dp_shard=2,pp_schedule=dualpipe,pp_microbatches=4", 4, ModelSpec(tied=True, layers=4)),
    ("pp=4,pp_schedule=dualpipe,pp_microbatches=6,activation_checkpointing=full", 4, ModelSpec(tied=True, layers=6)),
    ("pp=2,tp=2,pp_schedule=dualpipe,pp_microbatches=4", 4, ModelSpec(tied=True, layers=4, kind="qwen3")),
    ("pp=2,cp=2,pp_schedule=dualpipe,pp_microbatches=2,activation_checkpointing=selective", 4, ModelSpec(layers=4)),
    ("pp=2,dp_shard=2,ep=2,pp_schedule=dualpipe,pp_microbatches=4", 4, MOE),
    ("pp=2,dp_shard=2,tp=2,pp_schedule=dualpipe,pp_microbatches=4", 8, ModelSpec(layers=3, heads=4, kv_heads=2)),
]


@pytest.mark.parametrize("plan, world, model", CASES)
def test_dualpipe_matches_one_device(dist, plan, world, model):
    """Loss, every gradient (both copies: each rank's are the summed ones), the clipped norm and the
    parameters after two AdamW steps, from `full_state_dict` (one copy per name)."""
    degrees = meshkit.Plan.from_string(plan)
    batch = BatchSpec(batch=degrees.microbatches * degrees.dp_shard, seq=8, ignore=0.2, documents=2)
    assert_matches_reference(dist(world).run(_compare, plan, model, batch), f"{plan} on {model}")


def _copies_after_steps(plan: str, path: str) -> dict:
    """Three steps (router biases moving), then what each pair holds and what a checkpoint holds."""
    spec = MOE
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    for step in range(3):
        ids, labels = BatchSpec(batch=4, seq=8, seed=step).make(spec.vocab)
        pm.forward_backward(ids, labels)
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        pm.update_expert_biases()
    mine = {n: t.detach().clone() for n, t in pm.model.state_dict().items() if not t.is_meta}
    pm.save_checkpoint(path, opt, step=3)
    reader = torch.distributed.checkpoint.FileSystemReader(path)
    keys = sorted(k for k in reader.read_metadata().state_dict_metadata if k.startswith("model."))
    return {"state": mine, "keys": keys, "full": sorted(pm.full_state_dict())}


def test_the_two_copies_stay_identical_and_checkpoints_hold_one(dist, tmp_path):
    plan = "pp=2,pp_schedule=dualpipe,pp_microbatches=4"
    rank0, rank1 = dist(2).run(_copies_after_steps, plan, str(tmp_path / "ckpt"))
    shared = set(rank0["state"]) & set(rank1["state"])
    assert shared == set(rank0["state"]) == set(rank1["state"]), "both ranks hold the same layers"
    assert any(n.endswith("expert_bias") for n in shared)
    for name in shared:
        assert torch.equal(rank0["state"][name], rank1["state"][name]), name
    reference = MOE.build()
    names = sorted(f"model.{n}" for n in reference.state_dict())
    assert rank0["keys"] == rank1["keys"] == names, "one checkpoint entry per HF name"
    assert rank0["full"] == sorted(reference.state_dict())


def _use_on_rank(plan: str) -> dict:
    """Logits, greedy tokens and the evaluated loss, against the unsplit HF model."""
    spec = ModelSpec(layers=4, vocab=96, tied=True)
    reference = spec.build()
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    ids = torch.randint(0, spec.vocab, (4, 7), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    with torch.no_grad():
        ref = reference(input_ids=ids, labels=labels, use_cache=False)
    tokens = pm.generate(ids, max_new_tokens=3)
    ref_tokens = reference.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    return {"logits": (pm.forward(ids, gather=True) - ref.logits).abs().max().item(),
            "loss": abs(pm.evaluate(ids, labels).item() - ref.loss.item()),
            "tokens": tokens.tolist() == ref_tokens.tolist()}


@pytest.mark.parametrize("plan", ["pp=2,pp_schedule=dualpipe,pp_microbatches=4", "pp=2,pp_schedule=zb_v,pp_microbatches=4"])
def test_forward_generate_and_evaluate_follow_the_placement(dist, plan):
    """`pm.forward`/`generate` run the first pipeline through the schedule's placement (DualPipe's down
    chain; the V, whose last stage is on rank 0 with a local handoff at its tip) and evaluate runs the
    schedule's forwards: all equal to the unsplit model."""
    for rank, r in enumerate(dist(2).run(_use_on_rank, plan)):
        assert r["logits"] <= 2e-5 and r["loss"] <= 1e-5 and r["tokens"], (plan, rank, r)
