"""A finished world ends cleanly: nothing of meshkit's, and no gloo group, outlives the interpreter.

~1 in 12 finished worlds used to abort at exit ("terminate called without an active exception",
SIGABRT on one rank, torchrun rc=1): a thread that needs the GIL while CPython finalizes (a
heartbeat in a store call, a loader's prefetch thread in a torch op, a gloo worker freeing the
last reference to a collective's tensors) is ended by CPython inside a C++ frame. meshkit now
stops its threads and destroys the gloo process groups at exit (`meshkit.mesh.close_at_exit`), so
the script in short_world.py, which leaves all of them running, exits with rc 0 every time and
reports, from the last exit handler before finalization, that they are gone. Under tp=2 its SP
collectives are point-to-point messages on gloo (`tensor_parallel.pairwise`), which must end as cleanly.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORLD = Path(__file__).resolve().parent / "short_world.py"


def _world(tmp_path: Path, plan: str = "dp_shard=-1") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "SHORT_WORLD_PLAN": plan}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORLD)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _check(run: subprocess.CompletedProcess, index: int) -> None:
    output = run.stdout + run.stderr
    assert run.returncode == 0 and "terminate called" not in output, f"world {index}: rc {run.returncode}\n{output[-3000:]}"
    states = sorted(re.findall(r"at exit rank (\d): (.*)", run.stdout))
    assert states == [(r, "process group gone, meshkit threads []") for r in ("0", "1")], (index, states, output[-2000:])


@pytest.mark.parametrize("plan", ["dp_shard=-1", "tp=2"])
def test_a_short_world_leaves_nothing_running_at_exit(tmp_path, plan):
    _check(_world(tmp_path, plan), 0)


@pytest.mark.slow  # 24 torchrun worlds: several minutes on 2 cores
def test_many_short_worlds_all_exit_cleanly(tmp_path):
    for index in range(24):
        folder = tmp_path / str(index)
        folder.mkdir()
        _check(_world(folder, "tp=2" if index % 3 == 2 else "dp_shard=-1"), index)
