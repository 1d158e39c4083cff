"""A non-finite loss or gradient norm stops the run by default, or skips that optimizer step.

One NaN step poisons every parameter through AdamW, and a run that "completes" with loss nan keeps
saving NaN checkpoints that `--resume` then picks as the newest. The loss and the gradient norm are
global values (identical on every rank), so every rank makes the same decision without
communicating, before `optimizer.step()` touches anything.
"""

from __future__ import annotations

import math


class NonFiniteGuard:
    """`on_nonfinite = "error"`: raise naming the step; `"skip"`: skip the step, count it, say so."""

    def __init__(self, mode: str, rank: int = 0):
        if mode not in ("error", "skip"):
            raise ValueError(f"[train] on_nonfinite={mode!r}: must be error or skip")
        self.mode, self.rank = mode, rank
        self.skipped: list[int] = []

    def allows_step(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether `optimizer.step()` may run after this step's backward."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return True
        bad = [name for name, value in (("loss", loss), ("gradient norm", grad_norm)) if not math.isfinite(value)]
        what = f"{' and '.join(bad)} (loss {loss}, gradient norm {grad_norm})"
        if self.mode == "error":
            raise ValueError(f"step {step}: non-finite {what}; stopped before optimizer.step(), so no parameter, "
                             "optimizer state or checkpoint holds it; fix: a lower --lr or a --clip, check the "
                             "data, resume from the last checkpoint, or --on-nonfinite skip to skip such steps")
        self.skipped.append(step)
        if self.rank == 0:
            print(f"meshkit: step {step}: non-finite {what}; optimizer step skipped "
                  f"({len(self.skipped)} skipped so far)", flush=True)
        return False
