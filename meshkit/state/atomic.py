"""Publishing a checkpoint directory all at once: written under a temporary name, renamed when complete.

A checkpoint written in place can be caught half-written by a crash (or, worse, half-overwritten:
an old `.metadata` beside new shards loads and trains on with a wrong loss). Here every save goes to
`manifest.partial_dir(final)`; once DCP has returned (its coordinator writes the metadata only after
every rank's shards) one rank checksums the files, writes the manifest and renames the directory.
A rename is atomic on POSIX filesystems, so `final` either does not exist or is complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshkit.state import manifest
from meshkit.step.consensus import raise_if_any

__all__ = ["begin", "publish", "publish_everywhere"]


def begin(path: str | os.PathLike) -> tuple[str, str]:
    """Refuse an existing checkpoint, clear a killed save's leftovers; (final, temporary) paths.

    Collective. An existing empty directory is allowed (the rename replaces it); one with files is
    refused on every rank, because writing into it is how an old `.metadata` ends up beside new shards.
    """
    final = Path(path)
    problem = None
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        problem = (f"checkpoint {final} already exists; meshkit never writes into an existing checkpoint; "
                   "fix: save under a new step or directory")
    raise_if_any(problem)
    partial = manifest.partial_dir(final)
    if not dist.is_initialized() or dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a save of this step killed midway
        os.makedirs(partial)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    return str(final), partial


def publish(partial: str, final: str, description: dict[str, Any]) -> None:
    """Rank-local: checksum the finished files, write the manifest, rename to the final name.

    Called on one rank after DCP returned there (DCP's coordinator writes the metadata only after
    every rank reported its shards written).
    """
    manifest.write(partial, description)
    os.replace(partial, final)  # atomic; replaces an empty directory of that name
    fd = os.open(Path(final).parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_everywhere(partial: str, final: str, description: dict[str, Any]) -> None:
    """Rank 0 publishes; every rank returns once the checkpoint is complete or raises if it failed."""
    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            publish(partial, final, description)
        except OSError as err:
            problem = f"checkpoint {final}: finishing the save failed ({err})"
    raise_if_any(problem)
