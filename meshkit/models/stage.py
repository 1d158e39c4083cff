"""A contiguous slice of a causal LM as one module: what a rank runs, and what FSDP's root wraps.

meshkit drives the HF blocks itself instead of calling the HF model's forward: it needs to start and
stop at any block (pipeline stages), to keep the residual stream sequence-sharded (SP), and to pass
exactly the masks and positions each block needs. The stage holds the HF submodules themselves, not
copies, so the HF model object still names every parameter and `model.state_dict()` keeps HF keys.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from meshkit.context_parallel.hf import CONTEXT_PARALLEL_KWARG, DOC_IDS_KWARG, ContextParallelAttention
from meshkit.models import llama
from meshkit.models import quirks as quirks_lib


class CausalLMStage(nn.Module):
    """Embedding (first stage only), a run of decoder blocks, then norm and LM head (last stage only).

    Input: token ids [B, S] on the first stage, hidden states otherwise. Output: logits on the last
    stage, hidden states otherwise. `position_ids` are the global positions of the tokens this rank
    holds, so rotary embeddings stay correct when the sequence is sharded; `doc_ids` mark the
    documents of packed sequences (block-diagonal causal attention), None for one document per row.
    `context_parallel` says how attention is split over the cp ranks (None: not split); the stage
    hands it and the document ids to meshkit's attention function as keywords of every block call.
    """

    def __init__(
        self,
        blocks: dict[int, nn.Module],
        rotary: nn.Module,
        embed: nn.Module | None = None,
        norm: nn.Module | None = None,
        lm_head: nn.Module | None = None,
        context_parallel: ContextParallelAttention | None = None,
        quirks: quirks_lib.OuterQuirks | None = None,
        cache_keyword: str = "cache",
    ):
        super().__init__()
        self.cache_keyword = cache_keyword
        self.embed = embed
        self.layers = nn.ModuleDict({str(i): block for i, block in blocks.items()})
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = rotary
        self.context_parallel = context_parallel
        self.quirks = quirks or quirks_lib.OuterQuirks()

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        """Token ids or hidden states in; logits (last stage) or hidden states out.

        `cache` (generation only) is an object with HF's `update(key, value, layer_idx, ...)` that
        every attention layer hands its new keys and values to and takes the whole sequence's back.
        """
        quirks = self.quirks
        hidden = quirks_lib.scale_embeddings(self.embed(inputs), quirks) if self.embed is not None else inputs
        rope = quirks_lib.position_embeddings(self.rotary, hidden, position_ids, quirks)
        extra = {DOC_IDS_KWARG: doc_ids} if doc_ids is not None else {}
        if self.context_parallel is not None:
            extra[CONTEXT_PARALLEL_KWARG] = self.context_parallel
        if cache is not None:
            extra[self.cache_keyword] = cache
        for index, block in self.layers.items():
            hidden = llama.run_block(block, hidden, rope[quirks_lib.layer_type(quirks, int(index))], position_ids,
                                     **extra)
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.lm_head is not None:
            hidden = quirks_lib.transform_logits(self.lm_head(hidden), quirks)
        return hidden


def build_stages(
    parts: llama.CausalLMParts,
    blocks: Sequence[nn.Module],
    ranges: Sequence[range],
    stage_ids: Sequence[int],
    context_parallel: ContextParallelAttention | None = None,
    chunks: Sequence[int] | None = None,
) -> dict[int, CausalLMStage]:
    """The `CausalLMStage` modules for `stage_ids` of a split into `ranges` (`pipeline.split`, one range
    per stage); `blocks` are the (possibly wrapped) decoder blocks. `chunks` numbers the chunk of layers
    each stage runs (default: its own); the first chunk's stages embed, the last chunk's end in the head
    (DualPipe runs every chunk as two stages, one per direction)."""
    chunks = list(range(len(ranges))) if chunks is None else list(chunks)
    last = max(chunks)
    return {
        s: CausalLMStage(
            {i: blocks[i] for i in ranges[s]},
            parts.rotary,
            embed=parts.embed if chunks[s] == 0 else None,
            norm=parts.norm if chunks[s] == last else None,
            lm_head=parts.lm_head if chunks[s] == last else None,
            context_parallel=context_parallel,
            quirks=parts.quirks,
            cache_keyword=llama.cache_keyword(parts.blocks[0]) if parts.blocks else "cache",
        )
        for s in stage_ids
    }
