"""The next token from one decoding step's logits, shaped as Hugging Face's `generate` shapes them.

The steps and their order are HF's (`GenerationMixin._get_logits_processor`), so a generation
config means the same thing here as there:

1. repetition penalty, on the raw logits, greedy or not: every token already in the row (prompt
   included, left padding not) has a positive logit divided by the penalty and a negative one
   multiplied by it;
2. when sampling: temperature (scores / T), top-k (every token whose score reaches the k-th
   largest, ties included), top-p (the most likely tokens whose probability mass, summed from the
   least likely upward, stays above 1 - p are dropped; the most likely token always stays).

Greedy takes the argmax. A sample is argmax(scores + Gumbel noise), the noise drawn in float64 from
a CPU generator seeded by the caller: an exact draw from softmax(scores), the same for the same seed
on any plan and device (HF draws with `torch.multinomial`, so single draws are not comparable; the
shaped scores are, and the tests compare those).
"""

from __future__ import annotations

import torch

__all__ = ["choose", "penalize_repetition", "shape_scores"]


def penalize_repetition(scores_BV: torch.Tensor, tokens_BT: torch.Tensor, valid_BT: torch.Tensor,
                        penalty: float) -> torch.Tensor:
    """`scores_BV` with every token of `tokens_BT` (where `valid_BT`) penalized; penalty 1 changes nothing."""
    if penalty == 1.0:
        return scores_BV
    vocab = scores_BV.shape[-1]
    index_BT = tokens_BT.masked_fill(~valid_BT, vocab)  # padding lands in a spare column, dropped below
    seen_BV = torch.zeros(scores_BV.shape[0], vocab + 1, dtype=torch.bool, device=scores_BV.device)
    seen_BV.scatter_(1, index_BT, True)
    penalized = torch.where(scores_BV < 0, scores_BV * penalty, scores_BV / penalty)
    return torch.where(seen_BV[:, :vocab], penalized, scores_BV)


def shape_scores(scores_BV: torch.Tensor, *, temperature: float, top_k: int | None, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p, on fp32 scores; dropped tokens get -inf."""
    scores_BV = scores_BV / temperature if temperature != 1.0 else scores_BV
    if top_k:
        kth_B1 = torch.topk(scores_BV, min(top_k, scores_BV.shape[-1]), dim=-1).values[:, -1:]
        scores_BV = scores_BV.masked_fill(scores_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scores_BV, dim=-1)
        mass_below = ascending.softmax(dim=-1).cumsum(dim=-1)  # probability of this token and every less likely one
        drop_sorted = mass_below <= 1 - top_p
        drop_sorted[:, -1] = False  # the most likely token always stays
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scores_BV = scores_BV.masked_fill(drop, float("-inf"))
    return scores_BV


def choose(logits_BV: torch.Tensor, *, do_sample: bool, temperature: float = 1.0, top_k: int | None = None,
           top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of every row [B]: the argmax, or one draw from the shaped distribution."""
    scores = logits_BV.float()
    if not do_sample:
        return scores.argmax(-1)
    scores = shape_scores(scores, temperature=temperature, top_k=top_k, top_p=top_p)
    uniform = torch.rand(scores.shape, generator=generator, dtype=torch.float64).clamp_(1e-20, 1.0 - 1e-16)
    gumbel = -torch.log(-torch.log(uniform))
    return (scores + gumbel.to(scores.device, scores.dtype)).argmax(-1)
