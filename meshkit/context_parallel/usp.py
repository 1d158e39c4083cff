"""2D context parallelism (USP): Ulysses inside, zig-zag ring (or all-gather K/V) outside.

The cp group of size R*U is viewed as R ring ranks of U Ulysses ranks each; cp rank = ring_rank*U +
ulysses_rank (Ulysses innermost, on the fastest links, since its all-to-alls are latency-bound and
cannot overlap with compute, while ring steps overlap their transfers with the kernel).

The sequence is laid out by `sharding.shard(..., layout="zigzag", ulysses=U)`: zig-zag over the R
ring ranks, each ring rank's two chunks split contiguously over its U Ulysses ranks. The Ulysses
all-to-all then reassembles a ring rank's full zig-zag piece for H/U heads, the ring runs over the R
ring ranks exactly as in ring.py (zig-zag defined over the ring degree only), and a second
all-to-all brings the output back to the sequence shard.

The outer kind is the zig-zag ring by default; `outer="allgather"` gathers the ring ranks' K/V
instead (allgather.py, same zig-zag layout over the outer degree): `Plan(cp_attention="allgather",
cp_ulysses=U)`.

Head rule: q heads divisible by U (K/V heads replicated by Ulysses only as far as needed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshkit.context_parallel.allgather import allgather_attention
from meshkit.context_parallel.group import as_group
from meshkit.context_parallel.ring import ring_attention
from meshkit.context_parallel.sharding import Layout
from meshkit.context_parallel.ulysses import gather_seq, heads_to_seq, scatter_heads


def usp_group_ranks(cp_ranks: list[int], ulysses: int) -> tuple[list[list[int]], list[list[int]]]:
    """The (Ulysses groups, ring groups) of a cp group's global ranks, in the convention above.

    Every rank must create every group (`dist.new_group` is collective), so both lists are complete.
    """
    cp = len(cp_ranks)
    if ulysses < 1 or cp % ulysses:
        raise ValueError(f"cp_ulysses={ulysses} must divide cp={cp}")
    ring = cp // ulysses
    inner = [[cp_ranks[r * ulysses + u] for u in range(ulysses)] for r in range(ring)]
    outer = [[cp_ranks[r * ulysses + u] for r in range(ring)] for u in range(ulysses)]
    return inner, outer


def usp_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    ulysses_group: DeviceMesh | dist.ProcessGroup,
    ring_group: DeviceMesh | dist.ProcessGroup,
    *,
    causal: bool = True,
    layout: Layout = "zigzag",
    scale: float | None = None,
    doc_ids_BS: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    outer: str = "ring",
    grad_dtype: torch.dtype | None = None,
    sinks_H: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Local out shard of 2D (Ulysses x ring) attention; inputs sharded with `ulysses=U`.

    outer: "ring" (zig-zag ring over the outer ranks) or "allgather" (K/V gathered over them).
    grad_dtype: the dtype the outer kind sends dK/dV in (None: fp32). sinks_H: per-head attention
    sinks of the local query heads; after the all-to-all each rank keeps its heads' sinks. softcap,
    window: as in `ring_attention` (the outer kind applies them; the window's positions are the
    ring rank's zig-zag piece, which the all-to-all reassembled).
    """
    if outer not in ("ring", "allgather"):
        raise ValueError(f"outer={outer!r}: USP's outer kind is 'ring' or 'allgather'")
    if outer == "allgather" and layout != "zigzag":
        raise ValueError(f"outer='allgather' needs the zigzag layout, got layout={layout!r}")
    if dropout_p:
        raise ValueError(
            f"attention dropout_p={dropout_p} is not supported under context parallelism; set the "
            "model's attention_dropout to 0"
        )
    inner, outer_group = as_group(ulysses_group), as_group(ring_group)
    q_h, k_h, v_h = scatter_heads(q_BHSD, k_BHSD, v_BHSD, inner)
    docs = gather_seq(doc_ids_BS, inner)
    if sinks_H is not None:  # the heads this rank holds after the all-to-all, and their sinks
        heads = q_h.shape[1]
        start = dist.get_rank(inner) * heads
        sinks_H = sinks_H[start:start + heads]
    if outer == "allgather":
        out_h = allgather_attention(q_h, k_h, v_h, outer_group, causal=causal, scale=scale, doc_ids_BS=docs,
                                    backend=backend, grad_dtype=grad_dtype, sinks_H=sinks_H, softcap=softcap,
                                    window=window)
    else:
        out_h = ring_attention(q_h, k_h, v_h, outer_group, causal=causal, layout=layout, scale=scale,
                               doc_ids_BS=docs, backend=backend, grad_dtype=grad_dtype, sinks_H=sinks_H,
                               softcap=softcap, window=window)
    return heads_to_seq(out_h, inner)
