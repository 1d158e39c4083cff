"""Selective activation checkpointing of MoE layers when the first MoE forward of the process runs
inside the checkpointed region, against the single-device HF model (loss, gradients, parameters).

The grouped-GEMM backend is chosen by probing `torch._grouped_mm` once per process (cached). That
probe used to run inside the first checkpointed forward, where selective checkpointing cached its
output as the first `_grouped_mm` call; the recompute (probe already cached) then received the
probe's [8, 8] output for the layer's real gate/up projection and backward failed with torch's
CheckpointError. Whether it showed depended on whether anything earlier in the process had run an
MoE forward, so each case clears the probe's cache first, as a fresh training process has it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests_support import GRAD_TOL, LOSS_TOL, assert_matches_reference

from meshkit.activation_checkpoint import CheckpointedBlock
from meshkit.expert_parallel.grouped_gemm import _kernel_runs
from meshkit.models.moe import convert_moe_blocks
from meshkit.testing.families import family_spec
from meshkit.testing.reference import BatchSpec, compare_training

BATCH = BatchSpec(batch=4, seq=8)


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor):
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_selectively_checkpointed_moe_blocks_match_hf_on_one_process():
    spec = family_spec("olmoe", seed=0)
    ref, model = spec.build(), spec.build()
    convert_moe_blocks(model)
    for layer in model.model.layers:
        layer.mlp = CheckpointedBlock(layer.mlp, "selective")
    ids, labels = BATCH.make(spec.vocab)
    ref_loss, ref_grads = _loss_and_grads(ref, ids, labels)
    _kernel_runs.cache_clear()  # as in a fresh process: the probe runs inside the first checkpointed forward
    loss, grads = _loss_and_grads(model, ids, labels)
    assert abs(loss - ref_loss) <= LOSS_TOL, (loss, ref_loss)
    for name, g in ref_grads.items():
        got = grads[name.replace(".mlp.", ".mlp.block.")]
        assert got is not None, f"{name}: no gradient"
        assert (got - g).abs().max() <= GRAD_TOL, f"{name}: gradient differs by {(got - g).abs().max():.3g}"


def _first_moe_forward_checkpointed(plan: str, kind: str, batch: BatchSpec):
    _kernel_runs.cache_clear()  # as in a fresh process: the probe runs inside the first checkpointed forward
    return dataclasses.asdict(compare_training(plan, family_spec(kind, seed=0), batch))


def test_selective_checkpointing_under_fsdp_matches_hf(dist):
    plan = "dp_shard=2,activation_checkpointing=selective"
    results = dist(2).run(_first_moe_forward_checkpointed, plan, "olmoe", BATCH, timeout=300)
    assert_matches_reference(results, f"olmoe under {plan}")


@pytest.mark.slow  # the same probe path as the dp_shard=2 case, with DeepSeek-V3's routing and CP on 4 ranks
def test_selective_checkpointing_under_allgather_cp_matches_hf(dist):
    plan = "dp_shard=2,cp=2,cp_attention=allgather,activation_checkpointing=selective"
    results = dist(4).run(_first_moe_forward_checkpointed, plan, "deepseek_v3", BATCH, timeout=600)
    assert_matches_reference(results, f"deepseek_v3 under {plan}")
