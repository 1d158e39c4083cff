"""DualPipe (DeepSeek-V3's report, section 3.2.1): two pipelines over the same ranks, in opposite directions.

The model is cut into p chunks. Rank r holds chunk r of the downward pipeline and chunk p-1-r of the
upward one, so every chunk exists twice, on the mirror pair (r, p-1-r): parameter and optimizer
memory per rank are 2x 1F1B's, as the report states. Half the microbatches enter at rank 0 and flow
down, half enter at rank p-1 and flow up; each rank's steady phase pairs a forward chunk of one
direction with a full backward chunk of the other, and the B/W split fills the warm-up and the
drain with deferred weight gradients. The two copies of a chunk see different microbatches, so their
gradients are partial sums: the mirror pair all-reduces them once per step, after which both copies
hold the gradient of the whole batch and the optimizer steps them identically (`step.grad_sync`).

As data: `Schedule(pipelines=2)` with 2p stages, stage s < p the down pipeline's chunk s on rank s,
stage p + k the up pipeline's chunk k on rank p-1-k (the V placement's ranks: `v_placement`), and
microbatches [0, m/2) down, [m/2, m) up. `mirrored_chunks` says which chunk of layers each stage runs.

Why the order is DualPipeV's ("cut-in-half", Sea AI Lab): fold the ranks at the middle, rank r onto
rank p-1-r, and each direction's chain of p chunks becomes a V over p/2 ranks. DeepSeek's own
DualPipe runs on rank r exactly DualPipeV's phases for rank min(r, p-1-r) of p/2 with m/2
microbatches, its first pipeline in the role of the V's down stage (the down pipeline on the first
half of the ranks, the up pipeline on the second half). So that is what is emitted here, mirrored,
and the timeline at zero P2P latency is DualPipeV's on p/2 ranks, mirrored onto p.
"""

from __future__ import annotations

from meshkit.pipeline.actions import Action, Schedule, schedule_sizes, with_communication
from meshkit.pipeline.v_shape import dualpipe_v_order

DUALPIPE = "dualpipe"


def mirrored_chunks(pp: int) -> tuple[int, ...]:
    """The chunk of layers (of p) each of DualPipe's 2p stages runs: s mod p (each chunk twice)."""
    return tuple(s % pp for s in range(2 * pp))


def min_microbatches(pp: int) -> int:
    """The fewest microbatches DualPipe runs with: an even number (half enter at each end) of at least
    2(pp-1), where the folded DualPipeV order (m/2 >= pp/2 * 2 - 1) is still valid (`simulate.check`
    proves every size from there on; DeepSeek's implementation asks for 2*pp)."""
    return max(2, 2 * (pp - 1))


def dualpipe_problem(pp: int, microbatches: int) -> str | None:
    """Why DualPipe cannot run `microbatches` on `pp` ranks, with the fix; None if it can."""
    if pp % 2:
        return (f"pp={pp}: DualPipe pairs rank r with rank pp-1-r (both hold the same two chunks), so pp must be "
                f"even; fix: pp={pp + 1} or pp={max(pp - 1, 2)}, or pp_schedule='dualpipe_v'")
    low = min_microbatches(pp)
    if microbatches < low or microbatches % 2:
        fix = max(low, microbatches + microbatches % 2)
        return (f"pp_microbatches={microbatches}: DualPipe feeds half the microbatches in at each end, so it needs "
                f"an even number, at least 2*(pp-1)={low} at pp={pp}; fix: pp_microbatches={fix}")
    return None


def dualpipe(pp: int, microbatches: int) -> Schedule:
    """DualPipe on `pp` ranks (even) with `microbatches` (even, >= 2(pp-1)): see the module docstring.

    Rank r (h = min(r, p-1-r)) runs DualPipeV's order for rank h of p/2 with m/2 microbatches; the
    V's down stage is rank r's first pipeline's chunk (down on the first half of the ranks, up on the
    second), the V's up stage its other chunk, so rank r and rank p-1-r run mirror images.
    """
    pp, m = schedule_sizes(pp, microbatches)
    problem = dualpipe_problem(pp, m)
    if problem:
        raise ValueError(problem)
    return unchecked(pp, m)


def unchecked(pp: int, m: int) -> Schedule:
    """`dualpipe` without the size rules (even pp and m assumed): what the rules are proved against."""
    half_ranks, half = pp // 2, m // 2
    folded = [dualpipe_v_order(half_ranks, half, h) for h in range(half_ranks)]
    ranks = []
    for r in range(pp):
        h = min(r, pp - 1 - r)
        down, up = (r, 0), (2 * pp - 1 - r, half)  # (stage, first microbatch) of each of rank r's chunks
        first, second = (down, up) if r < half_ranks else (up, down)
        where = {h: first, 2 * half_ranks - 1 - h: second}  # the V's down and up stage on rank h
        ranks.append(tuple(Action(a.kind, where[a.stage][0], a.microbatch + where[a.stage][1]) for a in folded[h]))
    return with_communication(Schedule(tuple(ranks), 2 * pp, m, DUALPIPE, pipelines=2))


__all__ = ["DUALPIPE", "dualpipe", "dualpipe_problem", "min_microbatches", "mirrored_chunks", "unchecked"]
