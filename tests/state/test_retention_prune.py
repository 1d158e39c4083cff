"""`retention.prune` on its own: keep_last counts complete checkpoints only (a manifest present), deletes
exactly the older ones and nothing newer, keeps directories without a manifest it is not past, and
never deletes the newest complete checkpoint."""

from __future__ import annotations

from pathlib import Path

from meshkit.state import manifest, retention


def _save_dir(root: Path, steps: dict[int, bool]) -> None:
    """step -> complete (a manifest present) or not (a save still being written, or interrupted)."""
    for step, complete in steps.items():
        path = Path(manifest.step_dir(root, step))
        path.mkdir(parents=True)
        (path / "shard.distcp").write_bytes(b"x")
        if complete:
            (path / manifest.MANIFEST).write_text("{}")


def _left(root: Path) -> list[int]:
    return sorted(step for step, _ in retention.checkpoints(root))


def test_prune_counts_only_complete_checkpoints(tmp_path):
    _save_dir(tmp_path, {10: True, 20: True, 30: False, 40: True, 50: False})
    deleted = retention.prune(tmp_path, keep_last=2)
    # complete: 40, 20, 10; the two newest complete are 40 and 20, so only 10 goes. 30 and 50 have no
    # manifest: not counted towards keep_last, and not older than what is kept.
    assert sorted(Path(p).name for p in deleted) == [Path(manifest.step_dir(tmp_path, 10)).name]
    assert _left(tmp_path) == [20, 30, 40, 50]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no trash left behind"


def test_prune_keeps_the_newest_complete_checkpoint_and_everything_without_keep_last(tmp_path):
    _save_dir(tmp_path, {1: True, 2: False, 3: False})
    assert retention.prune(tmp_path, keep_last=1) == [] and _left(tmp_path) == [1, 2, 3]
    assert retention.prune(tmp_path, keep_last=0) == [] and _left(tmp_path) == [1, 2, 3]
    _save_dir(tmp_path, {4: True})
    assert [Path(p).name for p in retention.prune(tmp_path, keep_last=1)] == \
        [Path(manifest.step_dir(tmp_path, s)).name for s in (3, 2, 1)]
    assert _left(tmp_path) == [4]
