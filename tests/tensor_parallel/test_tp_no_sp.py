"""Tensor parallelism without sequence parallelism: q/k/v (and gate/up) share one input DTensor, so
their input gradients are summed before ONE all-reduce per attention and per MLP; the gradients stay
the single-device model's. Byte counts are checked against the estimator in tests/estimate."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from tests_support import assert_matches_reference
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from meshkit.comm_counter import CommCounter
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

LAYERS = 2


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec):
    return dataclasses.asdict(compare_training(plan, model, batch))


def _tp_all_reduces_on_rank() -> int:
    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, use_cache=False)
    torch.manual_seed(0)
    pm = meshkit.parallelize(LlamaForCausalLM(config), meshkit.Plan(tp=2, sequence_parallel=False))
    pm.check_inputs = False
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    with CommCounter(pm.mesh) as counter:
        pm.forward_backward(ids, ids)
    # activation-sized all-reduces only (the loss's scalars and per-row statistics are smaller)
    return sum(1 for kind, _, n in counter.events if kind == "all_reduce" and n >= 2 * 8 * 32 * 4)


def test_tp_without_sp_matches_single_device(dist):
    results = dist(2).run(_compare_on_rank, "tp=2,sequence_parallel=false", ModelSpec(layers=LAYERS),
                          BatchSpec(batch=2, seq=12, documents=2))
    assert_matches_reference(results, "tp=2 without SP")


def test_tp_without_sp_reduces_input_gradients_once_per_attention_and_mlp(dist):
    # forward: o and down (2 per block) and the embedding output; backward: one input-gradient
    # all-reduce per attention and per MLP (2 per block, not 5) and the LM head's input
    assert dist(2).run(_tp_all_reduces_on_rank) == [4 * LAYERS + 2] * 2
