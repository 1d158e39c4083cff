"""A user's own loop gets the recipe's non-finite guard: the same decision on every rank, with limits.

A NaN that appears in one rank's gradient shard must stop (or skip) the step on every rank, or the
ranks part ways at the next collective. `pm.clip_grad_norm_` returns the global norm, identical on
every rank; with `error_if_nonfinite=True` every rank raises before any gradient is scaled, and
`NonFiniteGuard` turns the same global values into the same skip on every rank.
"""

from __future__ import annotations

import math

import pytest
import torch

import meshkit
from meshkit.step.nonfinite import NonFiniteGuard
from meshkit.testing.reference import BatchSpec, ModelSpec

SPEC = ModelSpec()
BATCH = BatchSpec(batch=4, seq=8)


def _nan_on_rank_1(error_if_nonfinite: bool) -> dict:
    """tp=2: one step whose gradient gets a NaN in rank 1's shard only; what each rank then sees."""
    pm = meshkit.parallelize(SPEC.build(device="meta"), meshkit.Plan(tp=2))
    pm.init_weights(0)
    ids, labels = BATCH.make(SPEC.vocab, 0)
    loss = pm.forward_backward(ids, labels)
    sharded = next(p for _, p in pm.named_parameters() if p.grad is not None and p.grad.to_local().numel() < p.numel())
    if torch.distributed.get_rank() == 1:
        sharded.grad.to_local().view(-1)[0] = float("nan")
    before = [p.grad.to_local().clone() for p in pm.parameters()]
    guard = NonFiniteGuard("skip")
    try:
        norm = pm.clip_grad_norm_(1e-3, error_if_nonfinite=error_if_nonfinite)
    except ValueError as err:
        return {"raised": str(err), "untouched": all(torch.allclose(a, p.grad.to_local(), rtol=0, atol=0, equal_nan=True)
                                                     for a, p in zip(before, pm.parameters()))}
    return {"norm": float(norm), "step": guard.allows_step(1, float(loss), float(norm))}


def test_a_nan_in_one_ranks_shard_is_seen_by_every_rank(dist):
    raised = dist(2).run(_nan_on_rank_1, True)
    for seen in raised:
        assert seen["raised"].startswith("the global gradient norm is nan") and seen["untouched"], seen
    skipped = dist(2).run(_nan_on_rank_1, False)
    assert all(math.isnan(seen["norm"]) and seen["step"] is False for seen in skipped), skipped


def test_skipping_has_consecutive_and_total_limits():
    guard = NonFiniteGuard("skip", max_consecutive=2, max_total=3, rank=1)
    nan = float("nan")
    assert [guard.allows_step(s, 1.0, g) for s, g in [(1, nan), (2, nan), (3, 1.0), (4, math.inf)]] == [
        False, False, True, False]  # two in a row are allowed; a finite step resets the run
    with pytest.raises(ValueError, match=r"step 5: non-finite gradient norm .*4 in this launch \(max_total=3\)"):
        guard.allows_step(5, 1.0, nan)
    guard = NonFiniteGuard("skip", max_consecutive=2, max_total=0, rank=1)
    for step in (1, 2):
        assert not guard.allows_step(step, nan, 1.0)
    with pytest.raises(ValueError, match=r"step 3: non-finite loss .*3 in a row \(max_consecutive=2\).*skipped steps: 1, 2, 3"):
        guard.allows_step(3, nan, 1.0)
    unlimited = NonFiniteGuard("skip", max_consecutive=0, max_total=0, rank=1)
    assert not any(unlimited.allows_step(s, nan, nan) for s in range(1, 200))
    assert unlimited.summary().startswith("skipped 199 non-finite step(s): 1, 2, 3")
    with pytest.raises(ValueError, match="step 7: non-finite loss"):
        NonFiniteGuard("error").allows_step(7, math.inf, 1.0)
    with pytest.raises(ValueError, match=r"max_total=-1: must be an integer >= 0"):
        NonFiniteGuard("skip", max_total=-1)
