"""The run's loss curve as one PNG beside its TensorBoard events, written by rank 0 at the end.

Why a picture as well as the summary line: the line gives the first and last loss, but whether the
loss is still falling, has flattened at the reference (the corpus's unigram entropy, or the Markov
chain's floor), or whether the held-out loss has started to rise against the training loss is a shape,
and a PNG opens anywhere, without a TensorBoard server. matplotlib is optional (the `dev` extra):
without it the recipe says so and writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

__all__ = ["write_loss_plot"]


def write_loss_plot(path: str | Path, train: Mapping[int, float], held_out: Mapping[int, float],
                    reference: tuple[str, float]) -> Path | None:
    """Training loss per step, held-out loss at its evaluations and the reference level, as a PNG.

    Returns the path written, or None when matplotlib is missing.
    """
    try:
        from matplotlib.figure import Figure  # optional dependency: only this chart needs it
    except ImportError:
        return None
    figure = Figure(figsize=(7, 4), layout="constrained")
    axes = figure.add_subplot()
    steps = sorted(train)
    axes.plot(steps, [train[s] for s in steps], label="training loss (global batch)", color="tab:blue")
    if held_out:
        evals = sorted(held_out)
        axes.plot(evals, [held_out[s] for s in evals], "o-", label="held-out loss", color="tab:orange")
    name, level = reference
    axes.axhline(level, linestyle="--", color="grey", label=f"{name} {level:.4f}")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats per token)")
    axes.grid(alpha=0.3)
    axes.legend()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path
