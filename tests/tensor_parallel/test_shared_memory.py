"""The shared-memory channel among a host's CPU ranks (`meshkit.transport.shared_memory`) and TP on it:
the values of gathering and summing every rank's input in rank order, counted as the collective, a
refusal on one rank sending every rank through gloo, a peer that exits or stalls failing the waiting
rank with a message, out-of-step ranks caught, nothing left in /dev/shm, and training through it and
through gloo matching the single-device model."""

from __future__ import annotations

import copy
import glob
import os
import time

import pytest
import torch
import torch.distributed as dist
from tests_support import GRAD_TOL, LOSS_TOL
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from meshkit.comm_counter import CommCounter
from meshkit.tensor_parallel import local
from meshkit.transport import shared_memory


def _inputs(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def _in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0] + parts[1]
    for part in parts[2:]:
        out = out + part
    return out


def _collectives_on_rank(batch: int, dtype: torch.dtype) -> dict:
    rank, size, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    channel = shared_memory.open_for(group, "cpu")
    again = shared_memory.open_for(dist.new_group(list(range(size))), "cpu")  # the same processes: one channel
    left = glob.glob("/dev/shm/meshkit-shm-*")
    s, hidden = 3, 5
    shard, partial = _inputs(rank, (batch, s, hidden), dtype), _inputs(size + rank, (batch, size * s, hidden), dtype)
    with CommCounter() as counter:
        gathered = channel.all_gather(shard, group)
        summed = channel.reduce_scatter(partial, group)
        reduced = channel.all_reduce(partial, group)
    expected_gather = torch.cat([_inputs(r, (batch, s, hidden), dtype) for r in range(size)], dim=1)
    partials = [_inputs(size + r, (batch, size * s, hidden), dtype) for r in range(size)]
    full = batch * size * s * hidden * partial.element_size()
    return {"reused": again is channel, "files left": left,
            "gather": torch.equal(gathered, expected_gather),
            "sum": torch.equal(summed, _in_rank_order([p[:, rank * s:(rank + 1) * s] for p in partials])),
            "all-reduce": torch.equal(reduced, _in_rank_order(partials)),
            "partial untouched": torch.equal(partial, _inputs(size + rank, partial.shape, dtype)),
            "events": [(kind, n) for kind, _, n in counter.events], "full": full}


def test_channel_collectives_match_gathering_and_summing_in_rank_order(dist):
    for world in (2, 3):
        for batch, dtype in ((1, torch.float32), (2, torch.bfloat16)):
            for rank, r in enumerate(dist(world).run(_collectives_on_rank, batch, dtype)):
                where = f"world {world}, batch {batch}, {dtype}, rank {rank}"
                assert r["reused"] and r["files left"] == [], f"{where}: {r}"
                assert r["gather"] and r["sum"] and r["all-reduce"] and r["partial untouched"], f"{where}: {r}"
                full = r["full"]
                assert r["events"] == [("all_gather", full), ("reduce_scatter", full), ("all_reduce", full)], where


def _refusal_on_rank() -> dict:
    rank, size, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    channel = shared_memory.open_for(group, "cpu")
    before = channel._count
    x = _inputs(rank, (2, 2 * size, 4))
    if rank == 1:  # only this rank's slot is too small: every rank must still take gloo together
        shared_memory.SLOT_BYTES, limit = 16, shared_memory.SLOT_BYTES
    try:
        with CommCounter() as counter:
            gathered = local._all_gather_sequence(x, group, size)
            reduced = local._all_reduce(x, group)
    finally:
        if rank == 1:
            shared_memory.SLOT_BYTES = limit
    return {"gather": torch.equal(gathered, torch.cat([_inputs(r, x.shape) for r in range(size)], dim=1)),
            "all-reduce": (reduced - _in_rank_order([_inputs(r, x.shape) for r in range(size)])).abs().max().item(),
            "kinds": [kind for kind, _, _ in counter.events], "votes": channel._count - before,
            "broken": channel.broken}


def test_a_refusal_on_one_rank_sends_every_rank_through_gloo(dist):
    for rank, r in enumerate(dist(2).run(_refusal_on_rank)):
        assert r["gather"] and r["all-reduce"] <= 1e-6, f"rank {rank}: {r}"
        assert r["votes"] == 2 and not r["broken"], f"rank {rank}: {r}"
        assert r["kinds"] == ["all_gather", "all_reduce"], f"rank {rank}: counted once each, {r['kinds']}"


