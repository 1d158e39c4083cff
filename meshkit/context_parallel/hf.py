"""meshkit's attention as a transformers attention implementation: no monkey-patching of HF code.

HF attention modules compute q/k/v, apply rotary embeddings and then call whatever function
`config._attn_implementation` names in transformers' `AttentionInterface`. meshkit registers one
function there. Everything it needs arrives as keywords HF passes through its blocks untouched, set
by meshkit's stage (`models.stage.CausalLMStage`) on every block call:

- `meshkit_context_parallel`: a `ContextParallelAttention`, how the sequence is split (ring,
  zig-zag ring, all-gather K/V, Ulysses, USP); absent when cp = 1;
- `meshkit_doc_ids`: the document ids of the local shard of packed sequences; absent for one
  document per row.

HF's own per-layer keywords are honoured too: `sliding_window`, `softcap` (attention-logit
soft-capping) and `s_aux` (attention sinks) route the layer through `masked.quirk_attention`, on one
rank or under Ulysses. The kinds that merge blocks by log-sum-exp (ring, zig-zag, all-gather, USP)
apply them per block instead: the window as a band mask over global positions (blocks wholly
outside it skipped), the soft-cap in each block's explicit scores (`scores.py`), the sinks after
their last merge (`ring.add_sinks_`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from meshkit.context_parallel.allgather import allgather_attention
from meshkit.context_parallel.group import as_group
from meshkit.context_parallel.kernels import attention_block
from meshkit.context_parallel.masked import has_quirks, quirk_attention
from meshkit.context_parallel.ring import ring_attention
from meshkit.context_parallel.ulysses import gather_seq, heads_to_seq, scatter_heads, ulysses_attention
from meshkit.context_parallel.usp import usp_attention

ATTENTION_NAME = "meshkit"
CONTEXT_PARALLEL_KWARG = "meshkit_context_parallel"
DOC_IDS_KWARG = "meshkit_doc_ids"


@dataclass
class ContextParallelAttention:
    """How one attention layer's sequence is split; `kind` None means not split (cp = 1).

    `ulysses_group` and `ring_group` make it 2D: Ulysses inside, and outside the ring ("usp") or the
    K/V all-gather ("allgather" with cp_ulysses > 1). `grad_dtype` is the dtype dK/dV travel in.
    """

    kind: str | None = None
    layout: str = "contiguous"
    group: object = None
    ulysses_group: object = None
    ring_group: object = None
    grad_dtype: torch.dtype | None = None
    keep_kv: bool = False  # ring kinds: keep forward's K/V blocks for backward (Plan.cp_keep_kv)

    def __call__(self, q_BHSD, k_BHSD, v_BHSD, scale: float, doc_ids_BS: torch.Tensor | None,
                 quirks: dict | None = None) -> torch.Tensor:
        if quirks and self.kind in (None, "ulysses"):
            return self._with_quirks(q_BHSD, k_BHSD, v_BHSD, scale, doc_ids_BS, quirks)
        # The merging kinds apply every quirk per block: soft-cap and window in each block's scores,
        # sinks once after the last merge (ring.add_sinks_).
        quirks = quirks or {}
        mods = dict(sinks_H=quirks.get("sinks_H"), softcap=quirks.get("softcap"), window=quirks.get("sliding_window"))
        if self.kind in ("ring", "zigzag"):
            return ring_attention(q_BHSD, k_BHSD, v_BHSD, self.group, causal=True, layout=self.layout,
                                  scale=scale, doc_ids_BS=doc_ids_BS, grad_dtype=self.grad_dtype,
                                  keep_kv=self.keep_kv, **mods)
        if self.kind == "allgather" and self.ulysses_group is None:
            return allgather_attention(q_BHSD, k_BHSD, v_BHSD, self.group, causal=True, scale=scale,
                                       doc_ids_BS=doc_ids_BS, grad_dtype=self.grad_dtype, **mods)
        if self.kind == "ulysses":
            return ulysses_attention(q_BHSD, k_BHSD, v_BHSD, self.group, causal=True, scale=scale,
                                     doc_ids_BS=doc_ids_BS)
        if self.kind in ("usp", "allgather"):
            return usp_attention(q_BHSD, k_BHSD, v_BHSD, self.ulysses_group, self.ring_group, causal=True,
                                 layout=self.layout, scale=scale, doc_ids_BS=doc_ids_BS,
                                 outer="ring" if self.kind == "usp" else "allgather", grad_dtype=self.grad_dtype,
                                 **mods)
        if k_BHSD.shape[2] != q_BHSD.shape[2]:
            return _cached_attention(q_BHSD, k_BHSD, v_BHSD, scale, doc_ids_BS)
        if doc_ids_BS is not None:
            out, _ = attention_block(q_BHSD, k_BHSD, v_BHSD, causal_kind="causal", scale=scale,
                                     q_doc_BS=doc_ids_BS, kv_doc_BS=doc_ids_BS)
            return out
        return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, is_causal=True, scale=scale,
                                              enable_gqa=k_BHSD.shape[1] != q_BHSD.shape[1])

    def full_length(self, local_len: int) -> int:
        """The whole sequence's length, from the local shard's (every kind splits it evenly)."""
        if self.kind is None:
            return local_len
        if self.ulysses_group is not None:  # usp, or allgather with a Ulysses inner axis
            return local_len * dist.get_world_size(as_group(self.ulysses_group)) * dist.get_world_size(
                as_group(self.ring_group))
        return local_len * dist.get_world_size(as_group(self.group))

    def _with_quirks(self, q_BHSD, k_BHSD, v_BHSD, scale, doc_ids_BS, quirks: dict) -> torch.Tensor:
        """Windows, soft-capping, sinks on whole sequences: on one rank or after Ulysses' all-to-all."""
        sinks_H = quirks.get("sinks_H")
        if sinks_H is not None and sinks_H.shape[0] != q_BHSD.shape[1]:
            raise ValueError(f"attention sinks for {sinks_H.shape[0]} heads but {q_BHSD.shape[1]} local query heads: "
                             "the sinks must be split over tp with the query heads (tensor_parallel.local."
                             "apply_head_params does it for the attention module's per-head parameters)")
        if self.kind is None:
            return quirk_attention(q_BHSD, k_BHSD, v_BHSD, scale=scale, doc_ids_BS=doc_ids_BS, **quirks)
        group = as_group(self.group)
        q_h, k_h, v_h = scatter_heads(q_BHSD, k_BHSD, v_BHSD, group)
        docs_BS = gather_seq(None if doc_ids_BS is None else doc_ids_BS.to(q_BHSD.device), group)
        if sinks_H is not None:
            heads = q_h.shape[1]
            start = dist.get_rank(group) * heads
            quirks = {**quirks, "sinks_H": sinks_H[start:start + heads]}
        out_h = quirk_attention(q_h, k_h, v_h, scale=scale, doc_ids_BS=docs_BS, **quirks)
        return heads_to_seq(out_h, group)


