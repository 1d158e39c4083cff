"""The vocabulary-parallel embedding and LM head on local shards (`tensor_parallel.local.apply_local_ends`):
the single-device model's loss and gradients with and without SP, tied or not, with logits gathered or
vocabulary-sharded, and a padding token inside one rank's rows; the styles keep ends that cannot."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from tests_support import GRAD_TOL, LOSS_TOL
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from meshkit.models import llama


class _OwnEmbedding(torch.nn.Embedding):
    """A subclass (as Gemma 3's scaled embedding is), whose forward the local path would bypass."""


def _ends_on_rank(plan: str, plain: bool, tied: bool, pad: int | None) -> dict:
    vocab = 64
    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=32, use_cache=False,
                         tie_word_embeddings=tied, pad_token_id=pad)
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config)
    if not plain:
        reference.model.embed_tokens.__class__ = _OwnEmbedding
    pm = meshkit.parallelize(copy.deepcopy(reference), meshkit.Plan.from_string(plan))
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(3))
    if pad is not None:
        ids[:, ::3] = pad  # the padding row gets no gradient, on the rank holding it as on one device
    loss = pm.forward_backward(ids, ids)
    ref_loss = reference(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    ref_grads = dict(reference.named_parameters())
    error = 0.0
    for name, param in pm.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        error = max(error, (grad - ref_grads[name].grad).abs().max().item())
    parts = llama.parts(pm.model)
    return {"loss": abs(float(loss) - float(ref_loss)), "grad": error,
            "local": isinstance(parts.embed.forward, functools.partial)}


@pytest.mark.parametrize("plan, plain, tied, pad", [
    ("tp=2", True, False, 33),                            # SP; the padding row on tp rank 1
    ("tp=2,sequence_parallel=false", True, True, 5),      # tied: one DTensor serves both ends
    ("tp=2,loss_parallel=false", True, True, None),       # logits gathered over the vocabulary
    ("tp=2", False, False, 33),                           # an embedding subclass keeps the styles
])
def test_local_ends_match_the_single_device_model(dist, plan, plain, tied, pad):
    for rank, r in enumerate(dist(2).run(_ends_on_rank, plan, plain, tied, pad)):
        where = f"{plan}, plain {plain}, tied {tied}, rank {rank}"
        assert r["local"] is plain, where
        assert r["loss"] <= LOSS_TOL, f"{where}: loss differs by {r['loss']:.3g}"
        assert r["grad"] <= GRAD_TOL, f"{where}: gradients differ by {r['grad']:.3g}"
