"""FSDP moves no more than a hand-written `fully_shard` layout of the same model: the embedding unit
is not all-gathered again for backward (its gradient needs only the token ids), nor is the last block
(backward needs it right after the head). That the gradients
stay the single-device model's is checked by every FSDP property test (tests/parallel)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from meshkit.comm_counter import CommCounter

MODEL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=160, max_position_embeddings=64, use_cache=False)
SEQ = 12


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL))


def _bytes(counter: CommCounter) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind, _, nbytes in counter.events:
        if kind in ("all_gather", "reduce_scatter"):
            out[kind] = out.get(kind, 0) + nbytes
    return out


def _fsdp_bytes_on_rank(ac: str) -> dict:
    ids = torch.randint(0, MODEL["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))
    pm = meshkit.parallelize(_model(), meshkit.Plan(dp_shard=2, activation_checkpointing=ac))
    pm.check_inputs = False
    with CommCounter(pm.mesh) as ours:
        pm.forward_backward(ids, ids)
    # The hand-written layout: embedding, each block, [norm, head] (kept gathered: backward needs it
    # first), then the root, as torch's FSDP2 examples and torchtitan wrap a Llama.
    model = _model()
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model.model.embed_tokens, mesh=mesh)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard([model.model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    with CommCounter(mesh) as theirs:
        model(input_ids=ids, labels=ids).loss.backward()
    embed_numel = MODEL["vocab_size"] * MODEL["hidden_size"]
    block_numel = sum(p.numel() for p in _model().model.layers[-1].parameters())
    return dict(ours=_bytes(ours), theirs=_bytes(theirs), embed_bytes=embed_numel * 4, block_bytes=block_numel * 4)


def test_embedding_and_last_block_are_not_gathered_again_for_backward(dist):
    for ac in ("none", "full"):
        for rank, r in enumerate(dist(2).run(_fsdp_bytes_on_rank, ac)):
            ours, theirs = r["ours"], r["theirs"]
            # gathers: the hand-written layout's minus exactly one embedding and one block (their backward re-gathers)
            assert ours["all_gather"] == theirs["all_gather"] - r["embed_bytes"] - r["block_bytes"], \
                (ac, rank, ours, theirs)
            assert ours["reduce_scatter"] == theirs["reduce_scatter"], (ac, rank, ours, theirs)
