"""Test support for multi-rank code: a session-long pool of gloo ranks on one machine.

Kept out of `tests/` so that recipes and benchmarks can reuse it, and importable without pytest.
"""

from meshkit.testing.pool import Outcome, RankFailure, RankTimeout, WorkerPool

__all__ = ["Outcome", "RankFailure", "RankTimeout", "WorkerPool"]
