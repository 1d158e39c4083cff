"""Sequence parallelism's pairwise all-gather and reduce-scatter on gloo (`tensor_parallel.pairwise`):
the same values as gathering and summing every rank's input in rank order, counted as the collective
they implement, and an SP accumulation window that adds the norms' Partial gradients locally."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from tests_support import GRAD_TOL
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from meshkit.comm_counter import CommCounter
from meshkit.tensor_parallel import pairwise


def _inputs(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank))


def _pairwise_on_rank(batch: int) -> dict:
    rank, size, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    s, hidden = 3, 5
    shard = _inputs(rank, (batch, s, hidden))
    partial = _inputs(size + rank, (batch, size * s, hidden))
    with CommCounter() as counter:
        gathered = pairwise.all_gather(shard, group, size)
        summed = pairwise.reduce_scatter(partial, group, size)
    # every rank's inputs rebuilt here, so the expectation needs no collective
    expected_gather = torch.cat([_inputs(r, (batch, s, hidden)) for r in range(size)], dim=1)
    partials = [_inputs(size + r, (batch, size * s, hidden))[:, rank * s:(rank + 1) * s] for r in range(size)]
    expected_sum = partials[0] + partials[1]
    for part in partials[2:]:
        expected_sum = expected_sum + part
    return {"applies": pairwise.applies(shard, group), "gather": torch.equal(gathered, expected_gather),
            "sum": torch.equal(summed, expected_sum), "contiguous": summed.is_contiguous(),
            "partial untouched": torch.equal(partial, _inputs(size + rank, partial.shape)),
            "events": [(kind, n) for kind, _, n in counter.events]}


def test_pairwise_collectives_match_gathering_and_summing_in_rank_order(dist):
    for world in (2, 3):
        for batch in (1, 2):  # one row: received straight into place; two: through a staging buffer
            results = dist(world).run(_pairwise_on_rank, batch)
            full = batch * world * 3 * 5 * 4
            for rank, r in enumerate(results):
                where = f"world {world}, batch {batch}, rank {rank}"
                assert r["applies"] and r["gather"] and r["sum"] and r["contiguous"], f"{where}: {r}"
                assert r["partial untouched"], where
                # counted as one all-gather (gathered bytes) and one reduce-scatter (input bytes), no messages
                assert r["events"] == [("all_gather", full), ("reduce_scatter", full)], f"{where}: {r['events']}"


def _sp_accumulation_on_rank() -> dict:
    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    pm = meshkit.parallelize(copy.deepcopy(reference), meshkit.Plan(tp=2))
    batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(k)) for k in range(2)]
    pm.forward_backward(batches[0], batches[0])
    with CommCounter(pm.mesh) as counter:  # no zero_grad: the second call accumulates onto summed norms
        pm.forward_backward(batches[1], batches[1])
    for ids in batches:
        reference(input_ids=ids, labels=ids).loss.backward()
    ref_grads = dict(reference.named_parameters())
    error = 0.0
    for name, param in pm.model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        error = max(error, (grad - ref_grads[name].grad).abs().max().item())
    norm_bytes = config.hidden_size * 4
    return {"error": error, "per-norm all-reduces": sum(1 for kind, _, n in counter.events
                                                         if kind == "all_reduce" and n == norm_bytes)}


def test_sp_accumulation_sums_norm_gradients_once_per_call(dist):
    for rank, r in enumerate(dist(2).run(_sp_accumulation_on_rank)):
        assert r["error"] <= GRAD_TOL, f"rank {rank}: accumulated gradients differ by {r['error']:.3g}"
        # the 5 norms' Partial gradients add locally and join one flat all-reduce (was one each)
        assert r["per-norm all-reduces"] == 0, f"rank {rank}: {r}"
