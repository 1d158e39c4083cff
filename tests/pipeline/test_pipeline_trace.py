"""`run_schedule(trace=...)`: the recorded timeline is the schedule as run, and tracing changes nothing.

The trace feeds the benchmark's critical-path breakdown, so its structure is what is checked: every
compute in the rank's list order, every transfer posted exactly once, waits only inside the compute
that consumes the receive, the model's own work ("stage") inside its compute, all inside the call;
and the losses and gradients of a traced call are bitwise those of an untraced one.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from benchmarks.pipeline.critical_path import CATEGORIES, critical_path
from meshkit.pipeline.actions import ActionKind, compute_only
from meshkit.pipeline.runtime import TensorMeta, TraceEvent, run_schedule
from meshkit.pipeline.schedules import build_schedule

DIM, ROWS, M = 4, 2, 5
K = ActionKind


class _Stage(nn.Module):
    def __init__(self, stage: int):
        super().__init__()
        torch.manual_seed(stage)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


def _run(name: str, trace: list[TraceEvent] | None, m: int = M) -> tuple[list[torch.Tensor], dict]:
    pp, rank = dist.get_world_size(), dist.get_rank()
    schedule = build_schedule(name, pp, m)
    owner = schedule.stage_to_rank()
    stages = {s: _Stage(s) for s in range(schedule.num_stages) if owner[s] == rank}
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(ROWS, DIM, generator=gen) for _ in range(m)]
    losses = run_schedule(schedule, stages, pp_group=dist.group.WORLD, microbatch_inputs=xs,
                          loss_fn=lambda y, mb: y.square().sum() / m, shapes=TensorMeta((ROWS, DIM), torch.float32),
                          trace=trace)
    grads = {f"{s}.{n}": p.grad.clone() for s, stage in stages.items() for n, p in stage.named_parameters()}
    return losses, grads


def _worker(name: str) -> dict:
    plain = _run(name, None)
    trace: list[TraceEvent] = []
    traced = _run(name, trace)
    same = plain[0] == traced[0] or all(torch.equal(a, b) for a, b in zip(plain[0], traced[0]))
    same = same and plain[1].keys() == traced[1].keys() and all(torch.equal(plain[1][k], traced[1][k])
                                                                  for k in plain[1])
    return {"same": same, "trace": [(e.kind, e.what, e.start, e.end) for e in trace]}


@pytest.mark.parametrize("name", ["1f1b", "zb_v"])
def test_trace_is_the_schedule_as_run_and_changes_nothing(dist, name):
    pp = 2
    schedule = build_schedule(name, pp, M)
    results = dist(pp).run(_worker, name)
    for rank, result in enumerate(results):
        assert result["same"], f"rank {rank}: a traced call computed different losses or gradients"
        events = result["trace"]
        (call,) = [e for e in events if e[0] == "call"]
        assert events[-1] == call and all(call[2] <= e[2] <= e[3] <= call[3] for e in events)
        computes = [e for e in events if e[0] == "compute"]
        assert [e[1] for e in computes] == list(compute_only(schedule).ranks[rank])
        assert all(a[3] <= b[2] for a, b in zip(computes, computes[1:])), "computes overlap"
        posted = [a for e in events if e[0] == "post" for a in e[1]]
        comms = [a for a in schedule.ranks[rank] if not a.is_compute]
        assert sorted(map(str, posted)) == sorted(map(str, comms)), "each transfer posted exactly once"
        for kind in ("wait", "stage"):
            for _, what, start, end in (e for e in events if e[0] == kind):
                (owner,) = [c for c in computes if c[2] <= start and end <= c[3]]
                if kind == "stage":
                    assert owner[1].stage == what.stage and owner[1].microbatch == what.microbatch
                else:  # a receive is waited on by the compute that consumes it
                    consumer = (K.F, what.stage) if what.kind is K.RECV_F else (K.B, what.stage)
                    assert (owner[1].kind if owner[1].kind is not K.BW else K.B, owner[1].stage) == consumer
                    assert owner[1].microbatch == what.microbatch


def test_critical_path_sums_to_the_step(dist):
    """On a real traced step the breakdown's categories add up to the measured step exactly."""
    pp, name = 2, "1f1b"
    results = dist(pp).run(_worker, name)
    recs = []
    for result in results:
        events = [(k, tuple(map(str, w)) if k == "post" else str(w), s, e) for k, w, s, e in result["trace"]]
        call = [e for e in events if e[0] == "call"][0]
        recs.append({"t0": call[2], "t1": call[3], "trace": events, "sleeps": []})
    path = critical_path(build_schedule(name, pp, M), recs)
    step = max(r["t1"] for r in recs) - min(r["t0"] for r in recs)
    assert sum(path[c] for c in CATEGORIES) == pytest.approx(step, rel=1e-9, abs=1e-9)
    assert all(path[c] >= 0 for c in CATEGORIES) and path["stage code"] > 0


