"""The recipe never loses a run: strict configs, pre-flight, non-finite steps, the save-dir policy.

Config holes go through the real command line (`main`: exit status 2 and a message, no traceback);
the training scenarios run the recipe's `train` on 2 gloo ranks with a tiny model, and compare the
losses of resumed runs with the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

import meshkit
from meshkit.state import checkpoint, manifest
from meshkit.state.atomic import CheckpointWriteError

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "recipes") not in sys.path:
    sys.path.insert(0, str(ROOT / "recipes"))  # as `python recipes/train_llama.py` sees its siblings
train_llama = importlib.import_module("train_llama")
train_config = importlib.import_module("train_config")
preflight = importlib.import_module("preflight")
checkpointing = importlib.import_module("checkpointing")
save_lock = importlib.import_module("save_lock")

TINY_MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64}
TINY_TOML = "[model]\n" + "".join(f"{k} = {v}\n" for k, v in TINY_MODEL.items())


# ------------------------------------------------------------------------ config holes (one process)


@pytest.mark.parametrize(("table", "expected"), [
    ('[train]\nsteps = "6"', "[train] steps='6': must be an integer"),
    ('[train]\nweight_decay = "lots"', "[train] weight_decay='lots': must be a number"),
    ("[train]\nsave_every = -1", "[train] save_every=-1: must be >= 0"),
    ("[train]\nlr = inf", "[train] lr=inf: must be a finite number"),
    ('[train]\non_nonfinite = "ignore"', "[train] on_nonfinite='ignore': must be one of error, skip"),
    ("[train]\nprofile = 1", "[train] profile=1: must be true or false"),
    ("[data]\nbranching = 0", "[data] branching=0: must be >= 1"),
    ("hiden_size = 48", "[model] hiden_size: not a field of LlamaConfig (llama); did you mean 'hidden_size'?"),
], ids=["steps-str", "weight-decay-str", "save-every-negative", "lr-inf", "on-nonfinite", "bool", "branching",
        "model-typo"])
def test_config_holes_exit_2_with_a_message(tmp_path, capsys, table, expected):
    preset = tmp_path / "bad.toml"
    preset.write_text(TINY_TOML + table + "\n")
    assert train_llama.main(["--config", str(preset), "--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: the configuration has problems" in err and expected in err, err
    assert "Traceback" not in err


def test_missing_config_file_is_the_documented_exit_2(tmp_path, capsys):
    assert train_llama.main(["--config", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err
    assert f"error: --config {tmp_path / 'missing.toml'}: no such file" in err and "Traceback" not in err


def test_known_model_keys_and_presets_pass():
    """Aliases HF consumes (rope_theta) are fields too: every shipped preset passes the key check."""
    for preset in sorted((ROOT / "recipes" / "configs").glob("*.toml")):
        run = train_config.load_config(str(preset))
        config, _, _ = train_config.build_model_config(run.model)
        assert preflight.model_key_problems(run.model, config) == [], preset.name
        assert preflight.field_problems(run.train, "train") == [] and preflight.field_problems(run.data, "data") == []


def test_shapes_are_checked_against_the_plan():
    config, _, _ = train_config.build_model_config(dict(TINY_MODEL))
    run = train_config.RunConfig(model=dict(TINY_MODEL), plan=meshkit.Plan(cp=2, dp_shard=2),
                                 train=train_config.TrainConfig(seq_len=6))
    with pytest.raises(ValueError, match="seq_len"):
        preflight.check_config(run, config, world=4)
    run = train_config.RunConfig(model=dict(TINY_MODEL), plan=meshkit.Plan(pp=2, dp_shard=2),
                                 train=train_config.TrainConfig(local_batch=3))
    with pytest.raises(ValueError, match=r"local_batch=3: the plan splits each batch into 2 pipeline microbatches"):
        preflight.check_config(run, config, world=4)


def test_preflight_lists_plan_data_and_position_problems_flat_with_fixes():
    """Synthetic data too: seq_len past max_position_embeddings is refused (the store loader already did),
    each plan violation is its own "[plan]" line, and a store given to a synthetic preset names the flag."""
    config, _, _ = train_config.build_model_config(dict(TINY_MODEL))
    limit = config.max_position_embeddings
    run = train_config.RunConfig(model=dict(TINY_MODEL), plan=meshkit.Plan(tp=3),
                                 train=train_config.TrainConfig(seq_len=2 * limit),
                                 data=train_config.DataConfig(synthetic=True, path="runs/data/mine"))
    with pytest.raises(ValueError) as caught:
        preflight.check_config(run, config, world=4)
    lines = str(caught.value).splitlines()
    assert "  - [data] synthetic = true with path = 'runs/data/mine'" in "\n".join(lines)
    assert "fix: add --no-synthetic" in str(caught.value)
    run = dataclasses.replace(run, data=train_config.DataConfig())
    with pytest.raises(ValueError) as caught:
        preflight.check_config(run, config, world=4)
    lines = str(caught.value).splitlines()
    assert lines[1] == (f"  - [train] seq_len={2 * limit}: above the model's max_position_embeddings={limit} (positions "
                        f"past it extrapolate the rotary embedding silently); fix: --seq-len {limit} or less, or "
                        f"--model-set max_position_embeddings={2 * limit}")
    assert lines[2].startswith("  - [plan] world_size=4: the plan needs") and "Plan is invalid" not in lines[2]
    assert any(line.startswith("  - [plan] tp=3:") for line in lines[3:]), lines


def test_save_dir_probe_and_free_space(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert "is not writable" in preflight.save_dir_problem(str(blocker / "ckpt"), None)
    assert "GiB free, one checkpoint needs about" in preflight.save_dir_problem(str(tmp_path / "ok"), 10**18)
    assert preflight.save_dir_problem(str(tmp_path / "ok"), 1) is None
    assert list((tmp_path / "ok").iterdir()) == []  # the probe file is gone
    config, _, _ = train_config.build_model_config(dict(TINY_MODEL))
    params = sum(math.prod(s) for s in ([64, 32], [64, 32]))  # embedding and head alone
    assert preflight.checkpoint_bytes(config) > 12 * params


# --------------------------------------------------------------------------- training (2 gloo ranks)


def _train(settings: dict) -> dict:
    cfg = train_config.TrainConfig(**{"steps": 4, "seq_len": 16, "local_batch": 2, "lr": 0.01, "warmup_steps": 1,
                                      "threads": 1, "log_every": 100, "name": "t", **settings})
    run = train_config.RunConfig(model=dict(TINY_MODEL), plan=meshkit.Plan(dp_shard=-1), train=cfg, source="tiny")
    return train_llama.train(run)


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_save_dir_policy_resume_auto_load_step_keep_last(dist, tmp_path):
    pool = dist(2)
    root = tmp_path / "ckpt"
    base = {"save_dir": str(root), "log_dir": str(tmp_path / "runs"), "save_every": 2, "resume": "auto"}
    first = pool.run(_train, base)[0]  # the first launch: nothing to resume, a fresh run
    assert _steps(root) == ["step-00000002", "step-00000004"]
    run_id = manifest.read(root / "step-00000004")["run_id"]
    assert first["run_id"] == run_id

    # A new run (no resume) into a directory holding this run's checkpoints is refused, and so is
    # resuming step 2 where it would save over step 4 of the same run (rank 0's decision, broadcast).
    cfg = train_config.TrainConfig(**base)
    assert "holds checkpoints of another run" in checkpointing.decide(replace(cfg, resume="")).error
    assert "newer checkpoints of the resumed run" in checkpointing.decide(replace(cfg, load_step=2)).error
    assert "no verifying checkpoint of that step" in checkpointing.decide(replace(cfg, load_step=3)).error
    for o in pool.run_raw(_train, {**base, "resume": ""}):  # the refusal reaches every rank before training
        assert o.exc_type == "ValueError" and "holds checkpoints of another run" in o.message, o.message
    # With --overwrite: step 4 goes, step 2 resumes and steps 3-4 come out as before, this time saved
    # in the background (async_save), and keep_last=1 deletes step 2 once the new step 4 is complete.
    again = pool.run(_train, {**base, "load_step": 2, "overwrite": True, "keep_last": 1, "async_save": True})[0]
    assert again["last_loss"] == first["last_loss"] and again["run_id"] == run_id
    assert _steps(root) == ["step-00000004"]
    assert checkpoint.verify(root / "step-00000004") == []

    # Checkpoints exist but none verifies: --resume auto refuses to start over them, --overwrite does.
    shard = root / "step-00000004" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert "none verifies (skipping checkpoint" in checkpointing.decide(cfg).error
    fresh = checkpointing.decide(replace(cfg, overwrite=True))
    assert fresh.path is None and fresh.error is None and fresh.delete == [str(root / "step-00000004")]

def test_a_damaged_newest_checkpoint_never_blocks_resume_auto(dist, tmp_path):
    """A restart after the newest checkpoint was damaged (a truncated shard): `--resume auto` resumes
    from the older one, moves the damaged one aside (kept, renamed `.damaged`) instead of refusing it
    as a newer checkpoint of the run, saves that step again and ends exactly where an undamaged run
    ends. A checkpoint whose manifest no longer reads (run unknown) is moved aside the same way."""
    pool = dist(2)
    root = tmp_path / "ckpt"
    base = {"save_dir": str(root), "log_dir": str(tmp_path / "runs"), "save_every": 2, "resume": "auto"}
    first = pool.run(_train, base)[0]
    shard = root / "step-00000004" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    (root / "step-00000000").mkdir()  # an older step whose manifest is gone (step 0: no save makes it)
    (root / "step-00000000" / "manifest.json").write_text("{trunc")
    again = pool.run_raw(_train, base)
    assert all(o.ok for o in again), [o.message for o in again]
    assert again[0].value["last_loss"] == first["last_loss"] and again[0].value["run_id"] == first["run_id"]
    assert again[0].value["first_loss"] != first["first_loss"]  # resumed at step 3
    assert "moved the damaged checkpoint" in again[0].output and "step-00000004.damaged" in again[0].output
    assert _steps(root) == ["step-00000000.damaged", "step-00000002", "step-00000004", "step-00000004.damaged"]
    assert checkpoint.verify(root / "step-00000004") == []
    assert (root / "step-00000004.damaged" / "__1_0.distcp").stat().st_size == 100  # kept as it was found


def test_non_finite_step_stops_or_is_skipped_and_never_saved(dist, tmp_path):
    pool = dist(2)
    common = {"log_dir": str(tmp_path / "runs"), "save_every": 1, "lr": 1e30}  # step 1 blows the weights up
    for o in pool.run_raw(_train, {**common, "save_dir": str(tmp_path / "error")}):
        assert o.exc_type == "ValueError" and o.message.startswith("step 2: non-finite gradient norm"), o.message
    assert _steps(tmp_path / "error") == ["step-00000001"]
    skipped = pool.run_raw(_train, {**common, "save_dir": str(tmp_path / "skip"), "on_nonfinite": "skip"})
    assert skipped[0].value["skipped_steps"] == [2, 3, 4]
    assert "skipped 3 non-finite step(s): 2, 3, 4 |" in skipped[0].output  # the closing summary line
    for path in sorted((tmp_path / "skip").iterdir()):  # finite (save refuses anything else) and verified
        assert checkpoint.verify(path) == [], path
    # Skipping has limits: a third non-finite step in a row stops the run on every rank, naming the limit.
    limited = {**common, "save_dir": str(tmp_path / "limit"), "on_nonfinite": "skip", "nonfinite_max_consecutive": 2}
    for o in pool.run_raw(_train, limited):
        assert o.exc_type == "ValueError" and o.message.startswith("step 4: non-finite gradient norm"), o.message
        assert "3 in a row ([train] nonfinite_max_consecutive=2)" in o.message and "skipped steps: 2, 3, 4" in o.message
    assert _steps(tmp_path / "limit") == ["step-00000001", "step-00000002", "step-00000003"]


# ------------------------------------------------------------------------------ disk full at a save


def _train_on_a_full_disk(settings: dict, full_step: int) -> dict:
    """`_train`, with rank 1's shard of step `full_step` written into /dev/full: the kernel's own
    ENOSPC on DCP's real write path (only where the file points is the test's)."""
    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if torch.distributed.get_rank() == 1 and f"step-{full_step:08d}" in str(self.path):
            os.symlink("/dev/full", Path(self.path) / "__1_0.distcp")
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data
    try:
        return _train(settings)
    finally:
        FileSystemWriter.write_data = original


def test_a_full_disk_at_a_save_is_named_once_cleaned_up_and_stops_or_continues(dist, tmp_path, capsys, monkeypatch):
    pool = dist(2)
    stop = tmp_path / "stop"
    for o in pool.run_raw(_train_on_a_full_disk, {"save_dir": str(stop), "log_dir": str(tmp_path), "save_every": 2}, 4):
        assert o.exc_type == "CheckpointWriteError", o.traceback
        assert o.message.startswith(f"checkpoint {stop / 'step-00000004'} was not saved: No space left on device "
                                    "(errno 28) on rank 1; the partial write was removed and every earlier checkpoint "
                                    f"is untouched; the newest complete checkpoint is still {stop / 'step-00000002'}; "
                                    "fix: free space"), o.message
    assert sorted(os.listdir(stop)) == ["step-00000002"]  # no .step-00000004.partial left filling the disk
    assert checkpoint.verify(stop / "step-00000002") == []

    # on_save_error = "continue", saving in the background: step 2's save fails, training goes on, step 4 saves.
    go_on = tmp_path / "continue"
    settings = {"save_dir": str(go_on), "log_dir": str(tmp_path), "save_every": 2, "async_save": True,
                "on_save_error": "continue"}
    outcomes = pool.run_raw(_train_on_a_full_disk, settings, 2)
    assert all(o.ok for o in outcomes), [o.traceback for o in outcomes]
    assert outcomes[0].value["failed_saves"] == [str(go_on / "step-00000002")]
    said = "was not saved: No space left on device (errno 28) on rank 1"
    assert outcomes[0].output.count(said) == 1 and said not in outcomes[1].output  # once, by rank 0
    assert "training continues" in outcomes[0].output
    assert sorted(os.listdir(go_on)) == ["step-00000004"] and checkpoint.verify(go_on / "step-00000004") == []

    # "stop" ends the recipe with exit status 4 and the message once (rank 0), no traceback.
    def full(run):
        raise CheckpointWriteError("checkpoint x was not saved: No space left on device", "x", "No space left")

    monkeypatch.setattr(train_llama, "train", full)
    preset = tmp_path / "tiny.toml"
    preset.write_text(TINY_TOML)
    capsys.readouterr()  # the pool's forwarded output so far
    assert train_llama.main(["--config", str(preset)]) == 4
    err = capsys.readouterr().err
    assert err == "error: checkpoint x was not saved: No space left on device\n", err

# --------------------------------------------------------------------------------- save-dir lock


def _race_for_the_lock(save_dir: str, start) -> bool:
    start.wait()
    lock, _ = save_lock.SaveDirLock.acquire(save_dir)
    return lock is not None


@pytest.mark.parametrize("round_", range(3))
def test_of_runs_starting_at_once_exactly_one_takes_the_save_dir(tmp_path, round_):
    """Once failed under load when the lock was created empty and written after: a racing run read it
    as a holder killed while writing, took it over as stale, and two runs held the directory."""
    context = multiprocessing.get_context("fork")
    start = context.Manager().Event()
    with context.Pool(6) as processes:
        pending = [processes.apply_async(_race_for_the_lock, (str(tmp_path), start)) for _ in range(6)]
        time.sleep(0.5)
        start.set()
        assert sorted(p.get(timeout=60) for p in pending) == [False] * 5 + [True]


def test_a_second_run_is_refused_at_preflight_and_a_dead_holders_lock_is_taken_over(dist, tmp_path):
    pool = dist(2)
    root = tmp_path / "ckpt"
    root.mkdir()
    base = {"save_dir": str(root), "log_dir": str(tmp_path / "runs"), "save_every": 2, "resume": "auto"}
    assert save_lock.holder_problem(root) is None
    holder, _ = save_lock.SaveDirLock.acquire(root)  # a live run: this test process, its run id chosen
    holder.set_run_id("run-a")
    assert save_lock.holder_problem(root) is None  # its own lock is no obstacle to this process
    for o in pool.run_raw(_train, base):
        assert o.exc_type == "ValueError" and f"save_dir={str(root)!r} is in use by another run (run run-a, pid " \
            f"{os.getpid()} on {socket.gethostname()}" in o.message, o.message
    assert not list(root.glob("step-*"))  # refused before any training
    holder.release()

    # A holder killed without releasing: its pid has ended, or now names another process (pid reuse).
    for pid, start in [(_a_finished_pid(), None), (os.getpid(), 1)]:
        record = {"token": "dead", "run_id": "run-b", "host": socket.gethostname(), "pid": pid, "proc_start": start}
        (root / save_lock.LOCK).write_text(json.dumps(record))
        run = pool.run_raw(_train, {**base, "steps": 2})
        assert all(o.ok for o in run), [o.message for o in run]
        assert f"took over the stale lock {root / save_lock.LOCK} (its process has ended: run run-b" in run[0].output
        assert not (root / save_lock.LOCK).exists()  # released at the end of the run


def _a_finished_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_which_locks_are_stale(tmp_path):
    live = {"token": "t", "run_id": "run-c", "host": socket.gethostname(), "pid": 1,
            "proc_start": save_lock._proc_start(1)}  # init: a live process that is not this one
    (tmp_path / save_lock.LOCK).write_text(json.dumps(live))
    assert "is in use by another run (run run-c, pid 1 on" in save_lock.holder_problem(tmp_path)  # a dry check
    me = {"host": "node-a", "job": "job-1"}
    assert save_lock.stale_reason({}, me, 0) is not None  # unreadable
    assert save_lock.stale_reason({"host": "node-b", "job": "job-1"}, me, 0) == "an earlier attempt of this torchrun job"
    assert save_lock.stale_reason({"host": "node-b", "job": "job-0"}, me, 60) is None  # another host, refreshed
    assert "not refreshed" in save_lock.stale_reason({"host": "node-b", "job": None}, me, save_lock.STALE_S + 1)
    alive = {"host": "node-a", "job": None, "pid": os.getpid(), "proc_start": save_lock._proc_start(os.getpid())}
    assert save_lock.stale_reason(alive, me, save_lock.STALE_S + 1) is None  # same host: the pid decides
