"""Ulysses attention: trade the sequence shard for a head shard, attend locally, trade back.

One all-to-all turns [B, H, S/P, D] on each of P ranks into [B, H/P, S, D]: every rank then holds
whole sequences for a slice of the heads, so the local kernel runs unmodified (causal, document
masks, anything the kernel supports), and a second all-to-all returns the output to the sequence
shard. q, k and v travel in ONE all-to-all (packed per destination rank), likewise their gradients.

Heads must divide: q heads (after tensor parallelism) by the degree P. With GQA the rank that gets
q heads [j*H/P, (j+1)*H/P) must also get the K/V heads they read. When P divides the K/V heads they
split the same way; otherwise each K/V head is replicated the least number of times that makes them
split evenly, P / gcd(Hkv, P) (P/Hkv when Hkv divides P). Replication is the one deliberate exception
to "never repeat K/V before communicating": the bytes moved are the minimum for this algorithm.

The local sequence of a rank is the concatenation of the group's shards in group-rank order, so the
shards must be consecutive pieces of one increasing run of tokens: the contiguous layout, or (in
USP) the contiguous split of one ring rank's zig-zag piece.

The autograd all-to-all (`_compat.all_to_all_autograd`) is `torch.distributed._functional_collectives.all_to_all_single_autograd`
(private, so it lives in meshkit/_compat.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshkit._compat.collectives import all_to_all_autograd
from meshkit.context_parallel.group import as_group
from meshkit.context_parallel.kernels import attention_block


def kv_replication(heads: int, kv_heads: int, degree: int) -> int:
    """How many copies of each K/V head Ulysses needs at this degree; ValueError if impossible."""
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"q heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if heads % degree:
        raise ValueError(
            f"Ulysses degree {degree} must divide the number of q heads per tensor-parallel rank "
            f"({heads}); choose a cp/ulysses degree that divides {heads}, or use ring attention"
        )
    # lcm(kv_heads, degree) divides heads (both divide it), so the replicated heads still group evenly.
    return degree // math.gcd(kv_heads, degree)


def _a2a(x_PX: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Equal-split all-to-all along dim 0 (one slot per rank), differentiable."""
    return all_to_all_autograd(x_PX, group)


def seq_to_heads(
    tensors_BHSD: list[torch.Tensor], group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """Sequence shard -> head shard for several [B, H_i, S/P, D] tensors in one all-to-all."""
    P = dist.get_world_size(group)
    B, _, S_l, D = tensors_BHSD[0].shape
    per_rank = [t.shape[1] // P for t in tensors_BHSD]
    send = torch.cat([t.reshape(B, P, h, S_l, D) for t, h in zip(tensors_BHSD, per_rank)], dim=2)
    recv = _a2a(send.transpose(0, 1), group)  # [P (source = sequence piece), B, sum h, S/P, D]
    full = recv.permute(1, 2, 0, 3, 4).reshape(B, sum(per_rank), P * S_l, D)
    return list(full.split(per_rank, dim=1))


def heads_to_seq(x_BHSD: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Head shard [B, H/P, S, D] -> sequence shard [B, H, S/P, D]."""
    P = dist.get_world_size(group)
    B, h, S, D = x_BHSD.shape
    send = x_BHSD.reshape(B, h, P, S // P, D).permute(2, 0, 1, 3, 4)  # [P (destination piece), ...]
    recv = _a2a(send, group)  # [P (source = head group), B, h, S/P, D]
    return recv.transpose(0, 1).reshape(B, P * h, S // P, D)


def gather_seq(x_BS: torch.Tensor | None, group: dist.ProcessGroup) -> torch.Tensor | None:
    """All ranks' [B, S/P] integer shards concatenated along the sequence (document ids)."""
    if x_BS is None:
        return None
    parts = [torch.empty_like(x_BS) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x_BS.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def check_ulysses(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, degree: int) -> int:
    """Validate Ulysses divisibility for these shapes; return the KV replication factor."""
    if q_BHSD.dim() != 4 or k_BHSD.shape != v_BHSD.shape or k_BHSD.shape[2] != q_BHSD.shape[2]:
        raise ValueError(
            f"Ulysses needs q [B, H, S/P, D] and k, v [B, Hkv, S/P, D] shards; got {tuple(q_BHSD.shape)}, "
            f"{tuple(k_BHSD.shape)}, {tuple(v_BHSD.shape)}"
        )
    return kv_replication(q_BHSD.shape[1], k_BHSD.shape[1], degree)


def scatter_heads(
    q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v sequence shards -> whole-sequence head shards (K/V replicated only as needed)."""
    rep = check_ulysses(q_BHSD, k_BHSD, v_BHSD, dist.get_world_size(group))
    if rep > 1:
        k_BHSD = k_BHSD.repeat_interleave(rep, dim=1)
        v_BHSD = v_BHSD.repeat_interleave(rep, dim=1)
    q_h, k_h, v_h = seq_to_heads([q_BHSD, k_BHSD, v_BHSD], group)
    return q_h, k_h, v_h


def ulysses_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    group: DeviceMesh | dist.ProcessGroup | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    doc_ids_BS: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over the contiguous-layout sequence shards of `group`; returns the local out shard.

    doc_ids_BS: this rank's shard of `sharding.document_ids` (packed sequences), or None.
    """
    if dropout_p:
        raise ValueError(
            f"attention dropout_p={dropout_p} is not supported under context parallelism; set the "
            "model's attention_dropout to 0"
        )
    pg = as_group(group)
    q_h, k_h, v_h = scatter_heads(q_BHSD, k_BHSD, v_BHSD, pg)
    docs_BS = gather_seq(None if doc_ids_BS is None else doc_ids_BS.to(q_BHSD.device), pg)
    out_h, _ = attention_block(
        q_h, k_h, v_h, causal_kind="causal" if causal else "none", scale=scale, q_doc_BS=docs_BS,
        kv_doc_BS=docs_BS, backend=backend,
    )
    return heads_to_seq(out_h, pg)
