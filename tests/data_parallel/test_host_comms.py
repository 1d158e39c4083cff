"""FSDP's collectives through the shared-memory channel among a host's CPU ranks
(`data_parallel.host_comms`): under ZeRO-1, 2 and 3 and in bf16 mixed precision, training through the
channel and through gloo gives the single-device model's loss and gradients, the channel carries
FSDP's all-gathers and reduce-scatters, and both count the same collectives and bytes."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from tests_support import GRAD_TOL, LOSS_TOL
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from meshkit.comm_counter import CommCounter
from meshkit.mesh import axis
from meshkit.transport import shared_memory


def _fsdp_on_rank(plan: str, shared: bool) -> dict:
    os.environ["MESHKIT_SHARED_MEMORY"] = "1" if shared else "0"
    try:
        config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=66, max_position_embeddings=32, use_cache=False)
        torch.manual_seed(0)
        reference = LlamaForCausalLM(config)
        pm = meshkit.parallelize(copy.deepcopy(reference), meshkit.Plan.from_string(plan))
        group = axis(pm.mesh, "dp_shard_cp").get_group()
        channel = shared_memory.channel_of(group, torch.empty(0))
        before = channel._count if channel is not None else 0
        batches = [torch.randint(0, 66, (2, 8), generator=torch.Generator().manual_seed(10 * k + pm.dp_rank))
                   for k in range(2)]
        with CommCounter(pm.mesh) as counter:
            losses = [float(pm.forward_backward(ids, ids)) for ids in batches]  # an accumulation window
    finally:
        os.environ.pop("MESHKIT_SHARED_MEMORY")
    return {"losses": losses, "grads": {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                                        for name, p in pm.model.named_parameters()},
            "through channel": channel._count - before if channel is not None else 0,
            "fsdp events": sorted((kind, n) for kind, label, n in counter.events if label == "dp_shard_cp"),
            "config": config.to_dict(), "batches": batches}


def _reference(config: dict, batches_by_rank: list[list[torch.Tensor]]) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig.from_dict(config))
    losses = []
    for k in range(len(batches_by_rank[0])):
        ids = torch.cat([batches[k] for batches in batches_by_rank])  # the global batch of call k
        loss = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(float(loss))
    return losses, {name: p.grad for name, p in reference.named_parameters()}


@pytest.mark.parametrize("plan", ["dp_shard=2", "dp_shard=2,zero=1", "dp_shard=2,zero=2,param_dtype=bfloat16"])
def test_fsdp_through_shared_memory_and_through_gloo_match_one_device(dist, plan):
    runs = {shared: dist(2).run(_fsdp_on_rank, plan, shared) for shared in (True, False)}
    ref_losses, ref_grads = _reference(runs[True][0]["config"], [r["batches"] for r in runs[True]])
    for rank in range(2):
        shm, gloo = runs[True][rank], runs[False][rank]
        where = f"{plan}, rank {rank}"
        assert shm["through channel"] > 0 and gloo["through channel"] == 0, where
        # same collectives, same bytes; two ranks' sums are the same bits in either order
        assert shm["fsdp events"] == gloo["fsdp events"] and shm["fsdp events"], where
        assert shm["losses"] == gloo["losses"], where
        for name, grad in shm["grads"].items():
            assert torch.equal(grad, gloo["grads"][name]), f"{where}: {name}"
        if "bfloat16" in plan:
            continue
        for got, want in zip(shm["losses"], ref_losses):
            assert abs(got - want) <= LOSS_TOL, f"{where}: loss {got} vs {want}"
        for name, grad in shm["grads"].items():
            error = (grad - ref_grads[name]).abs().max().item()
            assert error <= GRAD_TOL, f"{where}: {name} differs by {error:.3g}"
