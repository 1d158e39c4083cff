"""The recipe's checkpoint policy: which checkpoint to resume, where a run may save, what to keep.

One command serves the first launch and every restart (`--resume auto`): the newest checkpoint under
`save_dir` that verifies resumes, older ones are tried when newer ones are damaged (a warning names
what was wrong, and a run that saves moves each damaged one aside to `<name>.damaged`, kept for
inspection, so it never blocks the run's own save of that step), and with none at all the run
starts fresh. A run never mixes its checkpoints with
another run's: a fresh run into a `save_dir` holding checkpoints, or a resumed run that would save
over newer checkpoints of its own (`--load-step` an older one), is refused unless `--overwrite`
says to delete them. Verifying reads every byte, so rank 0 decides and broadcasts the decision.
"""

from __future__ import annotations

import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

import save_lock  # the recipe's own module beside this one (the script's folder is on sys.path)
import torch
import torch.distributed as dist

import meshkit
from meshkit.state import checkpoint, manifest, retention
from meshkit.state.async_checkpoint import AsyncCheckpointer
from meshkit.state.atomic import CheckpointWriteError

AUTO = "auto"
EXIT_SAVE_FAILED = 4  # a checkpoint could not be written and on_save_error = "stop" (docs/reliability.md)
__all__ = ["EXIT_SAVE_FAILED", "Checkpointing", "CheckpointWriteError", "decide", "follow_schedule_after_resume"]


@dataclass
class Decision:
    """Rank 0's resolution of the resume settings, broadcast to every rank."""

    path: str | None = None  # the checkpoint to load, or None for a fresh start
    step: int = 0
    run_id: str = ""
    notes: list[str] = field(default_factory=list)  # printed by rank 0: warnings, deletions
    error: str | None = None
    delete: list[str] = field(default_factory=list)  # --overwrite: checkpoints rank 0 deletes
    move_aside: list[str] = field(default_factory=list)  # damaged checkpoints rank 0 renames to <name>.damaged


def decide(cfg: Any) -> Decision:
    """Where this run starts and which existing checkpoints stand in its way (rank-local, pure I/O)."""
    fresh_id = uuid.uuid4().hex[:12]
    found = None
    if cfg.resume:
        root = cfg.save_dir if cfg.resume == AUTO else cfg.resume
        found = retention.resolve(root, load_step=cfg.load_step or None)
        notes = found.warnings()
        if found.path is None:
            if cfg.load_step:
                return Decision(error=f"[train] load_step={cfg.load_step}: no verifying checkpoint of that step under "
                                      f"{root!r} ({'; '.join(notes) or 'none'}); fix: a step listed there")
            if cfg.resume != AUTO:
                return Decision(error=f"[train] resume={cfg.resume!r}: no checkpoint there verifies"
                                      f"{': ' + '; '.join(notes) if notes else ''}; fix: another directory, or "
                                      "resume = \"auto\" to start fresh when none exists")
            if found.skipped and not cfg.overwrite:
                return Decision(error="[train] resume=\"auto\": checkpoints exist under "
                                      f"{root!r} but none verifies ({'; '.join(notes)}); fix: repair them, or "
                                      "--overwrite to delete them and start afresh")
    if found is not None and found.path is not None:
        record = _manifest_or_empty(found.path)
        decision = Decision(found.path, found.step or 0, record.get("run_id") or fresh_id, found.warnings())
        if cfg.resume == AUTO and cfg.save_every:
            # Newer checkpoints that failed verification would block this run's saves of those steps and
            # read as "newer checkpoints of the run": renamed, kept for inspection, never in the way.
            decision.move_aside = [path for path, _ in found.skipped]
    else:
        decision = Decision(run_id=fresh_id, notes=found.warnings() if found else [])
    if cfg.save_every:
        decision = _check_save_dir(cfg, decision)
    return decision


def _decide_safely(cfg: Any) -> Decision:
    """`decide`, with any failure turned into the decision's error (the other ranks wait for it)."""
    try:
        return decide(cfg)
    except Exception as err:  # noqa: BLE001 - reported on every rank by the caller
        return Decision(error=f"resolving the checkpoint to resume failed ({type(err).__name__}: {err})")


def _check_save_dir(cfg: Any, decision: Decision) -> Decision:
    """Checkpoints in save_dir that this run would mix with or save over."""
    foreign = []
    for path, run_id in retention.run_ids(cfg.save_dir).items():
        if path in decision.move_aside:
            continue
        if run_id is None and cfg.resume == AUTO and decision.path is not None:
            decision.move_aside.append(path)  # no readable manifest: damaged, whose run it was is unknown
            continue
        step = manifest.step_of(path) or 0
        ours = decision.path is not None and run_id == decision.run_id
        if not ours or step > decision.step:
            foreign.append(path)
    if not foreign:
        return decision
    if cfg.overwrite:
        decision.delete = foreign
        decision.notes.append(f"--overwrite: deleting {len(foreign)} checkpoint(s) in {cfg.save_dir}: "
                              f"{', '.join(sorted(foreign))}")
        return decision
    why = ("newer checkpoints of the resumed run (resuming an older step would save over them)"
           if decision.path is not None else "checkpoints of another run")
    decision.error = (f"[train] save_dir={cfg.save_dir!r} holds {why}: {', '.join(sorted(foreign))}; fix: "
                      "--resume auto to continue that run, --save-dir NEW, or --overwrite to delete them")
    return decision


