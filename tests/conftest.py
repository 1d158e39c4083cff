"""Session-wide fixtures: one gloo worker pool per world size, and the hypothesis profiles.

Pools live for the whole session because starting torch ranks costs seconds; a failing test only
costs a restart of its pool (well under a second once the fork server is up).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
from ci_subset import SLOW_CASES
from hypothesis import HealthCheck, settings

from meshkit.testing import WorkerPool

# Imported once by the fork server and inherited by every worker, instead of once per rank (the
# Llama modeling import alone costs ~2 s of CPU per process). Only stable third-party modules: the
# fork server dies on anything but ImportError, so code under development must not be listed.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "transformers.models.llama.modeling_llama",
    "peft",
    "pytest",
    "hypothesis",
)

# The per-test wall-clock guard: a run that takes longer kills its pool and fails the test. 300 s, not
# 120: on 2 cores the 8-rank pools of the grown suite made correct runs of 2 minutes (RankTimeout).
TIMEOUT = float(os.environ.get("MESHKIT_TEST_TIMEOUT", "300"))

# "ci" is reproducible: the same examples on every run and machine, none replayed from a local database.
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)

# `@pytest.mark.slow` tests (the big compositions, whole-recipe restarts, the full family matrix) run
# under the long local profile (`make test-all`) or with MESHKIT_SLOW=1; the ci profile keeps `make test`
# within its 15-minute budget on 2 cores with a chosen subset that still covers every module.
RUN_SLOW = PROFILE != "ci" or os.environ.get("MESHKIT_SLOW") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the cases of `ci_subset.SLOW_CASES` slow; skip slow tests under the ci profile."""
    by_id = {item.nodeid: item for item in items}
    for nodeid in SLOW_CASES:
        if nodeid in by_id:
            by_id[nodeid].add_marker(pytest.mark.slow)
    whole_suite = not config.args or [os.path.normpath(a) for a in config.args] == ["tests"]
    missing = [n for n in SLOW_CASES if n not in by_id]
    if whole_suite and not config.option.keyword and not config.option.markexpr and missing:
        raise pytest.UsageError(f"tests/ci_subset.py names tests that no longer exist: {missing}")
    if RUN_SLOW:
        return
    skip = pytest.mark.skip(reason="slow: runs under `make test-all` (HYPOTHESIS_PROFILE=dev) or MESHKIT_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def dist() -> Iterator[Callable[[int], WorkerPool]]:
    """`dist(world_size)`: the session's pool of that many gloo ranks, started on first use."""
    pools: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in pools:
            pools[world_size] = WorkerPool(world_size, timeout=TIMEOUT, preload=PRELOAD)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
