"""Attention on explicit scores: the reference every kernel is tested against, and the only way to
compute a block whose scores are soft-capped (Gemma 2), which no fused kernel offers.

One block is [B, H, Sq, Sk] scores in the accumulation dtype (fp32, fp64 for fp64 inputs). Its
forward returns (out, lse) like the fused kernels; its backward takes the FINAL merged out and lse
of the rows, as the fused backward does, so a block's gradient is its exact share of the softmax
over every block (ring.py). Soft-capping c makes the scores s = c * tanh(x / c) of the scaled dot
products x, before any mask; the backward differentiates through the tanh: dx = ds * (1 - tanh^2).

Masks (`block_mask`): causal on square diagonal blocks, block-diagonal for packed documents, and a
sliding window w over global token positions (query i sees key j when i - j < w, HF's rule; the
causal structure of the blocks supplies j <= i). Empty rows (every key masked) give out = 0,
lse = -inf and zero gradients.

Cost: the explicit path holds the block's scores and probabilities ([B, H, Sq, Sk] each, fp32)
where the fused kernels hold O(Sq) per row, and runs unfused matmuls and elementwise ops
(docs/context_parallel.md measures it against the CPU flash kernel).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ScoreMods:
    """What a layer changes in every block's scores: soft-capping and a sliding window (None: off).
    The merging kinds (ring, zig-zag, all-gather) hand them to each block with its token positions."""

    softcap: float | None = None
    window: int | None = None

    def checked(self, causal: bool) -> ScoreMods:
        """Itself, if the soft-cap is positive and the window a positive number of positions on causal
        attention (a window bounds how far back a query looks), else a ValueError naming the value."""
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap={self.softcap}: the soft-cap must be positive (or None)")
        if self.window is not None and (int(self.window) != self.window or self.window < 1 or not causal):
            raise ValueError(f"window={self.window}: a sliding window is a positive number of positions on "
                             f"causal attention (causal={causal})")
        return self

    def block(self, q_pos_S: torch.Tensor | None, kv_pos_S: torch.Tensor | None) -> dict:
        """Keywords of `kernels.attention_forward` / `attention_backward` for one block."""
        if not self.window:
            return dict(softcap=self.softcap)
        return dict(softcap=self.softcap, window=self.window, q_pos_S=q_pos_S, kv_pos_S=kv_pos_S)

    def visible(self, q_pos_S: torch.Tensor | None, kv_pos_S: torch.Tensor | None) -> bool:
        """False when the window hides every key of the block from every query: the block is skipped
        (its earliest query is `window` or more positions past its last key)."""
        return not self.window or int(q_pos_S.min()) - int(kv_pos_S.max()) < self.window


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for everything but fp64: the dtype of lse and of merge/gradient accumulators."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def block_mask(
    Sq: int, Sk: int, causal_kind: str, q_doc_BS: torch.Tensor | None, kv_doc_BS: torch.Tensor | None,
    device, *, explicit: bool = False, window: int | None = None, q_pos_S: torch.Tensor | None = None,
    kv_pos_S: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Boolean keep-mask [B or 1, 1, Sq, Sk]; None when the kernel's own flags express it (unless
    `explicit`, for code that applies the mask itself). `window` needs the global positions of the
    block's queries and keys (`q_pos_S`, `kv_pos_S`)."""
    keep = None
    if q_doc_BS is not None:
        keep = (q_doc_BS[:, :, None] == kv_doc_BS[:, None, :]).unsqueeze(1)
    elif explicit or window:
        keep = torch.ones(1, 1, Sq, Sk, dtype=torch.bool, device=device)
    if keep is not None and causal_kind == "causal":
        keep = keep & torch.ones(Sq, Sk, dtype=torch.bool, device=device).tril()
    if window:
        diff = q_pos_S.to(device)[:, None] - kv_pos_S.to(device)[None, :]
        keep = keep & (diff < window)
    return keep


def expand_kv(x_BHSD: torch.Tensor, heads: int) -> torch.Tensor:
    """Repeat K/V heads up to `heads`, locally, for kernels without native GQA."""
    rep = heads // x_BHSD.shape[1]
    return x_BHSD if rep == 1 else x_BHSD.repeat_interleave(rep, dim=1)


def reduce_kv_grad(g_BHSD: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the gradient of expanded K/V heads back onto the K/V heads."""
    B, H, S, D = g_BHSD.shape
    return g_BHSD if H == kv_heads else g_BHSD.reshape(B, kv_heads, H // kv_heads, S, D).sum(2)


def _scores(q_BHSD, k_BHSD, scale: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(scores, tanh of the scaled scores over the cap, or None without a cap)."""
    x_BHSS = torch.matmul(q_BHSD, expand_kv(k_BHSD, q_BHSD.shape[1]).transpose(-1, -2)) * scale
    if not softcap:
        return x_BHSS, None
    t_BHSS = torch.tanh(x_BHSS / softcap)
    return t_BHSS * softcap, t_BHSS


def scores_forward(q_BHSD, k_BHSD, v_BHSD, keep: torch.Tensor, scale: float,
                   softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of one block in the inputs' dtype, differentiable by plain autograd; `keep` the
    explicit mask of `block_mask`."""
    B, H, Sq, _ = q_BHSD.shape
    s_BHSS, _ = _scores(q_BHSD, k_BHSD, scale, softcap)
    keep = keep.expand(B, H, Sq, s_BHSS.shape[-1])
    nonempty_BHS = keep.any(-1)
    s_BHSS = s_BHSS.masked_fill(~keep, -math.inf)
    # Empty rows take their log-sum-exp over zeros instead of -infs: finite, so no NaN gradient.
    lse_raw_BHS = torch.logsumexp(torch.where(nonempty_BHS[..., None], s_BHSS, 0.0), dim=-1)
    p_BHSS = torch.exp(s_BHSS - lse_raw_BHS[..., None])  # exp(-inf - finite) = 0 on masked entries
    out = torch.matmul(p_BHSS, expand_kv(v_BHSD, H))
    return out, torch.where(nonempty_BHS, lse_raw_BHS, -math.inf)


def scores_backward(dout_BHSD, q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, keep: torch.Tensor, scale: float,
                    softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block against the FINAL out and lse (an lse of +inf marks empty rows)."""
    H, Hkv = q_BHSD.shape[1], k_BHSD.shape[1]
    s_BHSS, t_BHSS = _scores(q_BHSD, k_BHSD, scale, softcap)
    p_BHSS = torch.exp(s_BHSS - lse_BHS[..., None].to(s_BHSS.dtype)) * keep
    v = expand_kv(v_BHSD, H)
    dv = torch.matmul(p_BHSS.transpose(-1, -2), dout_BHSD)
    dp_BHSS = torch.matmul(dout_BHSD, v.transpose(-1, -2))
    delta_BHS1 = (dout_BHSD * out_BHSD).sum(-1, keepdim=True)
    ds_BHSS = p_BHSS * (dp_BHSS - delta_BHS1)
    if t_BHSS is not None:
        ds_BHSS = ds_BHSS * (1 - t_BHSS * t_BHSS)
    ds_BHSS = ds_BHSS * scale
    dq = torch.matmul(ds_BHSS, expand_kv(k_BHSD, H))
    dk = torch.matmul(ds_BHSS.transpose(-1, -2), q_BHSD)
    return dq, reduce_kv_grad(dk, Hkv), reduce_kv_grad(dv, Hkv)
