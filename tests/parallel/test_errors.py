"""Mistakes a new user makes: each must raise a clear ValueError on EVERY rank, never hang one of them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import meshkit
from meshkit.testing.reference import ModelSpec

ALL_RANKS_QUICKLY = 30.0  # seconds; a hang would hit this and fail as RankTimeout


def _parallelize(plan: str, model: ModelSpec) -> None:
    meshkit.parallelize(model.build(), meshkit.Plan.from_string(plan))


def _every_rank(pool, fn, *args):
    """Each rank's outcome of `fn`, giving every rank the whole ALL_RANKS_QUICKLY to raise on its own:
    on 2 loaded cores one rank can still be building its model seconds after another raised, and the
    pool's short grace after a first failure would call it hung."""
    grace, pool.grace = pool.grace, ALL_RANKS_QUICKLY
    try:
        return pool.run_raw(fn, *args, timeout=ALL_RANKS_QUICKLY)
    finally:
        pool.grace = grace


def _assert_every_rank_raised(outcomes, *patterns: str) -> None:
    for o in outcomes:
        assert not o.ok, f"rank {o.rank} did not raise"
        assert isinstance(o.value, ValueError), f"rank {o.rank} raised {o.exc_type}: {o.message}"
        for pattern in patterns:
            assert pattern in o.message, f"rank {o.rank}: {pattern!r} not in {o.message!r}"


def test_world_size_that_does_not_match_the_plan(dist):
    outcomes = _every_rank(dist(4), _parallelize, "tp=2", ModelSpec())
    _assert_every_rank_raised(outcomes, "world_size=4", "needs", "= 2 processes", "--nproc-per-node 2")


def test_tp_that_neither_divides_nor_is_divided_by_the_kv_heads(dist):
    outcomes = _every_rank(dist(2), _parallelize, "tp=2", ModelSpec(heads=6, kv_heads=3))
    _assert_every_rank_raised(outcomes, "num_key_value_heads=3", "largest tp that works is 1", "use a tp in [1, 3, 6]")


def _parallelize_gpt2() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16))
    meshkit.parallelize(model, meshkit.Plan(tp=2))


def test_a_non_llama_model(dist):
    outcomes = _every_rank(dist(2), _parallelize_gpt2)
    _assert_every_rank_raised(outcomes, "GPT2LMHeadModel", "not a supported Llama-family causal LM")


def _step_with(plan: str, bad_rank: int | None, seq: int, what: str) -> None:
    model = ModelSpec(vocab=32)
    pm = meshkit.parallelize(model.build(), meshkit.Plan.from_string(plan))
    ids = torch.randint(0, 32, (2, seq), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    rank = torch.distributed.get_rank()
    if bad_rank is None or rank == bad_rank:
        if what == "token":
            ids[0, 0] = 40
        elif what == "label":
            labels[1, 2] = -7
        elif what == "batch":
            ids[1, 1] = (ids[1, 1] + 1) % 32
    pm.forward_backward(ids, labels)


def test_a_sequence_length_sequence_parallelism_cannot_split(dist):
    outcomes = _every_rank(dist(2), _step_with, "tp=2", None, 7, "none")
    _assert_every_rank_raised(outcomes, "sequence length 7: sequence parallelism over tp=2 needs a multiple of 2",
                              "pad or cut sequences to 8 tokens")


def test_one_rank_with_an_out_of_range_token_fails_every_rank(dist):
    outcomes = _every_rank(dist(4), _step_with, "dp_shard=4", 2, 8, "token")
    _assert_every_rank_raised(outcomes, "1 of 4 ranks rejected", "rank 2:", "outside the vocabulary [0, 32)")


def test_one_rank_with_a_bad_label_fails_every_rank(dist):
    outcomes = _every_rank(dist(4), _step_with, "tp=2,dp_shard=2", 3, 8, "label")
    _assert_every_rank_raised(outcomes, "rank 3:", "labels hold ids", "-100 (ignored)")


def test_tensor_parallel_peers_with_different_batches(dist):
    outcomes = _every_rank(dist(2), _step_with, "tp=2", 1, 8, "batch")
    _assert_every_rank_raised(outcomes, "peers received different batches")


@pytest.fixture(scope="module")
def plain_python_output() -> str:
    """One `python -c` process without torchrun's environment (a fresh torch import costs ~5 s on 2 cores,
    so both checks below share it): a 2-rank plan first, which must refuse, then a 1-rank plan, which must
    train. The refusal leaves no process group behind, so the second call starts from a clean process."""
    code = (
        "import torch, meshkit\n"
        "from meshkit.testing.reference import ModelSpec\n"
        "try:\n"
        "    meshkit.parallelize(ModelSpec().build(), meshkit.Plan(tp=2))\n"
        "except ValueError as e:\n"
        "    print('ERROR:', e)\n"
        "pm = meshkit.parallelize(ModelSpec().build(), meshkit.Plan())\n"
        "ids = torch.randint(0, 64, (2, 8))\n"
        "print('LOSS', pm.forward_backward(ids, ids).item())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    return out.stdout + out.stderr


def test_running_without_torchrun(plain_python_output):
    assert "ERROR:" in plain_python_output, plain_python_output
    assert "not started by torchrun" in plain_python_output
    assert "torchrun --nproc-per-node 2" in plain_python_output


def test_single_process_runs_without_torchrun(plain_python_output):
    assert "LOSS" in plain_python_output, plain_python_output


@pytest.mark.parametrize(
    "plan, patterns",
    [
        ("pp=2,pp_schedule=dualpipe,pp_microbatches=3", ["pp_microbatches=3", "even", "pp_microbatches=4"]),
        ("pp=3,pp_schedule=dualpipe,pp_microbatches=4", ["pp=3", "must be even", "fix: pp=4 or pp=2"]),
        ("pp=2,pp_schedule=zb_auto,pp_memory_limit=0", ["pp_memory_limit=0", "smallest valid value is 1"]),
    ],
)
def test_dualpipe_and_zb_auto_sizes(dist, plan, patterns):
    """DualPipe with odd pp or an odd / too small microbatch count, zb_auto with a memory limit below any
    schedule's: the field and its smallest valid value, on every rank, before any collective."""
    _assert_every_rank_raised(_every_rank(dist(2), _parallelize, plan, ModelSpec(layers=4)), *patterns)