def _dualpipe_worker(name: str, m: int) -> list:
    trace: list[TraceEvent] = []
    _run(name, trace, m)
    return [(e.kind, e.what, e.start, e.end) for e in trace]


@pytest.mark.parametrize("name, m", [("dualpipe_v", M), ("dualpipe", 6)])
def test_dualpipe_pairs_post_each_ones_transfers_around_the_others_compute(dist, name, m):
    """DualPipe's and DualPipeV's F/B pairing on CPU/gloo: in every F-then-backward pair on two different
    stages, the backward's gradient receive is posted before the forward computes, and the forward's
    output send is posted before the backward computes, so each one's transfer overlaps the other's
    compute. (DualPipe: a pair's two stages belong to the two directions.)"""
    pp = 2
    schedule = build_schedule(name, pp, m)
    owner = schedule.stage_to_rank()
    pairs = 0
    for rank, events in enumerate(dist(pp).run(_dualpipe_worker, name, m)):
        posted = {str(a): e[3] for e in events if e[0] == "post" for a in e[1]}
        computes = [e for e in events if e[0] == "compute"]
        for (_, f, f_start, _), (_, b, b_start, _) in zip(computes, computes[1:]):
            if f.kind is not K.F or b.kind not in (K.B, K.BW) or f.stage == b.stage:
                continue
            pairs += 1
            later = schedule.downstream(b.stage)
            if later is not None and owner[later] != rank:
                assert posted[f"RECV_B{b.stage}.{b.microbatch}"] <= f_start, f"rank {rank}: {f}, {b}"
            later = schedule.downstream(f.stage)
            if later is not None and owner[later] != rank:
                assert posted[f"SEND_F{f.stage}.{f.microbatch}"] <= b_start, f"rank {rank}: {f}, {b}"
    assert pairs >= pp, "the steady phase pairs forwards with backwards"


def test_critical_path_follows_the_message_the_last_rank_waited_for():
    """A hand-made 2-rank gpipe step (m=1): rank 1 waits for rank 0's send, so the path is rank 0
    up to its send, the delivery, then rank 1; every interval lands in its category."""
    schedule = build_schedule("gpipe", 2, 1)
    rank0 = {"t0": 0.0, "t1": 10.0, "sleeps": [("F", 1.0, 3.0), ("B", 7.0, 8.0)], "trace": [
        ("compute", "F0.0", 0.5, 3.5), ("stage", "F0.0", 0.8, 3.2), ("post", ("SEND_F0.0", "RECV_B0.0"), 3.5, 4.0),
        ("compute", "BW0.0", 4.0, 9.0), ("wait", "RECV_B0.0", 4.1, 6.0), ("stage", "BW0.0", 6.5, 8.5),
        ("call", "gpipe", 0.2, 9.5)]}
    rank1 = {"t0": 0.1, "t1": 20.0, "sleeps": [("F", 5.0, 7.0)], "trace": [
        ("post", ("RECV_F1.0",), 0.3, 0.4), ("compute", "F1.0", 0.4, 8.0), ("wait", "RECV_F1.0", 0.5, 4.5),
        ("stage", "F1.0", 4.6, 7.5), ("call", "gpipe", 0.2, 19.0)]}
    path = critical_path(schedule, [rank0, rank1])
    assert path["hops"] == 1
    # rank 1 after its wait (4.5 .. 20): stage code 2.9 - 2.0 of sleep, action bookkeeping 8.0-4.5-2.9,
    # loop 8.0 .. 19.0, end 19.0 .. 20.0; delivery 4.0 .. 4.5; rank 0 from 0.0 to its post's end (4.0):
    # start 0.0 .. 0.2, loop 0.2 .. 0.5, stage code 2.4 - 2.0, bookkeeping 3.0 - 2.4, post 3.5 .. 4.0
    expected = {"sleeps": 2.0 + 2.0, "stage code": 0.9 + 0.4, "runtime in actions": 0.6 + 0.6,
                "P2P post: sends": 0.5, "P2P post: receives": 0.0, "delivery": 0.5, "loop": 11.0 + 0.3,
                "start/end": 1.0 + 0.2}
    for category, seconds in expected.items():
        assert path[category] == pytest.approx(seconds, abs=1e-9), category
    assert sum(path[c] for c in CATEGORIES) == pytest.approx(20.0)

    # gloo's trace has one event per transfer: the message leaves when its own send is posted, so
    # the receive posted after it is off the path and the delivery starts 0.2 earlier
    rank0["trace"][2:3] = [("post", ("SEND_F0.0",), 3.5, 3.8), ("post", ("RECV_B0.0",), 3.8, 4.0)]
    path = critical_path(schedule, [rank0, rank1])
    assert path["P2P post: sends"] == pytest.approx(0.3) and path["P2P post: receives"] == 0.0
    assert path["delivery"] == pytest.approx(0.7) and sum(path[c] for c in CATEGORIES) == pytest.approx(20.0)
