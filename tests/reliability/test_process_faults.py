"""Faults that only real processes show: the recipe killed with SIGKILL while a checkpoint is half
written, a rank stopped with SIGSTOP, a rank hung while its peers wait in a collective.

The recipe runs as real processes (`tests/reliability/faulty_recipe.py`, which injects the fault),
started the way torchrun starts workers but without its agent: the test hosts the rendezvous store
(`TORCHELASTIC_USE_AGENT_STORE`), so a short collective timeout cannot fail the rendezvous of ranks
that import torch at different speeds on a loaded machine. Each run waits on its processes with a
bound, so a hang fails the test instead of hanging it. Process start-up dominates (tens of seconds on
2 cores): the tests are `slow`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

import meshkit
from tests.reliability.recipe_run import ROOT, checkpoint_tensors, recipe_toml, train_in_pool, train_llama

FAULTY = ROOT / "tests" / "reliability" / "faulty_recipe.py"

pytestmark = pytest.mark.slow

class Job:
    """`nproc` recipe processes with one fault injected; each rank's output goes to `rank<r>.log`."""

    def __init__(self, tmp: Path, config: Path, nproc: int, fault: str, *args: str):
        self.tmp = tmp
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
        self.procs = []
        for rank in range(nproc):
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                   "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                   "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.store.port),
                   "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
                   "MESHKIT_TEST_FAULT": fault}
            log = open(tmp / f"rank{rank}.log", "w")  # noqa: SIM115 - closed in finish()
            self.procs.append((subprocess.Popen([sys.executable, str(FAULTY), "--config", str(config), *args],
                                                cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT), log))

    def wait_for(self, ready, what: str, limit: float = 240) -> None:
        """Poll `ready()` until true; fail (with the logs) if a rank ends first or `limit` passes."""
        deadline = time.monotonic() + limit
        while not ready():
            ended = [r for r, (p, _) in enumerate(self.procs) if p.poll() is not None]
            if ended or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{what}: not reached (ranks ended: {ended})\n{self.logs()}")
            time.sleep(0.05)

    def returncodes(self, limit: float) -> list[int | None]:
        """Each rank's exit status, waiting at most `limit` seconds in all (None: still running, killed)."""
        deadline = time.monotonic() + limit
        codes = []
        for p, _ in self.procs:
            try:
                codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.kill()
        return codes

    def kill(self) -> None:
        for p, log in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
            log.close()

    def log(self, rank: int) -> str:
        return (self.tmp / f"rank{rank}.log").read_text()

    def logs(self) -> str:
        return "\n".join(f"--- rank {r}\n{self.log(r)[-3000:]}" for r in range(len(self.procs)))


# ------------------------------------------------------------------------------ killed during a save


def test_killed_during_a_save_resumes_from_the_previous_checkpoint_bit_identically(dist, tmp_path):
    """SIGKILL of the whole job while step 6's checkpoint is half written (every shard on disk, DCP's
    metadata not yet): step 6 never appears, `latest` picks step 3 without a warning, and
    `--resume auto` trains on to the same final loss and tensors as an uninterrupted run."""
    config = tmp_path / "tiny.toml"
    config.write_text(recipe_toml("dp_shard = -1", save_every=3, resume="auto"))
    save_dir, marker = tmp_path / "ckpt", tmp_path / "paused"
    job = Job(tmp_path, config, 2, f"pause-save:6:{marker}", "--save-dir", str(save_dir),
              "--log-dir", str(tmp_path / "runs"))
    job.wait_for(marker.exists, "the save of step 6")
    partial = save_dir / ".step-00000006.partial"
    job.wait_for(lambda: len(list(partial.glob("*.distcp"))) == 2, "both ranks' shards of step 6")
    job.kill()  # SIGKILL, every rank: the job dies inside the save

    assert sorted(p.name for p in save_dir.iterdir() if not p.name.startswith(".")) == ["step-00000003"]
    assert not (partial / ".metadata").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the half-written save is hidden, not a damaged checkpoint to warn about
        assert meshkit.state.checkpoint.latest(save_dir) == str(save_dir / "step-00000003")

    resumed = dist(2).run(train_in_pool, str(config), str(save_dir), str(tmp_path / "runs"))[0]
    reference = dist(2).run(train_in_pool, str(config), str(tmp_path / "reference"), str(tmp_path / "ref-runs"))[0]
    assert resumed["first_loss"] != reference["first_loss"]  # it resumed at step 4, not from scratch
    assert resumed["last_loss"] == reference["last_loss"]
    ours = checkpoint_tensors(save_dir / "step-00000009", tmp_path / "ours.pt")
    theirs = checkpoint_tensors(tmp_path / "reference" / "step-00000009", tmp_path / "theirs.pt")
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert meshkit.state.checkpoint.verify(save_dir / "step-00000006") == []  # redone over the leftover


# ------------------------------------------------------------------------- stopped and hung ranks


def test_a_stopped_rank_ends_its_peer_with_exit_3(tmp_path):
    """The recipe's heartbeat path end to end: rank 1 is SIGSTOPped mid-training; rank 0, waiting for
    it in a collective, names it (with its last step) within `heartbeat_s` (10 s: a shorter one names
    ranks merely starved of CPU on a loaded 2-core machine) and exits with status 3,
    the documented code torchrun ends or restarts the job on."""
    config = tmp_path / "tiny.toml"
    config.write_text(recipe_toml("dp_shard = -1", steps=300, heartbeat_s=10))
    job = Job(tmp_path, config, 2, "none", "--log-dir", str(tmp_path / "runs"))
    # 20 steps: the heartbeat beats every heartbeat_s / 10 = 1 s, so rank 1 has reported a step by then
    job.wait_for(lambda: re.search(r"step +20/", job.log(0)), "step 20")
    job.procs[1][0].send_signal(signal.SIGSTOP)
    try:
        code = job.procs[0][0].wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = None
    job.kill()  # rank 1: continued, then killed
    assert code == train_llama.EXIT_SILENT_RANK, job.logs()
    assert "meshkit: heartbeat: rank 1 has not been heard from for" in job.log(0), job.logs()
    assert re.search(r"its last beat was at step \d+", job.log(0)), job.logs()


def test_a_rank_hung_outside_a_collective_ends_every_rank(tmp_path):
    """Rank 0 hangs, alive, before its second gradient clipping (tp=2 x dp_shard=2): ranks 1-3 wait for
    it in collectives on the mesh's axes and each fails within `timeout_s` (4 s) instead of torch's
    30 min default for groups made without a timeout; rank 0's heartbeat then names the ranks that
    ended and exits 3. No rank is left running."""
    config = tmp_path / "tiny.toml"
    config.write_text(recipe_toml("tp = 2\ndp_shard = 2", steps=300, heartbeat_s=10, timeout_s=4))
    marker = tmp_path / "hung"
    job = Job(tmp_path, config, 4, f"hang:0:clip_grad_norm_:2:{marker}", "--log-dir", str(tmp_path / "runs"))
    job.wait_for(marker.exists, "rank 0's hang")
    codes = job.returncodes(limit=90)
    assert None not in codes, f"ranks still running 90 s after the hang: {codes}\n{job.logs()}"
    assert codes[0] == train_llama.EXIT_SILENT_RANK, job.logs()
    assert "meshkit: heartbeat: rank" in job.log(0)
    for rank in (1, 2, 3):
        assert codes[rank] not in (0, None), job.logs()
        log = job.log(rank)
        assert "Timed out waiting 4000ms" in log or "Connection closed by peer" in log, job.logs()
    assert any("Timed out waiting 4000ms" in job.log(r) for r in (1, 2, 3)), job.logs()
