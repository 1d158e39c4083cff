"""The worker pool itself: every other multi-rank test trusts what it reports, so prove it here."""

from __future__ import annotations

import ctypes
import os
import time

import pytest
import torch
import torch.distributed as tdist

from meshkit.testing import RankFailure, RankTimeout, WorkerPool
from meshkit.testing import pool as pool_module
from meshkit.testing.pool import DIED, NO_ANSWER

# -- functions the ranks run (module level, so they pickle by reference) ----------------------------


def _whoami() -> tuple[int, int, int, str]:
    return (tdist.get_rank(), tdist.get_world_size(), int(os.environ["RANK"]), os.environ["MASTER_ADDR"])


def _all_reduce_rank() -> float:
    t = torch.tensor([float(tdist.get_rank())])
    tdist.all_reduce(t)
    return t.item()


def _echo_plus_rank(payload: dict[str, torch.Tensor], *, scale: float) -> dict[str, torch.Tensor]:
    return {k: v * scale + tdist.get_rank() for k, v in payload.items()}


def _fail_on_rank_1_before_collective() -> float:
    if tdist.get_rank() == 1:
        raise ValueError("only rank 1 fails")
    return _all_reduce_rank()  # the other ranks block here, waiting for rank 1


def _fail_on_rank_1_others_sleep() -> None:
    if tdist.get_rank() == 1:
        raise ValueError("only rank 1 fails")
    time.sleep(60)  # not in a collective, so nothing wakes these ranks up


def _every_rank_raises() -> None:
    raise ValueError(f"bad plan on rank {tdist.get_rank()}")


def _sleep_on_rank(rank: int, seconds: float) -> int:
    if tdist.get_rank() == rank:
        time.sleep(seconds)
    return tdist.get_rank()


def _die_on_rank_1(how: str) -> None:
    if tdist.get_rank() == 1:
        if how == "exit":
            os._exit(3)
        ctypes.string_at(0)  # SIGSEGV


def _dirty_process_state() -> None:
    os.environ["MESHKIT_LEAK"] = "1"
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    os.chdir("/")


def _process_state() -> tuple[str | None, torch.dtype, bool, str]:
    return os.environ.get("MESHKIT_LEAK"), torch.get_default_dtype(), torch.is_grad_enabled(), os.getcwd()


def _print_rank() -> None:
    print(f"hello from {tdist.get_rank()}")


# -- tests -------------------------------------------------------------------------------------------


def test_results_come_back_in_rank_order(dist):
    assert dist(4).run(_whoami) == [(r, 4, r, "127.0.0.1") for r in range(4)]


def test_all_reduce_across_ranks(dist):
    assert dist(4).run(_all_reduce_rank) == [6.0] * 4
    assert dist(2).run(_all_reduce_rank) == [1.0] * 2


def test_tensors_round_trip(dist):
    payload = {"x": torch.randn(3, 5), "b": torch.arange(4, dtype=torch.bfloat16)}
    results = dist(2).run(_echo_plus_rank, payload, scale=2.0)
    for rank, out in enumerate(results):
        for key, value in payload.items():
            assert out[key].dtype == value.dtype
            torch.testing.assert_close(out[key], value * 2.0 + rank)


def test_one_rank_raising_is_reported_fast_while_others_block(dist):
    pool = dist(4)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        pool.run(_fail_on_rank_1_before_collective)
    assert time.monotonic() - start < 10.0
    assert not isinstance(info.value, RankTimeout)
    assert info.value.ranks[0] == 1
    message = str(info.value)
    assert "rank 1 of 4: ValueError: only rank 1 fails" in message
    assert "Traceback (most recent call last)" in message
    assert "in _fail_on_rank_1_before_collective" in message
    assert pool.run(_all_reduce_rank) == [6.0] * 4


def test_ranks_that_never_answer_after_a_failure_are_killed_and_named():
    with WorkerPool(4, timeout=60.0, grace=1.0) as pool:
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(_fail_on_rank_1_others_sleep)
        assert time.monotonic() - start < 10.0
        by_rank = {o.rank: o for o in info.value.outcomes}
        assert by_rank[1].exc_type == "ValueError"
        assert [r for r, o in by_rank.items() if o.exc_type == NO_ANSWER] == [0, 2, 3]
        assert "after rank 1 failed" in str(info.value)
        assert "in _fail_on_rank_1_others_sleep" in str(info.value)  # stacks of the stuck ranks
        assert pool.run(_all_reduce_rank) == [6.0] * 4


def test_run_raw_returns_every_rank_outcome(dist):
    outcomes = dist(4).run_raw(_every_rank_raises)
    assert [o.rank for o in outcomes] == [0, 1, 2, 3]
    for o in outcomes:
        assert not o.ok
        assert o.exc_type == "ValueError"
        assert isinstance(o.value, ValueError)
        assert o.message == f"bad plan on rank {o.rank}"
        assert "in _every_rank_raises" in o.traceback
    assert all(o.ok for o in dist(4).run_raw(_whoami))


def test_hung_rank_times_out_and_pool_recovers(dist):
    pool = dist(2)
    old_pids = pool.run(os.getpid)
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool.run(_sleep_on_rank, 1, 60.0, timeout=2.0)
    assert time.monotonic() - start < 8.0
    assert info.value.ranks == [1]
    message = str(info.value)
    assert "rank 1 of 2: RankTimeout: no answer within the 2 s timeout" in message
    assert "in _sleep_on_rank" in message  # faulthandler's stack of the hung rank
    assert pool.run(_sleep_on_rank, 1, 0.0) == [0, 1]
    assert all(not os.path.exists(f"/proc/{pid}") for pid in old_pids)  # killed and reaped


@pytest.mark.parametrize(("how", "expected"), [("exit", "exit code 3"), ("segfault", "SIGSEGV")])
def test_dead_worker_is_reported_and_replaced(dist, how, expected):
    pool = dist(2)
    with pytest.raises(RankFailure) as info:
        pool.run(_die_on_rank_1, how)
    assert info.value.ranks == [1]
    assert info.value.outcomes[1].exc_type == DIED
    assert expected in str(info.value)
    if how == "segfault":
        assert "Segmentation fault" in str(info.value)  # faulthandler's report from the rank
    assert pool.run(_all_reduce_rank) == [1.0, 1.0]


def test_process_state_does_not_leak_between_tests(dist):
    pool = dist(2)
    before = pool.run(_process_state)
    pool.run(_dirty_process_state)
    assert pool.run(_process_state) == before


def test_rank_output_is_captured(dist, capsys):
    outcomes = dist(2).run_raw(_print_rank)
    assert all(f"hello from {o.rank}\n" in o.output for o in outcomes)
    assert "[rank 1] hello from 1" in capsys.readouterr().err


def test_workers_over_budget_are_recycled(dist, monkeypatch):
    pool = dist(2)
    assert dist(2) is pool
    before = pool.run(os.getpid)
    monkeypatch.setattr(pool_module, "MAX_WORKER_THREADS", 0)
    assert pool.run(os.getpid) == before  # the run that goes over budget still answers...
    monkeypatch.undo()
    after = pool.run(os.getpid)  # ...and the next one gets fresh workers
    assert set(after).isdisjoint(before)
    assert pool.run(os.getpid) == after


def test_unpicklable_function_fails_in_the_test_process(dist):
    with pytest.raises(TypeError, match="module level"):
        dist(2).run(lambda: 0)