def _peer_exits_on_rank() -> str:
    channel = shared_memory.open_for(dist.group.WORLD, "cpu")
    if dist.get_rank() == 1:
        os._exit(3)
    try:
        channel.all_reduce(torch.ones(4), dist.group.WORLD)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_a_peer_that_exits_fails_the_waiting_rank_at_once(dist):
    start = time.monotonic()
    outcomes = dist(2).run_raw(_peer_exits_on_rank)
    assert time.monotonic() - start < 30.0
    assert not outcomes[1].ok
    assert outcomes[0].ok and "rank 1 of a shared-memory group closed its channel" in outcomes[0].value, outcomes[0]


def _stall_then_reopen_on_rank() -> dict:
    rank, group = dist.get_rank(), dist.group.WORLD
    channel = shared_memory.open_for(group, "cpu")
    message = ""
    if rank == 0:
        channel._timeout_s = 0.5
        try:
            channel.all_reduce(torch.ones(4), group)
        except RuntimeError as err:
            message = str(err)
    else:
        time.sleep(2.0)  # never joins that collective
    fresh = shared_memory.open_for(group, "cpu")  # rank 0's channel is broken: both ranks open a new one
    total = fresh.all_reduce(torch.full((4,), float(rank + 1)), group)
    return {"message": message, "fresh": fresh.token != channel.token, "total": total.tolist()}


def test_a_stalled_peer_times_out_and_the_next_parallelize_opens_a_fresh_channel(dist):
    results = dist(2).run(_stall_then_reopen_on_rank)
    assert "rank 1 of a shared-memory group did not reach the collective within 0 s" in results[0]["message"] or \
        "rank 1 of a shared-memory group did not reach the collective within 1 s" in results[0]["message"], results[0]
    for rank, r in enumerate(results):
        assert r["fresh"] and r["total"] == [3.0] * 4, f"rank {rank}: {r}"


def _out_of_step_on_rank() -> str:
    channel = shared_memory.open_for(dist.group.WORLD, "cpu")
    if dist.get_rank() == 0:
        channel._count += 2  # as if it had run a collective its peer never saw (same slot parity)
    try:
        channel.all_reduce(torch.ones(4), dist.group.WORLD)
    except RuntimeError as err:
        return str(err)
    return "no error"


def test_ranks_out_of_step_raise_instead_of_reading_an_unfilled_slot(dist):
    for rank, message in enumerate(dist(2).run(_out_of_step_on_rank)):
        assert "out of step" in message, f"rank {rank}: {message}"


def _training_on_rank(plan: str, shared: bool) -> dict:
    os.environ["MESHKIT_SHARED_MEMORY"] = "1" if shared else "0"
    try:
        config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, use_cache=False)
        torch.manual_seed(0)
        reference = LlamaForCausalLM(config)
        pm = meshkit.parallelize(copy.deepcopy(reference), meshkit.Plan.from_string(plan))
        channel = shared_memory.channel_of(pm.mesh["tp"].get_group(), torch.empty(0))
        before = channel._count if channel is not None else 0
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        loss = pm.forward_backward(ids, ids)
    finally:
        os.environ.pop("MESHKIT_SHARED_MEMORY")
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref_grads = dict(reference.named_parameters())
    error = 0.0
    for name, param in pm.model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        error = max(error, (grad - ref_grads[name].grad).abs().max().item())
    return {"loss": abs(float(loss) - float(ref_loss)), "grad": error,
            "collectives": channel._count - before if channel is not None else 0}


@pytest.mark.parametrize("plan", ["tp=2", "tp=2,sequence_parallel=false"])
def test_training_through_shared_memory_and_through_gloo_matches_one_device(dist, plan):
    for shared in (True, False):
        for rank, r in enumerate(dist(2).run(_training_on_rank, plan, shared)):
            where = f"{plan}, shared memory {shared}, rank {rank}"
            assert r["loss"] <= LOSS_TOL and r["grad"] <= GRAD_TOL, f"{where}: {r}"
            # SP: an all-gather and a reduce-scatter per boundary and direction; no SP: one all-reduce
            assert (r["collectives"] > 0) is shared, f"{where}: {r['collectives']} collectives through the channel"
