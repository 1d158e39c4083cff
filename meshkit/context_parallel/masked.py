"""Attention with the score quirks some model families declare: sliding windows, logit soft-capping,
attention sinks. One adapter for every family that has any of them.

HF attention modules hand these to the attention function as keywords (`sliding_window=`,
`softcap=`, `s_aux=`), per layer, so a model with alternating local/global layers (Gemma-2/3,
SmolLM3, gpt-oss) is served layer by layer with no per-family code. Semantics, as HF's masks and
eager attention define them:

- sliding window w: query i sees key j when 0 <= i - j < w (row positions; inside a packed document
  that is the difference of its position ids);
- soft-capping c: scores s become c * tanh(s / c) before masking and softmax;
- sinks: one learned logit per head joins every row's softmax denominator and contributes no value.

The scores are explicit ([B, H, S, S] per call) and differentiated by plain autograd: exact, but
memory grows with S^2, unlike the fused kernels the plain causal path uses. Under context
parallelism Ulysses runs it (each rank sees whole sequences for a slice of heads, and their sinks);
the kinds that merge blocks by log-sum-exp apply the same quirks per block instead (`scores.py`:
band masks and soft-capped explicit scores; `ring.add_sinks_` after the merge).
"""

from __future__ import annotations

import math

import torch


def quirk_attention(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, *, scale: float,
                    doc_ids_BS: torch.Tensor | None = None, sliding_window: int | None = None,
                    softcap: float | None = None, sinks_H: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over whole sequences with the quirks above; [B, H, S, D] in and out.

    Keys longer than queries (decoding with a KV cache) align bottom-right: the queries are the last
    positions of the key sequence, and `doc_ids_BS` then covers the keys.
    """
    B, H, S, D = q_BHSD.shape
    Sk = k_BHSD.shape[2]
    rep = H // k_BHSD.shape[1]
    k = k_BHSD.repeat_interleave(rep, dim=1) if rep > 1 else k_BHSD
    v = v_BHSD.repeat_interleave(rep, dim=1) if rep > 1 else v_BHSD
    s_BHSS = torch.matmul(q_BHSD, k.transpose(-1, -2)) * scale
    if softcap:
        s_BHSS = torch.tanh(s_BHSS / softcap) * softcap
    pos_k = torch.arange(Sk, device=q_BHSD.device)
    diff_SS = (pos_k[Sk - S:])[:, None] - pos_k[None, :]
    keep = diff_SS >= 0
    if sliding_window:
        keep = keep & (diff_SS < sliding_window)
    keep = keep[None, None]
    if doc_ids_BS is not None:  # the documents of every key; the queries are the last S of them
        keep = keep & (doc_ids_BS[:, Sk - S:, None] == doc_ids_BS[:, None, :])[:, None]
    s_BHSS = s_BHSS.masked_fill(~keep, -math.inf)
    if sinks_H is not None:
        sink_BHS1 = sinks_H.to(s_BHSS.dtype).reshape(1, H, 1, 1).expand(B, H, S, 1)
        s_BHSS = torch.cat([s_BHSS, sink_BHS1], dim=-1)
    # Every row keeps at least its diagonal, so no row is empty.
    p_BHSS = torch.softmax(s_BHSS.float(), dim=-1).to(q_BHSD.dtype)
    if sinks_H is not None:
        p_BHSS = p_BHSS[..., :Sk]
    return torch.matmul(p_BHSS, v)


def has_quirks(sliding_window: int | None, softcap: float | None, sinks) -> bool:
    """Whether a layer's attention keywords ask for anything beyond plain causal attention."""
    return bool(sliding_window) or bool(softcap) or sinks is not None
