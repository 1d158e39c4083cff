"""What makes a checkpoint directory trustworthy: a manifest written last, and its verification.

DCP's `.metadata` alone cannot tell a complete checkpoint from a damaged one: a truncated shard, a
missing shard, or a shard copied in from another run all load until the bytes are read, and an old
`.metadata` beside new shards loads with a wrong loss. So every checkpoint gets `manifest.json`,
written after every rank's shards and the metadata are on disk, recording the run id, the step, the
plan, the global batch and the size and SHA-256 of every file. The directory is built under a
temporary name and renamed to `step-<n>` only after the manifest exists (see `checkpoint.save`), so
a `step-<n>` directory is either complete or was damaged afterwards, and `problems` tells which.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

from meshkit.state.digest import file_digest

__all__ = ["MANIFEST", "partial_dir", "problems", "read", "step_dir", "step_of", "write"]

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
STEP_PREFIX = "step-"
PARTIAL_SUFFIX = ".partial"


def step_dir(root: str | os.PathLike, step: int) -> str:
    """Where the checkpoint of `step` goes under `root` (a fresh directory per save: never half-overwritten)."""
    return str(Path(root) / f"{STEP_PREFIX}{step:08d}")


def partial_dir(final: str | os.PathLike) -> str:
    """The temporary name a checkpoint is written under before it is renamed to `final`.

    Hidden and fixed per final name, so a save killed midway leaves one recognisable directory that
    the next save of the same step removes, and no listing of `step-*` ever sees it.
    """
    final = Path(final)
    return str(final.parent / f".{final.name}{PARTIAL_SUFFIX}")


def step_of(path: str | os.PathLike) -> int | None:
    """The step in a `step-<n>` directory name, or None for any other name."""
    name = Path(path).name
    suffix = name[len(STEP_PREFIX):]
    return int(suffix) if name.startswith(STEP_PREFIX) and suffix.isdigit() else None


def write(directory: str | os.PathLike, record: dict[str, Any]) -> dict[str, Any]:
    """Checksum every file in `directory` and write the manifest (atomically, fsynced); return it.

    Called once, by one rank, after DCP has finished (its `.metadata` is written after every rank's
    shards). `record` holds the run id, step, plan, world size and global batch.
    """
    directory = Path(directory)
    files = {}
    for path in sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST):
        _fsync(path)
        files[path.name] = {"size": path.stat().st_size, "sha256": file_digest(path)}
    manifest = {"format": MANIFEST_FORMAT, **record, "files": files, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                           time.gmtime())}
    tmp = directory / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    _fsync(directory)
    return manifest


def read(directory: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a checkpoint directory; raises OSError or ValueError when absent or unreadable."""
    with open(Path(directory) / MANIFEST) as f:
        manifest = json.load(f)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{MANIFEST} has no file list")
    return manifest


def problems(directory: str | os.PathLike, *, checksums: bool = True) -> list[str]:
    """Everything wrong with a checkpoint directory; empty when it verifies.

    Checks, in order of cost: the manifest reads, DCP's metadata loads, every file the metadata
    references is listed, and every listed file is present with its recorded size and (with
    `checksums`) its SHA-256. Never raises: a damaged checkpoint is an answer, not an error.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return [f"{directory} is not a directory"]
    try:
        manifest = read(directory)
    except FileNotFoundError:
        return [f"no {MANIFEST} (not a complete meshkit checkpoint: a save that never finished, or written "
                "by an older meshkit)"]
    except (OSError, ValueError) as err:
        return [f"{MANIFEST} unreadable ({type(err).__name__}: {err})"]
    found = []
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as err:  # noqa: BLE001 - a truncated pickle raises anything from EOFError to UnpicklingError
        found.append(f"DCP metadata does not load ({type(err).__name__}: {err})")
    else:
        referenced = {item.relative_path for item in (metadata.storage_data or {}).values()}
        unlisted = sorted(referenced - set(manifest["files"]))
        if unlisted:
            found.append(f"shard(s) {unlisted} referenced by the metadata but not in the manifest")
    for name, want in sorted(manifest["files"].items()):
        path = directory / name
        if not path.is_file():
            found.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != want.get("size"):
            found.append(f"{name} has {size} bytes, the manifest says {want.get('size')}")
        elif checksums and file_digest(path) != want.get("sha256"):
            found.append(f"{name} checksum differs from the manifest (damaged, or a file from another run)")
    return found


def _fsync(path: Path) -> None:
    """Flush a file or directory to disk, so a rename never publishes data still in the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
