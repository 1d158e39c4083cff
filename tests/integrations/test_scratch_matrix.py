"""scratch: LoRA across many plans"""
import dataclasses

import pytest
from tests_support import assert_matches_reference

from meshkit.testing.reference import BatchSpec, LoraSpec, ModelSpec, compare_training


def _cmp(plan, model, batch, meta_init=False):
    return dataclasses.asdict(compare_training(plan, model, batch, meta_init=meta_init))

L = LoraSpec()
CASES = [
 ("cp=2,dp_shard=2,cp_attention=ring", ModelSpec(lora=L), 16),
 ("cp=2,tp=2,cp_attention=ulysses", ModelSpec(lora=L), 16),
 ("cp=4,cp_attention=usp,cp_ulysses=2", ModelSpec(lora=L), 16),
 ("cp=2,dp_shard=2,cp_attention=allgather", ModelSpec(lora=L), 16),
 ("dp_replicate=2,dp_shard=2", ModelSpec(lora=L), 8),
 ("tp=2,dp_shard=2,activation_checkpointing=selective", ModelSpec(lora=L), 8),
 ("tp=2,dp_shard=2,activation_checkpointing=full", ModelSpec(lora=L), 8),
 ("dp_shard=4,zero=1", ModelSpec(lora=L), 8),
 ("dp_shard=4,zero=2", ModelSpec(lora=L), 8),
 ("dp_shard=4,offload=params", ModelSpec(lora=L), 8),
 ("pp=2,dp_shard=2,pp_schedule=interleaved_1f1b,pp_virtual_stages=2,pp_microbatches=2", ModelSpec(layers=4, lora=L), 8),
 ("pp=2,dp_shard=2,pp_schedule=gpipe,pp_microbatches=2", ModelSpec(tied=True, lora=L), 8),
 ("pp=2,tp=2,pp_schedule=zb_v,pp_microbatches=2", ModelSpec(layers=4, lora=L), 8),
 ("pp=2,tp=2,pp_schedule=dualpipe_v,pp_microbatches=4", ModelSpec(layers=4, lora=L), 8),
 ("pp=2,tp=2,pp_schedule=zb_h2,pp_microbatches=4", ModelSpec(layers=2, lora=L), 8),
 ("dp_shard=2,tp=2,ep=2", ModelSpec(kind="mixtral", experts=4, intermediate=16, lora=LoraSpec(targets=("q_proj","k_proj","v_proj","o_proj"))), 8),
 ("tp=2,dp_shard=2", ModelSpec(kind="qwen2", lora=L), 8),
 ("tp=2,dp_shard=2", ModelSpec(kind="qwen3", lora=LoraSpec(rslora=True, r=2, alpha=3)), 8),
 ("dp_shard=2,tp=2,ep=2,activation_checkpointing=selective", ModelSpec(kind="qwen2_moe", experts=4, intermediate=16, lora=LoraSpec(targets=("q_proj","o_proj"))), 8),
]
@pytest.mark.parametrize("case", range(len(CASES)))
def test_case(dist, case):
    plan, model, seq = CASES[case]
    r = dist(4).run(_cmp, plan, model, BatchSpec(batch=4, seq=seq), meta_init=case % 3 == 0)
    assert_matches_reference(r, plan)
