"""Faults a cluster inflicts: a stopped rank is named by its peers; a killed rank under torchrun
restarts and the run finishes exactly as if nothing had happened.

The restart test is the one test here that launches `torchrun` (slow to start): the recipe trains a
tiny Llama on 2 CPU ranks with the documented restart command (`--max-restarts`, `--resume auto`,
static or c10d rendezvous, no environment variable); once the step-3 checkpoint is published the
test SIGKILLs one worker, torchrun restarts the group, the same command resumes from the newest
complete checkpoint, and the final loss (TensorBoard's scalar) and every parameter and optimizer
tensor of the final checkpoint equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
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
from tests.reliability.recipe_run import (
    ROOT,
    checkpoint_tensors,
    finish,
    recipe_toml,
    rendezvous_flags,
    start_torchrun,
    torchrun_env,
    train_in_pool,
)

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


@pytest.mark.slow  # two torchrun attempts of the recipe: minutes on 2 cores
@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_killed_rank_restarts_and_finishes_bit_identically(dist, tmp_path, rendezvous):
    """The documented restart command as a user copies it (no TORCH_DISABLE_SHARE_RDZV_TCP_STORE),
    under torchrun's default static rendezvous and under c10d; only the port is the test's own."""
    config = tmp_path / "tiny.toml"
    config.write_text(recipe_toml("dp_shard = -1", save_every=3))
    ref_dir, ref_logs = tmp_path / "reference", tmp_path / "reference-runs"
    reference = dist(2).run(train_in_pool, str(config), str(ref_dir), str(ref_logs))[0]

    save_dir, logs = tmp_path / "ckpt", tmp_path / "runs"
    launcher = start_torchrun(
        ["--nproc-per-node", "2", "--max-restarts", "1", *rendezvous_flags(rendezvous), "--monitor-interval", "0.2",
         str(ROOT / "recipes" / "train_llama.py"), "--config", str(config), "--save-dir", str(save_dir),
         "--log-dir", str(logs), "--save-every", "3", "--resume", "auto", "--keep-last", "3", "--async-save"],
        torchrun_env(), tmp_path)
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
    finally:
        code, output = finish(launcher, timeout=400)
    assert killed is not None, "the run ended before a worker could be killed:\n" + (output or "")[-3000:]
    assert code == 0, output[-4000:]
    assert "meshkit: resumed from" in output and f"{save_dir}/step-0000000" in output, output[-4000:]
    assert output.count("meshkit: collective timeout 120 s, heartbeat 30 s") == 2  # [train] timeout_s, per launch

    assert _final_loss(logs) == _final_loss(ref_logs) == reference["last_loss"]
    ours = checkpoint_tensors(save_dir / "step-00000009", tmp_path / "ours.pt")
    theirs = checkpoint_tensors(ref_dir / "step-00000009", tmp_path / "theirs.pt")
    assert ours.keys() == theirs.keys() and len(ours) > 0
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert meshkit.state.checkpoint.verify(save_dir / "step-00000009") == []


# ------------------------------------------------------------------------------------ a full disk


@pytest.mark.slow  # a torchrun launch of the recipe
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) to mount a private tmpfs")
def test_a_really_full_disk_stops_the_run_once_and_keeps_earlier_checkpoints(tmp_path):
    """The save directory is a 2.5 MB tmpfs in a private mount namespace (the kernel's own ENOSPC, no
    injection): steps 3 and 6 fit (about 1.1 MB each), step 9 does not. The run stops with the cause
    said once, no DCP traceback, no `.partial` left, and both earlier checkpoints verify."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {probe.stderr.strip()}")
    config, disk, kept = tmp_path / "tiny.toml", tmp_path / "disk", tmp_path / "kept"
    config.write_text(recipe_toml("dp_shard = -1", save_every=3))
    disk.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *rendezvous_flags("static"),
                str(ROOT / "recipes" / "train_llama.py"), "--config", str(config), "--save-dir", str(disk),
                "--log-dir", str(tmp_path / "runs")]
    script = (f"mount -t tmpfs -o size=3500k tmpfs {disk} && {shlex.join(torchrun)}; code=$?; "
              f"cp -a {disk} {kept}; exit $code")
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], env=torchrun_env(), capture_output=True, text=True,
                          timeout=400, start_new_session=True)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    assert output.count("No space left on device") == 1, output[-6000:]
    # Named from the errno, or (torch.save's writer reports a full disk without one) from the free space.
    said = re.search(rf"error: checkpoint {re.escape(str(disk / 'step-00000009'))} was not saved: No space left on "
                     rf"device \((errno 28|0 bytes free on the filesystem of {re.escape(str(disk))};.*)\) on rank",
                     output)
    assert said, output[-6000:]
    assert "CheckpointException" not in output and 'train_llama.py", line' not in output  # no worker traceback
    assert sorted(p.name for p in kept.iterdir() if p.name != ".meshkit-lock") == ["step-00000003", "step-00000006"]
    for step in ("step-00000003", "step-00000006"):
        assert meshkit.state.checkpoint.verify(kept / step) == []
