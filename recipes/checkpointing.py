"""The recipe's checkpoint policy: which checkpoint to resume, where a run may save, what to keep.

One command serves the first launch and every restart (`--resume auto`): the newest checkpoint under
`save_dir` that verifies resumes, older ones are tried when newer ones are damaged (a warning names
what was wrong), and with none at all the run starts fresh. A run never mixes its checkpoints with
another run's: a fresh run into a `save_dir` holding checkpoints, or a resumed run that would save
over newer checkpoints of its own (`--load-step` an older one), is refused unless `--overwrite`
says to delete them. Verifying reads every byte, so rank 0 decides and broadcasts the decision.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import meshkit
from meshkit.state import checkpoint, manifest, retention
from meshkit.state.async_checkpoint import AsyncCheckpointer

AUTO = "auto"


@dataclass
class Decision:
    """Rank 0's resolution of the resume settings, broadcast to every rank."""

    path: str | None = None  # the checkpoint to load, or None for a fresh start
    step: int = 0
    run_id: str = ""
    notes: list[str] = field(default_factory=list)  # printed by rank 0: warnings, deletions
    error: str | None = None
    delete: list[str] = field(default_factory=list)  # --overwrite: checkpoints rank 0 deletes


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
            for note in self.decision.notes:
                print(f"meshkit: {note}", flush=True)
            for path in self.decision.delete:
                retention.remove(path)
        self.saver = AsyncCheckpointer() if cfg.async_save and cfg.save_every else None
        self.resumed_extra: Any = None

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
            self.pm.save_checkpoint(path, optimizer, **kwargs)
            self._retain()
        else:
            if self.saver.wait() is not None:  # the previous save is complete: prune now
                self._retain()
            self.saver.save(path, self.pm, optimizer, **kwargs)
        return time.perf_counter() - start

    def close(self) -> None:
        """Finish a save in flight (collective) and apply retention to it."""
        if self.saver is not None:
            done = self.saver.wait()
            self.saver.close()
            if done is not None:
                self._retain()

    def _retain(self) -> None:
        if self.rank == 0 and self.cfg.keep_last:
            for path in retention.prune(self.cfg.save_dir, self.cfg.keep_last):
                print(f"meshkit: keep_last={self.cfg.keep_last}: deleted {path}", flush=True)
