"""Publishing a checkpoint directory all at once: written under a temporary name, renamed when complete.

A checkpoint written in place can be caught half-written by a crash (or, worse, half-overwritten:
an old `.metadata` beside new shards loads and trains on with a wrong loss). Here every save goes to
`manifest.partial_dir(final)`; once DCP has returned (its coordinator writes the metadata only after
every rank's shards) one rank checksums the files, writes the manifest and renames the directory.
A rename is atomic on POSIX filesystems, so `final` either does not exist or is complete.

A save that fails while writing (disk full, quota, an I/O error on any rank) is abandoned the same
way on every rank: rank 0 removes the temporary directory, so a full disk is not kept full by half a
checkpoint, and every rank raises one `CheckpointWriteError` naming the cause (not DCP's traceback of
every rank). Nothing outside the temporary directory was touched, so every earlier checkpoint stands.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from meshkit.state import manifest
from meshkit.step.consensus import gather_problems, raise_if_any

__all__ = ["CheckpointWriteError", "abandon_if_failed", "begin", "describe_failure", "publish", "publish_everywhere"]


class CheckpointWriteError(RuntimeError):
    """A checkpoint whose files could not be written: the same on every rank, its temporary directory
    already removed, every earlier checkpoint untouched. `cause` names the root error in words."""

    def __init__(self, message: str, path: str, cause: str):
        super().__init__(message)
        self.path, self.cause = path, cause


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
        except OSError as err:  # the manifest did not fit, or the rename failed
            problem = describe_failure(err, partial)
    abandon_if_failed(partial, final, problem)


def describe_failure(err: BaseException, directory: str | os.PathLike | None = None) -> str:
    """The root cause of a failed write in words, e.g. "No space left on device (errno 28) on rank 1".

    DCP raises every rank's failure on every rank (a CheckpointException naming the ranks): the
    first OSError inside it names the cause. torch.save's C++ writer reports a full disk as an
    "unexpected pos" RuntimeError without an errno, so when `directory` (where the write went) has
    under `LOW_SPACE` bytes left, a full disk is named as the cause.
    """
    ranks = sorted(getattr(err, "failures", None) or {})
    on = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
    causes = list(_causes(err))
    for exc in causes:
        if isinstance(exc, OSError) and exc.errno is not None:
            where = f", {exc.filename}" if exc.filename else ""
            return f"{os.strerror(exc.errno)} (errno {exc.errno}{where}){on}"
    first = causes[1] if ranks and len(causes) > 1 else err  # the first rank's own exception, not DCP's wrapper
    said = f"{type(first).__name__}: {str(first).strip().splitlines()[0] if str(first).strip() else ''}"
    free = _free_bytes(directory)
    if free is not None and free < LOW_SPACE:
        return f"No space left on device ({free} bytes free on the filesystem of {Path(directory).parent}; the " \
               f"writer said {said}){on}"
    return f"{said}{on}"


LOW_SPACE = 1 << 20


def _free_bytes(directory: str | os.PathLike | None) -> int | None:
    try:
        return shutil.disk_usage(directory).free if directory is not None else None
    except OSError:
        return None


def _causes(err: BaseException, seen: set[int] | None = None) -> Iterator[BaseException]:
    seen = set() if seen is None else seen
    if err is None or id(err) in seen:
        return
    seen.add(id(err))
    yield err
    for wrapped in (getattr(err, "failures", None) or {}).values():  # CheckpointException: rank -> (exc, trace)
        yield from _causes(wrapped[0] if isinstance(wrapped, tuple) else wrapped, seen)
    yield from _causes(err.__cause__, seen)
    yield from _causes(err.__context__, seen)


def abandon_if_failed(partial: str, final: str, problem: str | None) -> None:
    """Collective: when any rank's part of a save failed (`problem`: its `describe_failure`), rank 0
    removes the temporary directory and every rank raises the same CheckpointWriteError."""
    failing = gather_problems(problem)
    if not failing:
        return
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # the directory is gone on every rank's return
    first_rank, cause = failing[0]
    if " on rank" not in cause:  # a cause the rank found itself (its background upload, the manifest)
        others = f" (and {len(failing) - 1} more rank(s))" if len(failing) > 1 else ""
        cause = f"{cause} on rank {first_rank}{others}"
    newest = _newest_complete(Path(final).parent)
    kept = f"; the newest complete checkpoint is still {newest}" if newest else ""
    raise CheckpointWriteError(
        f"checkpoint {final} was not saved: {cause}; the partial write was removed "
        f"and every earlier checkpoint is untouched{kept}; fix: free space in {Path(final).parent} (or save "
        "elsewhere), then resume", final, cause)


def _newest_complete(root: Path) -> str | None:
    steps = [(manifest.step_of(p), p) for p in root.iterdir()] if root.is_dir() else []
    complete = sorted((s, p) for s, p in steps if s is not None and (p / manifest.MANIFEST).is_file())
    return str(complete[-1][1]) if complete else None
