"""Which ranks of a world to simulate: one of every distinct role.

Ranks differ by what they hold and send: their pipeline rank (the first stage holds the embedding
and the most in-flight microbatches, the last the head and the loss, a middle one neither; under a
V schedule rank 0 holds both ends), and, between ranks of one pipeline rank, only by a row per
tensor where a dimension does not split evenly (TP and FSDP chunks: index 0 holds the largest) and
by the routing, which the dry run balances. Expert parallelism folds over the data ranks, so every
rank of an MoE model holds experts; which blocks are dense is again a matter of the pipeline rank.
"""

from __future__ import annotations

from meshkit.mesh import AXES
from meshkit.plan import Plan


def global_rank(plan: Plan, coords: dict[str, int]) -> int:
    """The global rank at mesh coordinates `coords` (axes missing from it at 0; tp innermost)."""
    rank = 0
    for name in AXES:
        rank = rank * getattr(plan, name) + coords.get(name, 0)
    return rank


def default_ranks(plan: Plan) -> list[int]:
    """The first, middle and last pipeline rank (each at index 0 on every other axis, the largest
    shards); one rank without pipelining."""
    pp = plan.pp
    return [global_rank(plan, {"pp": p}) for p in sorted({0, pp // 2, pp - 1})]
