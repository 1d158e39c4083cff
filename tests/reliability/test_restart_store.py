"""torchrun restarts and its shared rendezvous store (pytorch/pytorch#135712).

torchrun's c10d rendezvous shares one TCPStore with its workers, and in torch 2.5 to 2.13 it keeps
the killed attempt's keys: a restarted rank can read a dead peer's gloo address and fail to connect,
spending a `--max-restarts` (the cause of the flaky restart test in test_faults.py, which now
launches with the opt-out). The probe makes the race certain (the restarted rank 0 starts 3 s late)
and shows both sides: the shared store fails, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` restarts cleanly.
Should a torch release fix it, the first assertion fails and the opt-out can go.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.recipe_run import ROOT, preflight

PROBE = Path(__file__).resolve().parent / "restart_probe.py"


def _launch(disable_sharing: bool, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1" if disable_sharing else "0"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "--monitor-interval", "0.2", str(PROBE)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow  # four torchrun attempts: about a minute on 2 cores
def test_a_restart_reads_the_killed_attempts_address_unless_sharing_is_off(tmp_path):
    shared = _launch(False, tmp_path)
    assert shared.returncode != 0 and "Connection refused" in shared.stdout + shared.stderr, shared.stderr[-3000:]
    fresh = _launch(True, tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert sorted(line for line in fresh.stdout.splitlines() if "group formed" in line) == [
        "attempt 1 rank 0: group formed", "attempt 1 rank 1: group formed"]


def test_the_recipe_warns_exactly_when_a_restart_would_share_the_store():
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    warning = preflight.restart_store_warning(shared)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in warning and "135712" in warning
    assert preflight.restart_store_warning({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert preflight.restart_store_warning({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert preflight.restart_store_warning({}) is None  # plain python, no torchrun
