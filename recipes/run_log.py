"""The run as a person follows it: one name, one TensorBoard run and one loss curve across resumes.

A resumed run is the same run, so it must log into the same TensorBoard directory and draw its
loss.png from the first step, not from the step it resumed at. Both need what the earlier launches
logged, and the checkpoint is the one place that holds it exactly: each checkpoint's `extra["log"]`
carries the run's name and its losses up to that step (a few bytes per step). A resume from step k
takes that history, and TensorBoard drops what a killed launch wrote past step k (SummaryWriter's
`purge_step`), so the curves show each step once.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from loss_plot import write_loss_plot  # the recipe's own module beside this one

from meshkit import metrics

__all__ = ["LOG_KEY", "RunLog"]

LOG_KEY = "log"


def _name(run: Any, saved: dict[str, Any]) -> str:
    """[train] name, else the resumed run's, else `<preset>-<time>`; rank 0's clock, so every rank agrees."""
    name = run.train.name or saved.get("name") or f"{Path(run.source).stem or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    return name


class RunLog:
    """TensorBoard scalars (rank 0), the loss history and the loss curve of one run, resumes included."""

    def __init__(self, run: Any, resumed_extra: Any, first_step: int, rank: int):
        saved = resumed_extra.get(LOG_KEY, {}) if isinstance(resumed_extra, dict) else {}
        self.name = _name(run, saved)
        self.dir = Path(run.train.log_dir) / self.name
        resumed = first_step > 1 and saved.get("name") == self.name
        self.losses: dict[int, float] = {s: v for s, v in saved.get("losses", {}).items() if s < first_step} \
            if resumed else {}
        self.eval_losses: dict[int, float] = {s: v for s, v in saved.get("eval_losses", {}).items()
                                              if s < first_step} if resumed else {}
        self.tensorboard = metrics.TensorBoardLogger(str(self.dir), rank=rank,
                                                     purge_step=first_step if resumed else None)

    def log(self, step: int, scalars: dict[str, Any], prefix: str = "train/") -> None:
        """TensorBoard scalars at `step`; a training `loss` (or held-out, with prefix "eval/") joins the history."""
        self.tensorboard.log(step, scalars, prefix=prefix)
        if "loss" in scalars:
            (self.eval_losses if prefix == "eval/" else self.losses)[step] = float(scalars["loss"])

    def remember(self, step: int, loss: float) -> None:
        """A training step's loss, into the history before the step's checkpoint is written."""
        self.losses[step] = float(loss)

    def text(self, tag: str, value: str) -> None:
        """A text record in TensorBoard (rank 0)."""
        self.tensorboard.text(tag, value)

    def extra(self) -> dict[str, Any]:
        """What a checkpoint keeps so a resume continues this log."""
        return {"name": self.name, "losses": dict(self.losses), "eval_losses": dict(self.eval_losses)}

    def plot(self, reference: tuple[str, float]) -> Path | None:
        """loss.png of every step of the run so far (rank 0 calls it); None without matplotlib."""
        return write_loss_plot(self.dir / "loss.png", self.losses, self.eval_losses, reference)

    def close(self) -> None:
        """Flush TensorBoard's events."""
        self.tensorboard.close()
