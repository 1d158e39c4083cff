"""Which checkpoints under a directory to resume from, and which to delete.

A run's `--save-dir` holds `step-<n>` directories. Resuming takes the newest one that verifies
(`manifest.problems`) and says what was wrong with each newer one it skipped, so one damaged
checkpoint never blocks a restart. Retention keeps the newest `keep_last` complete checkpoints; the
newest complete one is never deleted, whatever `keep_last` says.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from meshkit.state import manifest

__all__ = ["DAMAGED_SUFFIX", "Resolution", "checkpoints", "move_aside", "prune", "remove", "resolve", "run_ids"]

DAMAGED_SUFFIX = ".damaged"


@dataclass
class Resolution:
    """The checkpoint chosen (None: none verifies) and every newer one skipped, with its problems."""

    path: str | None
    step: int | None
    skipped: list[tuple[str, list[str]]] = field(default_factory=list)

    def warnings(self) -> list[str]:
        """One line per skipped checkpoint, naming what was wrong with it."""
        return [f"skipping checkpoint {path}: {'; '.join(found)}" for path, found in self.skipped]


def checkpoints(root: str | os.PathLike) -> list[tuple[int, str]]:
    """(step, path) of every `step-<n>` directory under `root`, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(manifest.step_of(child), str(child)) for child in root.iterdir() if child.is_dir()]
    return sorted(((s, p) for s, p in found if s is not None), reverse=True)


def _is_checkpoint_dir(path: Path) -> bool:
    return (path / manifest.MANIFEST).exists() or (path / ".metadata").exists()


def resolve(root: str | os.PathLike, *, load_step: int | None = None, checksums: bool = True) -> Resolution:
    """The newest verifying checkpoint under `root` (or `root` itself when it is a checkpoint).

    With `load_step`, only that step's checkpoint is considered: an older one the user picked on
    purpose, never silently replaced by another. Reads every file of each candidate (checksums), so
    call it on one rank and share the answer.
    """
    root = Path(root)
    if _is_checkpoint_dir(root):
        found = manifest.problems(root, checksums=checksums)
        return Resolution(None, None, [(str(root), found)]) if found else Resolution(str(root), _step(root))
    candidates = checkpoints(root)
    if load_step is not None:
        candidates = [(s, p) for s, p in candidates if s == load_step]
        if not candidates:
            return Resolution(None, None, [(manifest.step_dir(root, load_step), ["no such checkpoint"])])
    skipped = []
    for step, path in candidates:
        found = manifest.problems(path, checksums=checksums)
        if not found:
            return Resolution(path, step, skipped)
        skipped.append((path, found))
    return Resolution(None, None, skipped)


def _step(path: Path) -> int | None:
    try:
        return int(manifest.read(path)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return manifest.step_of(path)


def run_ids(root: str | os.PathLike) -> dict[str, str | None]:
    """Path -> run id of every `step-<n>` directory under `root` (None: no readable manifest)."""
    ids: dict[str, str | None] = {}
    for _, path in checkpoints(root):
        try:
            ids[path] = manifest.read(path).get("run_id")
        except (OSError, ValueError):
            ids[path] = None
    return ids


def prune(root: str | os.PathLike, keep_last: int) -> list[str]:
    """Delete every `step-<n>` directory older than the newest `keep_last` complete ones; return them.

    Complete means a manifest is present (checked cheaply: the save that wrote it verified nothing
    more). `keep_last` < 1 keeps everything. A directory is renamed to a hidden name before it is
    removed, so a crash mid-delete never leaves a half-deleted `step-<n>` to resume from.
    """
    if keep_last < 1:
        return []
    complete = [(s, p) for s, p in checkpoints(root) if (Path(p) / manifest.MANIFEST).is_file()]
    if len(complete) <= keep_last:
        return []
    oldest_kept = complete[keep_last - 1][0]
    doomed = [p for s, p in checkpoints(root) if s < oldest_kept]
    for path in doomed:
        remove(path)
    return doomed


def remove(path: str | os.PathLike) -> None:
    """Delete one checkpoint directory: hidden rename first, then the files."""
    path = Path(path)
    trash = path.parent / f".{path.name}.deleting"
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def move_aside(path: str | os.PathLike) -> str:
    """Rename a damaged checkpoint to `<name>.damaged` (`.damaged-2`, ... when taken) and return the new path.

    The files stay for inspection, but no listing (resume, retention, the save-dir policy) sees them
    any more, and the step can be saved again: a damaged checkpoint must never block a restart.
    Retention never deletes a moved-aside directory; delete it by hand once inspected.
    """
    path = Path(path)
    target, n = path.with_name(path.name + DAMAGED_SUFFIX), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED_SUFFIX}-{n}")
    os.replace(path, target)
    return str(target)
