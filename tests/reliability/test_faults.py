"""Faults a cluster inflicts: a stopped rank is named by its peers; a killed rank under torchrun
restarts and the run finishes exactly as if nothing had happened.

The restart test is the one test here that launches `torchrun` (slow to start): the recipe trains a
tiny Llama on 2 CPU ranks with `--resume auto` and `--max-restarts 1`; once the step-3 checkpoint is
published the test SIGKILLs one worker, torchrun restarts the group, the same command resumes from
the newest complete checkpoint, and the final loss (TensorBoard's scalar) and every parameter and
optimizer tensor of the final checkpoint equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import meshkit
from meshkit import heartbeat
from meshkit._compat.collectives import default_store
from tests.reliability.recipe_run import ROOT, checkpoint_tensors, recipe_toml, train_in_pool

# --------------------------------------------------------------------------------------- heartbeat


def _stop_a_peer(namespace: str, timeout_s: float) -> list[str]:
    """Rank 0 SIGSTOPs rank 1, waits until every other rank's heartbeat has named it (each says so in
    the store), then SIGCONTs it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    pids: list[int | None] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    heard: list[str] = []
    said = dist.PrefixStore(f"heard/{namespace}/", default_store())

    def on_silent(silent: list[heartbeat.Silent]) -> None:
        heard.extend(s.message(rank) for s in silent)
        said.set(str(rank), "named")

    beat = heartbeat.start_for_process_group(timeout_s, on_silent, namespace=namespace, interval_s=0.05)
    beat.progress(7)
    dist.barrier()
    if rank == 0:
        time.sleep(0.3)  # rank 1 is beating
        assert not heard, heard
        os.kill(pids[1], signal.SIGSTOP)
        try:  # polled: a blocking store.wait would hold the store client the heartbeat threads share
            keys, deadline = [str(r) for r in range(world) if r != 1], time.monotonic() + 60
            while not said.check(keys) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            os.kill(pids[1], signal.SIGCONT)
    dist.barrier()  # rank 1 sits here, stopped, until rank 0 continues it
    beat.stop()
    return heard


def test_a_stopped_rank_is_named_by_every_peer(dist):
    """4 ranks: each of the three that keep running names the stopped one, with its last step."""
    heard = dist(4).run(_stop_a_peer, uuid.uuid4().hex, 1.0)
    for rank in (0, 2, 3):
        assert len(heard[rank]) == 1, (rank, heard[rank])
        assert heard[rank][0].startswith("meshkit: heartbeat: rank 1 has not been heard from for"), heard[rank]
        assert "its last beat was at step 7" in heard[rank][0]
    assert heard[1] == []  # the stopped rank, continued, does not blame the peers that kept beating


# ------------------------------------------------------------------------------ torchrun restarts

def _final_loss(log_dir: Path) -> float:
    values = {}
    for events in sorted((log_dir / "run").glob("events.*")):  # one file per launch, in launch order
        acc = EventAccumulator(str(events))
        acc.Reload()
        values.update({e.step: e.value for e in acc.Scalars("train/loss")})
    return values[max(values)]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


@pytest.mark.slow  # two torchrun launches of the recipe: minutes on 2 cores
def test_killed_rank_restarts_and_finishes_bit_identically(dist, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(recipe_toml("dp_shard = -1", save_every=3, resume="auto"))
    ref_dir, ref_logs = tmp_path / "reference", tmp_path / "reference-runs"
    reference = dist(2).run(train_in_pool, str(config), str(ref_dir), str(ref_logs))[0]

    save_dir, logs = tmp_path / "ckpt", tmp_path / "runs"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", "--monitor-interval", "0.2", str(ROOT / "recipes" / "train_llama.py"),
               "--config", str(config), "--save-dir", str(save_dir), "--log-dir", str(logs)]
    # A store per attempt: torchrun's shared store keeps the killed attempt's gloo addresses, and a
    # restarted rank could connect to a dead peer (recipes/preflight.restart_store_warning).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    launcher = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    killed = None
    try:
        deadline = time.monotonic() + 240
        while killed is None and time.monotonic() < deadline and launcher.poll() is None:
            if (save_dir / "step-00000003").is_dir():
                workers = _children(launcher.pid)
                if workers:
                    killed = workers[-1]
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.02)
        output, _ = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert killed is not None, "the run ended before a worker could be killed:\n" + (output or "")[-3000:]
    assert launcher.returncode == 0, output[-4000:]
    assert "meshkit: resumed from" in output and f"{save_dir}/step-0000000" in output, output[-4000:]
    assert output.count("meshkit: collective timeout 120 s, heartbeat 30 s") == 2  # [train] timeout_s, per launch
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in output  # no warning: each attempt has its own store

    assert _final_loss(logs) == _final_loss(ref_logs) == reference["last_loss"]
    ours = checkpoint_tensors(save_dir / "step-00000009", tmp_path / "ours.pt")
    theirs = checkpoint_tensors(ref_dir / "step-00000009", tmp_path / "theirs.pt")
    assert ours.keys() == theirs.keys() and len(ours) > 0
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert meshkit.state.checkpoint.verify(save_dir / "step-00000009") == []
