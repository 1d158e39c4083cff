"""Checkpoints written while training goes on: DCP's `async_save` on a process group of its own.

A synchronous save stops every rank for as long as the slowest filesystem write; `async_save` copies
the state (staging) and returns, and a background thread writes the files. Two things make that
safe here. The background thread runs DCP's collectives on a dedicated gloo group created once,
because collectives from two threads on one group can interleave differently on different ranks.
And the checkpoint is published exactly like a synchronous one (`atomic`): rank 0's thread writes
the manifest and renames the temporary directory only after DCP's upload finished, so a crash at any
moment leaves either the complete checkpoint or none. One save is in flight at a time; `wait`
(collective) finishes it and, when any rank's upload failed (disk full), removes the temporary
directory and raises `atomic.CheckpointWriteError` on every rank.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import CheckpointException

from meshkit._compat.dcp import dcp_async_save
from meshkit.state import atomic, checkpoint

if TYPE_CHECKING:
    from meshkit.parallel_model import ParallelModel

__all__ = ["AsyncCheckpointer"]


class AsyncCheckpointer:
    """Saves in the background; construct it on every rank at the same point (it creates a group)."""

    def __init__(self) -> None:
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self._group = dist.new_group(backend="gloo") if distributed else None
        self._rank = dist.get_rank() if dist.is_initialized() else 0
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshkit-checkpoint")
        self._pending: Future | None = None
        self._pending_path: str | None = None
        self._pending_partial: str | None = None

    @property
    def in_flight(self) -> str | None:
        """The path of the save not yet waited for, or None."""
        return self._pending_path

    def save(self, path: str | os.PathLike, pm: ParallelModel, optimizer: torch.optim.Optimizer, *,
             scheduler: Any = None, step: int = 0, extra: Any = None, run_id: str | None = None,
             global_batch: int | None = None, data: Any = None) -> None:
        """Start a save of what `checkpoint.save` saves; returns once the state is staged (copied).

        Collective. Waits for the previous save first. The same refusals as `checkpoint.save`
        (existing path, non-finite state) raise here, before anything is written.
        """
        self.wait()
        state = checkpoint.state_dict(pm, optimizer, scheduler=scheduler, step=step, extra=extra, run_id=run_id,
                                      data=data)
        final, partial = atomic.begin(path)
        upload = dcp_async_save(state, partial, checkpoint.save_planner(), self._group)
        description = checkpoint.record(pm, step, run_id, global_batch)
        publisher = self._rank == 0

        def finish() -> str:
            upload.result()
            if publisher:
                atomic.publish(partial, final, description)
            return final

        self._pending = self._executor.submit(finish)
        self._pending_path, self._pending_partial = final, partial

    def wait(self) -> str | None:
        """Finish the save in flight (collective); its path, or None when there was none. Raises
        `atomic.CheckpointWriteError` on every rank when the save failed."""
        if self._pending is None:
            return None
        path, partial, pending = self._pending_path, self._pending_partial, self._pending
        self._pending = self._pending_path = self._pending_partial = None
        problem = None
        try:
            pending.result()
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported on every rank below
            problem = atomic.describe_failure(err, partial)
        atomic.abandon_if_failed(partial, path, problem)
        return path

    def close(self) -> None:
        """Finish the save in flight and stop the background thread (collective)."""
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
