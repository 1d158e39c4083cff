"""Checkpoints are atomic, verified and never overwritten; a damaged newest one falls back to the older.

One saving run (2 gloo ranks, tp=2, a tiny Llama) trains four AdamW steps and checkpoints after
steps 2 and 4, recording each step's loss: the uninterrupted run. Every damage a crash or a careless
copy can do to the newest checkpoint is then applied to a copy of the directory, and
`checkpoint.latest` must pick step 2 with a warning naming the damage; a real resume from the pick
must reproduce the uninterrupted step 3 bit for bit.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import meshkit
from meshkit.state import checkpoint, manifest, retention
from meshkit.state.async_checkpoint import AsyncCheckpointer
from meshkit.testing.reference import BatchSpec, ModelSpec

SPEC = ModelSpec()
BATCH = BatchSpec(batch=4, seq=8)
PLAN = "tp=2"


def _setup(init: bool):
    pm = meshkit.parallelize(SPEC.build(device="meta"), meshkit.Plan.from_string(PLAN))
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    if init:
        pm.init_weights(0)
    return pm, optimizer


def _step(pm, optimizer, step: int) -> float:
    ids, labels = BATCH.make(SPEC.vocab, step)
    loss = pm.forward_backward(ids, labels)
    pm.clip_grad_norm_(1.0)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _train(root: str, use_async: bool) -> dict:
    """Steps 1-4, checkpoints after 2 and 4 (sync or async), the loss of every step."""
    pm, optimizer = _setup(init=True)
    saver = AsyncCheckpointer() if use_async else None
    losses = {}
    for step in range(1, 5):
        losses[step] = _step(pm, optimizer, step)
        if step % 2 == 0:
            path = checkpoint.step_dir(root, step)
            if saver is None:
                checkpoint.save(path, pm, optimizer, step=step, run_id="run-a", global_batch=BATCH.batch)
            else:
                saver.save(path, pm, optimizer, step=step, run_id="run-a", global_batch=BATCH.batch)
                # Training goes on while the files are written: changes made now must not reach them.
                kept = [p.detach().clone() for p in pm.parameters()]
                with torch.no_grad():
                    for p in pm.parameters():
                        p.add_(1000.0)
                    saver.wait()
                    for p, value in zip(pm.parameters(), kept):
                        p.copy_(value)
    if saver is not None:
        saver.close()
    return losses


def _resume(path: str) -> dict:
    pm, optimizer = _setup(init=False)
    info = checkpoint.load(path, pm, optimizer)
    return {"step": info["step"], "loss": _step(pm, optimizer, info["step"] + 1)}


@pytest.fixture(scope="module")
def trained(dist, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    losses = dist(2).run(_train, str(root), False)[0]
    return root, losses


def _copy(root: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(root, target)
    return target


def _latest_with_warning(root: Path) -> tuple[str | None, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        path = checkpoint.latest(root)
    return path, " | ".join(str(w.message) for w in caught)


def test_checkpoint_is_published_whole_with_a_manifest(trained):
    root, _ = trained
    names = sorted(p.name for p in root.iterdir())
    assert names == ["step-00000002", "step-00000004"], names  # no temporary directory left behind
    record = manifest.read(root / "step-00000004")
    assert record["run_id"] == "run-a" and record["step"] == 4 and record["global_batch"] == BATCH.batch
    assert record["plan"] == json.loads(json.dumps(meshkit.Plan.from_string(PLAN).to_dict())) and record["world_size"] == 2
    files = {p.name for p in (root / "step-00000004").iterdir()} - {manifest.MANIFEST}
    assert set(record["files"]) == files and {".metadata", "__0_0.distcp", "__1_0.distcp"} <= files
    assert checkpoint.verify(root / "step-00000004") == []
    assert checkpoint.latest(root) == str(root / "step-00000004")


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


DAMAGE = {
    "truncated-metadata": (lambda d: _truncate(d / ".metadata"), ".metadata has"),
    "missing-shard": (lambda d: (d / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
    "truncated-shard": (lambda d: _truncate(d / "__0_0.distcp"), "__0_0.distcp has"),
    "shard-from-another-checkpoint": (
        lambda d: shutil.copy(d.parent / "step-00000002" / "__0_0.distcp", d / "__0_0.distcp"),
        "__0_0.distcp checksum differs"),
    "no-manifest": (lambda d: (d / manifest.MANIFEST).unlink(), "no manifest.json"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_with_a_warning(trained, tmp_path, damage):
    root = _copy(trained[0], tmp_path)
    apply, expected = DAMAGE[damage]
    apply(root / "step-00000004")
    path, warned = _latest_with_warning(root)
    assert path == str(root / "step-00000002")
    assert "step-00000004" in warned and expected in warned, warned


def test_truncated_metadata_is_refused_by_load_too(dist, trained, tmp_path):
    """Loading a damaged checkpoint by name raises the same ValueError on every rank (no DCP traceback)."""
    root = _copy(trained[0], tmp_path)
    _truncate(root / "step-00000004" / "__1_0.distcp")
    outcomes = dist(2).run_raw(_resume, str(root / "step-00000004"))
    for o in outcomes:
        assert o.exc_type == "ValueError" and "incomplete or damaged" in o.message, o.traceback or o.message


def test_resume_from_the_fallback_is_bit_identical(dist, trained, tmp_path):
    root = _copy(trained[0], tmp_path)
    _truncate(root / "step-00000004" / "__0_0.distcp")
    path, _ = _latest_with_warning(root)
    resumed = dist(2).run(_resume, path)
    for r in resumed:
        assert r == {"step": 2, "loss": trained[1][3]}


def test_a_save_killed_midway_is_invisible_and_redone(dist, trained, tmp_path):
    """A killed save leaves only its hidden temporary directory: resume skips it, the next save of
    that step clears it."""
    root = _copy(trained[0], tmp_path)
    final = root / "step-00000004"
    partial = Path(manifest.partial_dir(final))
    final.rename(partial)
    (partial / ".metadata").unlink()  # the coordinator had not written the metadata yet
    assert checkpoint.latest(root) == str(root / "step-00000002")
    assert [s for s, _ in retention.checkpoints(root)] == [2]
    resumed = dist(2).run(_resume_and_save, str(root))
    assert resumed[0] == {"step": 2, "loss": trained[1][3]}
    assert not partial.exists() and checkpoint.verify(final) == []


def _resume_and_save(root: str) -> dict:
    pm, optimizer = _setup(init=False)
    info = checkpoint.load(checkpoint.latest(root), pm, optimizer)
    loss = _step(pm, optimizer, 3)
    _step(pm, optimizer, 4)
    checkpoint.save(checkpoint.step_dir(root, 4), pm, optimizer, step=4, run_id="run-a")
    return {"step": info["step"], "loss": loss}


def _save_into(path: str) -> None:
    pm, optimizer = _setup(init=True)
    checkpoint.save(path, pm, optimizer, step=9)


def test_saving_into_an_existing_checkpoint_is_refused(dist, trained, tmp_path):
    root = _copy(trained[0], tmp_path)
    target = root / "step-00000004"
    before = json.loads((target / manifest.MANIFEST).read_text())
    outcomes = dist(2).run_raw(_save_into, str(target))
    for o in outcomes:
        assert o.exc_type == "ValueError" and "never writes into an existing checkpoint" in o.message, o.message
    assert json.loads((target / manifest.MANIFEST).read_text()) == before and checkpoint.verify(target) == []


def _save_non_finite(root: str) -> None:
    pm, optimizer = _setup(init=True)
    _step(pm, optimizer, 1)
    with torch.no_grad():
        next(iter(pm.parameters())).to_local().view(-1)[0] = float("nan") if torch.distributed.get_rank() == 1 else 0.0
    checkpoint.save(checkpoint.step_dir(root, 1), pm, optimizer, step=1)


def test_non_finite_state_is_never_saved(dist, tmp_path):
    outcomes = dist(2).run_raw(_save_non_finite, str(tmp_path))
    for o in outcomes:
        assert o.exc_type == "ValueError" and "step 1: non-finite values" in o.message, o.traceback or o.message
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_async_save_resumes_identically(dist, trained, tmp_path):
    """Async checkpoints (parameters changed while the files are written) equal the sync ones."""
    losses = dist(2).run(_train, str(tmp_path), True)[0]
    assert losses == trained[1]
    resumed = dist(2).run(_resume, checkpoint.step_dir(tmp_path, 2))
    assert all(r == {"step": 2, "loss": trained[1][3]} for r in resumed)
    for step in (2, 4):
        ours, theirs = (manifest.read(Path(r) / f"step-{step:08d}")["files"] for r in (tmp_path, trained[0]))
        shards = [n for n in ours if n.endswith(".distcp")]
        assert [ours[n]["sha256"] for n in shards] == [theirs[n]["sha256"] for n in shards]
