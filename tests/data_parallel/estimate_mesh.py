"""The real 4-rank mesh the estimator's memory tests measure: one tiny model, one batch, and a model
trained one step under a plan, so that what a rank then holds and moves is a steady state."""

from __future__ import annotations

import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from meshkit.mesh import axis
from meshkit.plan import Plan

# Uneven FSDP shards on purpose (35 gate rows per tp rank, a 129-row vocabulary half).
MODEL = dict(hidden_size=48, intermediate_size=70, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, head_dim=8, vocab_size=258)
SEQ, BATCH = 16, 2


def model_config() -> LlamaConfig:
    """The tiny model's config, as the estimator reads it."""
    return LlamaConfig(**MODEL)


def after_one_step(plan: str) -> tuple[meshkit.ParallelModel, torch.optim.Optimizer, torch.Tensor]:
    """(model, AdamW, the batch) after one training step under `plan`: optimizer state exists, so the
    next window shows everything a rank keeps. Input checks are off (their few bytes are not estimated)."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # offload: "saves nothing here", this machine has no accelerator
        pm = meshkit.parallelize(LlamaForCausalLM(LlamaConfig(max_position_embeddings=64, **MODEL)),
                                 Plan.from_string(plan))
    pm.check_inputs = False
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    pm.forward_backward(ids, ids)
    opt.step()
    return pm, opt, ids


def coordinates(pm: meshkit.ParallelModel) -> dict[str, int]:
    """This rank's place on the axes the estimator's per-rank state depends on."""
    return {"pp_rank": pm.mesh["pp"].get_local_rank(), "tp_rank": pm.mesh["tp"].get_local_rank(),
            "fsdp_rank": axis(pm.mesh, "dp_shard_cp").get_local_rank()}


def local_bytes(tensors) -> int:
    """Bytes of the local parts (a DTensor's shard on this rank)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)
