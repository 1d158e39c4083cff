"""Assertions shared by the sharded-vs-single-device tests (fixed fp32 tolerances, any rank count)."""

from __future__ import annotations

import os

from hypothesis import settings

CI_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci"


def examples(ci: int) -> settings:
    """Settings for a property test whose every example costs seconds of multi-rank work: `ci` examples
    under the ci profile (derandomized: the same ones on every run), the loaded profile's count otherwise."""
    return settings(max_examples=ci) if CI_PROFILE else settings()

LOSS_TOL = 1e-5
GRAD_TOL = 2e-6      # absolute, on gradients of order 1e-1
NORM_TOL = 1e-5
PARAM_TOL = 2e-5     # after two AdamW steps at lr=1e-3, eps=1e-5 (see reference.ADAM_EPS); a real error shows at ~lr


def assert_matches_reference(results: list[dict], context: str) -> None:
    """Check every rank's `Comparison` (as a dict) against the tolerances above."""
    for rank, r in enumerate(results):
        where = f"{context}, rank {rank}"
        assert not r["missing_grads"], f"{where}: parameters without gradients: {r['missing_grads']}"
        assert not r["frozen_mismatch"], f"{where}: frozen/trainable differ from the reference: {r['frozen_mismatch']}"
        assert max(r["loss"]) <= LOSS_TOL, f"{where}: loss differs by {r['loss']} (reference {r['ref_loss']})"
        assert r["grad"] <= GRAD_TOL, f"{where}: gradient differs by {r['grad']:.3g} (scale {r['grad_scale']:.3g})"
        assert r["grad_norm"] <= NORM_TOL, f"{where}: clipped grad norm differs by {r['grad_norm']:.3g}"
        assert r["param"] <= PARAM_TOL, f"{where}: parameters differ by {r['param']:.3g} after two steps"
