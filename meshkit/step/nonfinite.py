"""A non-finite loss or gradient norm stops the run by default, or skips that optimizer step, within limits.

One NaN step poisons every parameter through AdamW, and a run that "completes" with loss nan keeps
saving NaN checkpoints that a resume then picks as the newest. `pm.forward_backward`'s loss and
`pm.clip_grad_norm_`'s norm are global values (identical on every rank), so every rank reaches the
same decision without communicating, before `optimizer.step()` touches anything.

Skipping is for rare spikes, not for a run that has diverged: `max_consecutive` non-finite steps in a
row, or `max_total` in one launch, end the run with the same ValueError on every rank instead of
letting it skip nearly every step and exit 0.
"""

from __future__ import annotations

import math

import torch.distributed as dist

__all__ = ["MODES", "NonFiniteGuard"]

MODES = ("error", "skip")


class NonFiniteGuard:
    """`mode="error"`: raise naming the step; `"skip"`: skip the step, count it, say so (rank 0), and
    raise once `max_consecutive` steps in a row or `max_total` steps in all were skipped (0: no limit).

    `names` are what the limits are called in the caller's configuration, for the error message.
    """

    def __init__(self, mode: str = "error", *, max_consecutive: int = 5, max_total: int = 100, rank: int | None = None,
                 names: tuple[str, str] = ("max_consecutive", "max_total")):
        if mode not in MODES:
            raise ValueError(f"on_nonfinite={mode!r}: must be one of {', '.join(MODES)}")
        for name, value in zip(names, (max_consecutive, max_total)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}: must be an integer >= 0 (0: no limit)")
        self.mode, self.max_consecutive, self.max_total, self.names = mode, max_consecutive, max_total, names
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self.skipped: list[int] = []
        self.consecutive = 0

    def allows_step(self, step: int, loss: float, grad_norm: float) -> bool:
        """Whether `optimizer.step()` may run after this step's backward; both values must be the
        rank-identical global ones (pm's loss and gradient norm are)."""
        loss, grad_norm = float(loss), float(grad_norm)
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.consecutive = 0
            return True
        bad = [name for name, value in (("loss", loss), ("gradient norm", grad_norm)) if not math.isfinite(value)]
        what = f"{' and '.join(bad)} (loss {loss}, gradient norm {grad_norm})"
        if self.mode == "error":
            raise ValueError(f"step {step}: non-finite {what}; stopped before optimizer.step(), so no parameter, "
                             "optimizer state or checkpoint holds it; fix: a lower --lr or a --clip, check the "
                             "data, resume from the last checkpoint, or --on-nonfinite skip to skip such steps")
        self.skipped.append(step)
        self.consecutive += 1
        over = self._over_limit()
        if over:
            raise ValueError(f"step {step}: non-finite {what}, {over}: the run is diverging, not spiking; stopped "
                             f"before optimizer.step() (skipped steps: {_steps(self.skipped)}); fix: a lower --lr "
                             "or a --clip, check the data, resume from the last checkpoint, or raise the limit")
        if self.rank == 0:
            print(f"meshkit: step {step}: non-finite {what}; optimizer step skipped "
                  f"({len(self.skipped)} skipped so far, {self.consecutive} in a row)", flush=True)
        return False

    def _over_limit(self) -> str | None:
        if self.max_consecutive and self.consecutive > self.max_consecutive:
            return f"{self.consecutive} in a row ({self.names[0]}={self.max_consecutive})"
        if self.max_total and len(self.skipped) > self.max_total:
            return f"{len(self.skipped)} in this launch ({self.names[1]}={self.max_total})"
        return None

    def summary(self) -> str:
        """One phrase for a run's closing line: how many steps were skipped, and which."""
        return f"skipped {len(self.skipped)} non-finite step(s): {_steps(self.skipped)}" if self.skipped else ""


def _steps(steps: list[int], n: int = 10) -> str:
    shown = ", ".join(map(str, steps[:n]))
    return shown + (f", ... ({len(steps) - n} more)" if len(steps) > n else "")
