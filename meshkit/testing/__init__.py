"""Test support for multi-rank code: a session-long pool of gloo ranks on one machine.

Kept out of `tests/` and importable without pytest so that the benchmarks reuse it: every benchmark
starts its ranks through this pool (`benchmarks/launch.py`). `reference` holds the sharded-vs-
single-device comparison the property tests run.
"""

from meshkit.testing.pool import Outcome, RankFailure, RankTimeout, WorkerPool

__all__ = ["Outcome", "RankFailure", "RankTimeout", "WorkerPool"]
