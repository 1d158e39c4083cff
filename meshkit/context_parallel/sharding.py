"""Which tokens of a sequence each context-parallel rank holds.

Everything that is sharded along the sequence (input ids, shifted labels, position ids, document ids,
and the attention inputs) must go through the same index map, or RoPE and the causal mask silently
disagree with the tokens. This module is that one map, expressed as the global token indices each
rank holds (`shard_indices`); `shard` and `unshard` are a gather and its inverse over it.

Layouts:

* ``"contiguous"``: rank r holds tokens ``[r*S/cp, (r+1)*S/cp)``. Plain ring and Ulysses use it. Under
  causal masking rank cp-1 does cp times the work of rank 0.
* ``"zigzag"``: the sequence is cut into ``2*R`` chunks (R = ring degree) and ring rank r holds chunks
  r and 2R-1-r, which balances causal work across ranks at every ring step (see ring.py). With a
  Ulysses degree U inside the cp group (2D "USP" attention, cp = R*U, cp rank = ring_rank*U +
  ulysses_rank), each ring rank's two chunks are further split contiguously over its U Ulysses
  ranks, so that the Ulysses all-to-all reassembles exactly the zig-zag piece of the ring rank.

In both layouts a rank's local tokens are in increasing global order, which is what lets a square
causal mask on the local diagonal block be exact.

Packed sequences follow Hugging Face's convention: a document starts wherever the position ids do not
continue by +1 (typically a restart at 0). `document_ids` must run on the *full* sequence, before
sharding, because a boundary can fall exactly on a shard edge.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")


def _check_degrees(layout: str, cp: int, ulysses: int) -> int:
    """Validate the layout and degrees; return the ring degree."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not a context-parallel layout; use one of {LAYOUTS}")
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    if ulysses < 1 or cp % ulysses:
        raise ValueError(f"ulysses={ulysses} must divide cp={cp} (cp = ring degree * ulysses degree)")
    return cp // ulysses


def required_multiple(layout: Layout, cp: int, *, ulysses: int = 1) -> int:
    """The number the (global) sequence length must be a multiple of for this layout.

    contiguous: cp. zigzag: every ring rank holds two equal chunks (S % 2R == 0) which its U Ulysses
    ranks split evenly (S % (R*U) == 0), i.e. R * lcm(2, U).
    """
    ring = _check_degrees(layout, cp, ulysses)
    if layout == "contiguous":
        return cp
    return ring * math.lcm(2, ulysses)


def check_seq_len(seq_len: int, layout: Layout, cp: int, *, ulysses: int = 1) -> None:
    """Raise a ValueError naming the needed multiple when `seq_len` cannot be sharded."""
    multiple = required_multiple(layout, cp, ulysses=ulysses)
    if seq_len % multiple:
        padded = -(-seq_len // multiple) * multiple
        raise ValueError(
            f"sequence length {seq_len} is not divisible by {multiple}, which the {layout!r} layout "
            f"needs for cp={cp}" + (f" with ulysses={ulysses}" if ulysses > 1 else "")
            + f"; pad the sequence to a multiple of {multiple} (e.g. {padded})"
        )


def shard_indices(
    seq_len: int, layout: Layout, cp: int, rank: int, *, ulysses: int = 1, device=None
) -> torch.Tensor:
    """Global token indices held by cp rank `rank`, in local order (int64, increasing)."""
    check_seq_len(seq_len, layout, cp, ulysses=ulysses)
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} is outside the cp group of size {cp}")
    if layout == "contiguous":
        n = seq_len // cp
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    ring = cp // ulysses
    ring_rank, inner_rank = divmod(rank, ulysses)
    chunk = seq_len // (2 * ring)
    far = 2 * ring - 1 - ring_rank
    piece = torch.cat(
        [
            torch.arange(ring_rank * chunk, (ring_rank + 1) * chunk, device=device),
            torch.arange(far * chunk, (far + 1) * chunk, device=device),
        ]
    )
    return piece.view(ulysses, -1)[inner_rank]


def shard(
    x: torch.Tensor, layout: Layout, cp: int, rank: int, *, dim: int = 1, ulysses: int = 1
) -> torch.Tensor:
    """The part of `x` (full sequence along `dim`) that cp rank `rank` holds."""
    idx = shard_indices(x.shape[dim], layout, cp, rank, ulysses=ulysses, device=x.device)
    return x.index_select(dim, idx)


def unshard(
    shards: Sequence[torch.Tensor], layout: Layout, *, dim: int = 1, ulysses: int = 1
) -> torch.Tensor:
    """Reassemble the full sequence from every rank's shard (in cp-rank order); inverse of `shard`."""
    cp = len(shards)
    if cp == 0:
        raise ValueError("unshard needs at least one shard")
    local = shards[0].shape[dim]
    if any(s.shape[dim] != local for s in shards):
        raise ValueError(f"shards differ in size along dim {dim}: {[s.shape[dim] for s in shards]}")
    seq_len = local * cp
    order = torch.cat(
        [shard_indices(seq_len, layout, cp, r, ulysses=ulysses) for r in range(cp)]
    ).to(shards[0].device)
    return torch.cat(list(shards), dim=dim).index_select(dim, torch.argsort(order))


def position_ids(
    seq_len: int, layout: Layout, cp: int, rank: int, *, ulysses: int = 1, device=None
) -> torch.Tensor:
    """RoPE position ids of the local tokens of an unpacked sequence, shape [S_local]."""
    return shard_indices(seq_len, layout, cp, rank, ulysses=ulysses, device=device)


def document_ids(position_ids_BS: torch.Tensor) -> torch.Tensor:
    """Document index of every token of packed sequences, from FULL (unsharded) position ids.

    A new document starts wherever the position ids do not continue by +1; this is Hugging Face's
    rule (`find_packed_sequence_indices`), so the block-diagonal mask matches the single-device model.
    Returns int64 [B, S] with 0 for the first document of each row.
    """
    if position_ids_BS.dim() != 2:
        raise ValueError(f"position_ids must be [batch, seq], got shape {tuple(position_ids_BS.shape)}")
    first = position_ids_BS[:, :1] - 1
    step = torch.diff(position_ids_BS, prepend=first, dim=-1)
    return (step != 1).cumsum(-1)


def shard_packed(
    position_ids_BS: torch.Tensor, layout: Layout, cp: int, rank: int, *, ulysses: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local (position ids, document ids) of packed sequences, both [B, S_local].

    Document ids are computed on the full rows first: computing them on a shard would miss a boundary
    that coincides with the shard's first token and would number documents differently per rank.
    """
    docs_BS = document_ids(position_ids_BS)
    return (
        shard(position_ids_BS, layout, cp, rank, ulysses=ulysses),
        shard(docs_BS, layout, cp, rank, ulysses=ulysses),
    )