def _cached_attention(q_BHSD, k_BHSD, v_BHSD, scale: float, doc_ids_BS) -> torch.Tensor:
    """Queries that are the LAST positions of a longer key sequence (decoding with a KV cache).

    SDPA's `is_causal` aligns the mask top-left when the lengths differ, which would hide the cached
    keys from the new queries; the mask here is aligned bottom-right: query i sees keys up to
    i + (keys - queries). `doc_ids_BS`, when given, are the documents of every cached key (the
    queries are the last of them): generation's left padding is a document of its own, which the
    new tokens must not see.
    """
    sq, sk = q_BHSD.shape[2], k_BHSD.shape[2]
    if doc_ids_BS is not None and doc_ids_BS.shape[1] != sk:
        raise ValueError(f"meshkit attention: with a KV cache the document ids must cover every cached key "
                         f"({sk}), got {doc_ids_BS.shape[1]}")
    rows = torch.arange(sq, device=q_BHSD.device).unsqueeze(1) + (sk - sq)
    mask_QK = torch.arange(sk, device=q_BHSD.device).unsqueeze(0) <= rows
    if doc_ids_BS is not None:
        same_BQK = doc_ids_BS[:, sk - sq:, None] == doc_ids_BS[:, None, :]
        mask_QK = (mask_QK & same_BQK).unsqueeze(1)
    return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, attn_mask=mask_QK, scale=scale,
                                          enable_gqa=k_BHSD.shape[1] != q_BHSD.shape[1])


def meshkit_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The function transformers calls: [B, H, S, D] in, ([B, S, H, D], None) out, causal, no mask tensor."""
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported by meshkit; set attention_dropout=0.0")
    if attention_mask is not None:
        raise ValueError("meshkit attention takes no attention_mask; pass packed sequences as position_ids")
    split = kwargs.get(CONTEXT_PARALLEL_KWARG) or ContextParallelAttention()
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    if isinstance(sinks, DTensor):  # split with the query heads under tp: this rank's heads' sinks
        sinks = sinks.to_local()
    if window and window >= split.full_length(key.shape[2]):
        window = None  # every key is inside the window: plain causal attention
    quirks = None
    if has_quirks(window, softcap, sinks):
        quirks = {"sliding_window": window, "softcap": softcap, "sinks_H": sinks}
    query, key, value, v_dim = _equal_head_dims(query, key, value)
    out_BHSD = split(query, key, value, scale, kwargs.get(DOC_IDS_KWARG), quirks)[..., :v_dim]
    return out_BHSD.transpose(1, 2).contiguous(), None


def _equal_head_dims(q_BHSD, k_BHSD, v_BHSD):
    """q/k and v with one head dim, and v's own: multi-head latent attention (DeepSeek-V3) has
    qk_nope + qk_rope dims for scores and v_head_dim for values, while every kernel (and the ring's
    packed K/V buffer) takes one. Zero columns are exact: appended to v they give zero output
    columns, cut off after; appended to q and k they add nothing to the scores (the scale is passed)."""
    dq, dv = q_BHSD.shape[-1], v_BHSD.shape[-1]
    if dv < dq:
        v_BHSD = F.pad(v_BHSD, (0, dq - dv))
    elif dv > dq:
        q_BHSD, k_BHSD = F.pad(q_BHSD, (0, dv - dq)), F.pad(k_BHSD, (0, dv - dq))
    return q_BHSD, k_BHSD, v_BHSD, dv


def register() -> str:
    """Register meshkit's attention with transformers (idempotent); return its implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, meshkit_attention)
    return ATTENTION_NAME
