"""Real HF checkpoints of several families: `save_pretrained` -> meta model under a plan ->
`load_hf_checkpoint` (each rank reads its shards) -> the loss equals HF's on the original model ->
`save_hf_checkpoint` -> `from_pretrained` gives bit-identical logits to the original model."""

from __future__ import annotations

import os

import pytest
import torch
import transformers

import meshkit
from meshkit.state import hf_checkpoint as hf_io
from meshkit.testing.families import family_spec
from meshkit.testing.reference import BatchSpec, ModelSpec

BATCH = BatchSpec(batch=4, seq=8)
LOSS_TOL = 1e-5


def _load_and_export(spec: ModelSpec, plan: str, source: str, target: str):
    pm = meshkit.parallelize(spec.build(device="meta"), meshkit.Plan.from_string(plan))
    hf_io.load_hf_checkpoint(pm, source)
    ids, labels = BATCH.make(spec.vocab)
    rows = BATCH.batch // pm.dp_size
    mine = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
    loss = (pm.evaluate(ids[mine], labels[mine]) if pm.plan.pp == 1 else pm.forward_backward(ids[mine], labels[mine]))
    hf_io.save_hf_checkpoint(pm, target)
    return loss.item()


FULL = os.environ.get("HYPOTHESIS_PROFILE", "ci") != "ci"
CASES = [("llama", "tp=2,dp_shard=2"), ("qwen2", "pp=2,dp_shard=2,pp_microbatches=2"), ("gemma2", "tp=2,dp_shard=2"),
         ("qwen2_moe", "dp_shard=4,ep=4"), ("olmoe", "tp=2,dp_shard=2"),
         ("deepseek_v3", "cp=2,dp_shard=2,ep=4,cp_attention=zigzag"), ("gpt_oss", "tp=2,dp_shard=2,ep=2")]
# CI: Gemma-2 (the dense family with quirks) and Qwen2-MoE (shared expert and its gate, experts over ep).
CI_KINDS = ("gemma2", "qwen2_moe")


@pytest.mark.parametrize("kind, plan", [c for c in CASES if FULL or c[0] in CI_KINDS])
def test_save_pretrained_load_export_round_trip(dist, tmp_path, kind, plan):
    spec = family_spec(kind, tied=kind == "gemma2")
    original = spec.build().eval()
    original.save_pretrained(tmp_path / "in")
    losses = dist(4).run(_load_and_export, spec, plan, str(tmp_path / "in"), str(tmp_path / "out"))
    ids, labels = BATCH.make(spec.vocab)
    with torch.no_grad():
        want = original(input_ids=ids, labels=labels, use_cache=False)
    for rank, loss in enumerate(losses):
        assert abs(loss - want.loss.item()) <= LOSS_TOL, f"rank {rank}: loss {loss} vs HF {want.loss.item()}"
    attn = original.config._attn_implementation
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation=attn).eval()
    assert type(exported) is type(original)
    with torch.no_grad():
        assert torch.equal(exported(ids, use_cache=False).logits, want.logits)
