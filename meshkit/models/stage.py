"""A contiguous slice of a causal LM as one module: what a rank runs, and what FSDP's root wraps.

meshkit drives the HF blocks itself instead of calling the HF model's forward: it needs to start and
stop at any block (pipeline stages), to keep the residual stream sequence-sharded (SP), and to pass
exactly the masks and positions each block needs. The stage holds the HF submodules themselves, not
copies, so the HF model object still names every parameter and `model.state_dict()` keeps HF keys.
"""

from __future__ import annotations

import torch
from torch import nn

from meshkit.context_parallel.hf import DOC_IDS_KWARG
from meshkit.models import llama


class CausalLMStage(nn.Module):
    """Embedding (first stage only), a run of decoder blocks, then norm and LM head (last stage only).

    Input: token ids [B, S] on the first stage, hidden states otherwise. Output: logits on the last
    stage, hidden states otherwise. `position_ids` are the global positions of the tokens this rank
    holds, so rotary embeddings stay correct when the sequence is sharded; `doc_ids` mark the
    documents of packed sequences (block-diagonal causal attention), None for one document per row.
    """

    def __init__(
        self,
        blocks: dict[int, nn.Module],
        rotary: nn.Module,
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Module | None = None,
    ):
        super().__init__()
        self.embed = embed
        self.layers = nn.ModuleDict({str(i): block for i, block in blocks.items()})
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = rotary

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids or hidden states in; logits (last stage) or hidden states out."""
        hidden = self.embed(inputs) if self.embed is not None else inputs
        position_embeddings = self.rotary(hidden, position_ids)
        extra = {DOC_IDS_KWARG: doc_ids} if doc_ids is not None else {}
        for block in self.layers.values():
            hidden = llama.run_block(block, hidden, position_embeddings, position_ids, **extra)
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.lm_head is not None:
            hidden = self.lm_head(hidden)
        return hidden