def _manifest_or_empty(path: str) -> dict[str, Any]:
    try:
        return manifest.read(path)
    except (OSError, ValueError):
        return {}


class Checkpointing:
    """Resume, save (sync or async), retain; every method is collective."""

    def __init__(self, cfg: Any, pm: meshkit.ParallelModel, global_batch: int):
        self.cfg, self.pm, self.global_batch = cfg, pm, global_batch
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        box = [_decide_safely(cfg) if self.rank == 0 else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)
        self.decision: Decision = box[0]
        if self.decision.error:
            raise ValueError(self.decision.error)  # the same on every rank, before any training
        if self.rank == 0:
            lock = save_lock.held(cfg.save_dir)
            if lock is not None:
                lock.set_run_id(self.run_id)
            for note in self.decision.notes:
                print(f"meshkit: {note}", flush=True)
            for path in self.decision.delete:
                retention.remove(path)
            for path in self.decision.move_aside:
                print(f"meshkit: moved the damaged checkpoint {path} aside to {retention.move_aside(path)} (kept for "
                      "inspection; this run saves that step again)", flush=True)
        self.saver = AsyncCheckpointer() if cfg.async_save and cfg.save_every else None
        self.resumed_extra: Any = None
        self.failed_saves: list[str] = []  # on_save_error = "continue": checkpoints that could not be written

    @property
    def run_id(self) -> str:
        """This run's id: new for a fresh start, the checkpoint's when resuming (one run, many launches)."""
        return self.decision.run_id

    @property
    def resuming(self) -> bool:
        """Whether weights come from a checkpoint (so the caller must not initialise them)."""
        return self.decision.path is not None

    def restore(self, optimizer: torch.optim.Optimizer, scheduler: Any, data: Any = None) -> int:
        """Load the chosen checkpoint (and `data`'s position: a meshkit.data loader); the first step to train."""
        if self.decision.path is None:
            return 1
        info = self.pm.load_checkpoint(self.decision.path, optimizer, scheduler=scheduler, data=data)
        self.resumed_extra = info["extra"]
        if self.rank == 0:
            print(f"meshkit: resumed from {self.decision.path} at step {info['step'] + 1} (run {self.run_id})",
                  flush=True)
        return info["step"] + 1

    def after_step(self, step: int, optimizer: torch.optim.Optimizer, scheduler: Any, *, last: bool,
                   extra: Any = None, data: Any = None) -> float:
        """Save when this step is due (outside the timed step); the seconds the loop was blocked."""
        every = self.cfg.save_every
        if not every or not (step % every == 0 or last):
            return 0.0
        start = time.perf_counter()
        path = checkpoint.step_dir(self.cfg.save_dir, step)
        kwargs = dict(scheduler=scheduler, step=step, extra=extra, run_id=self.run_id, global_batch=self.global_batch,
                      data=data)
        if self.saver is None:
            try:
                self.pm.save_checkpoint(path, optimizer, **kwargs)
                self._retain()
            except CheckpointWriteError as err:
                self._save_failed(err)
        else:
            if self._wait() is not None:  # the previous save is complete: prune now
                self._retain()
            self.saver.save(path, self.pm, optimizer, **kwargs)
        return time.perf_counter() - start

    def close(self) -> None:
        """Finish a save in flight (collective) and apply retention to it."""
        if self.saver is not None:
            try:
                done = self._wait()
            finally:
                self.saver.close()
            if done is not None:
                self._retain()

    def _wait(self) -> str | None:
        try:
            return self.saver.wait()
        except CheckpointWriteError as err:
            self._save_failed(err)
            return None

    def _save_failed(self, err: CheckpointWriteError) -> None:
        """A save that could not be written (disk full): stop (raise, said once by the caller) or, with
        on_save_error = "continue", say so once and train on; the next save tries again."""
        if self.cfg.on_save_error != "continue":
            raise err
        self.failed_saves.append(err.path)
        if self.rank == 0:
            print(f"meshkit: {err}; training continues (on_save_error = \"continue\"), the next save tries again",
                  flush=True)

    def _retain(self) -> None:
        if self.rank == 0 and self.cfg.keep_last:
            for path in retention.prune(self.cfg.save_dir, self.cfg.keep_last):
                print(f"meshkit: keep_last={self.cfg.keep_last}: deleted {path}", flush=True)


def follow_schedule_after_resume(scheduler: torch.optim.lr_scheduler.LRScheduler) -> tuple[float, float]:
    """Set the learning rate of the restored step from this run's schedule; return (restored, now).

    A checkpoint restores the scheduler's step and its last learning rate, but the schedule itself is
    rebuilt from this run's [train] steps and warmup: a run extended with a larger --steps would take
    its first step at the old schedule's rate and its next on the new curve. Stepping back and forward
    once makes the restored step's rate the new schedule's, so the jump (if any) is one the caller sees.
    """
    restored = scheduler.get_last_lr()[0]
    scheduler.last_epoch -= 1
    with warnings.catch_warnings():  # "step() before optimizer.step()": no optimizer step is skipped here
        warnings.simplefilter("ignore")
        scheduler.step()
    return restored, scheduler.get_last_lr()[0]
