"""Cutting a causal LM into pipeline stages, and which stages a rank holds.

The embedding and the norm + LM head are counted as one layer each when balancing, so the first and
last stages get fewer decoder blocks (they also run the embedding lookup and the vocabulary
projection, the costliest single matmul of a small model). Which rank holds which stage is the
schedule's placement (`schedules.stage_placement`): `s % pp` for interleaved 1F1B, the V for ZB-V and
DualPipeV (stages r and 2p-1-r on rank r, so the first and the last stage both live on rank 0).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from meshkit.models import llama


def split_layers(num_layers: int, num_stages: int, boundaries: Sequence[int] | None = None) -> list[range]:
    """Decoder-block index ranges of each stage.

    Balanced by default over `num_layers + 2` units (embedding, blocks, norm+head). `boundaries` are
    explicit first-block indices of stages 1..num_stages-1, strictly increasing; a stage may not be
    empty unless it is the first or last one, which still hold the embedding or the head.
    """
    if num_stages < 1:
        raise ValueError(f"pipeline stages={num_stages}: need at least one stage")
    if boundaries is None:
        units = num_layers + 2
        if units < num_stages:
            raise ValueError(
                f"pp * pp_virtual_stages = {num_stages} stages need at least {num_stages - 2} decoder layers "
                f"(the embedding and the head count as one layer each); the model has {num_layers}; "
                f"fix: use fewer stages"
            )
        cuts = [round(units * s / num_stages) for s in range(num_stages + 1)]
        # Unit u >= 1 is block u - 1; unit 0 is the embedding and unit `units - 1` the head.
        ranges = [range(max(a - 1, 0), min(b - 1, num_layers)) for a, b in zip(cuts, cuts[1:])]
    else:
        bounds = list(boundaries)
        if len(bounds) != num_stages - 1 or any(b <= a for a, b in zip([0, *bounds], [*bounds, num_layers + 1])) \
                or bounds and (bounds[0] < 0 or bounds[-1] > num_layers):
            raise ValueError(
                f"pp_split={bounds}: need {num_stages - 1} strictly increasing first-layer indices in "
                f"[1, {num_layers}] (one per stage after the first); fix: e.g. "
                f"{[r.start for r in split_layers(num_layers, num_stages)[1:]]}"
            )
        starts = [0, *bounds]
        ranges = [range(a, b) for a, b in zip(starts, [*bounds, num_layers])]
    for s, r in enumerate(ranges):
        if len(r) == 0 and 0 < s < num_stages - 1:
            raise ValueError(
                f"pipeline stage {s} of {num_stages} would hold no decoder layer; fix: use fewer stages or "
                f"different split points"
            )
    return ranges


def stages_of_rank(pp_rank: int, placement: Sequence[int]) -> list[int]:
    """Global stage indices held by `pp_rank` under `placement` (stage -> rank), in model order."""
    return [s for s, rank in enumerate(placement) if rank == pp_rank]


def modules_held(parts: llama.CausalLMParts, ranges: Sequence[range], stage_ids: Sequence[int]) -> list[nn.Module]:
    """Blocks, embedding, norm and head of this rank's stages (the rotary embedding every stage shares)."""
    mine = {i for s in stage_ids for i in ranges[s]}
    last = len(ranges) - 1
    held: list[nn.Module] = [parts.rotary] + [b for i, b in enumerate(parts.blocks) if i in mine]
    if 0 in stage_ids:
        held.append(parts.embed)
    if last in stage_ids:
        held += [parts.norm, parts.lm_head]
    return held


def modules_not_held(parts: llama.CausalLMParts, ranges: Sequence[range], stage_ids: Sequence[int]) -> list[nn.Module]:
    """Blocks, embedding, norm and head of other ranks' stages (freed by moving them to meta)."""
    held = {id(m) for m in modules_held(parts, ranges, stage_ids)}
    everything = [*parts.blocks, parts.embed, parts.norm, parts.lm_head]
    return [m for m in everything if id(m) not in held]
