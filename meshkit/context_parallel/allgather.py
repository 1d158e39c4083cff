"""All-gather context parallelism: gather K/V once per layer, reduce-scatter dK/dV once.

The ring trades bytes for memory: it never holds more than two K/V blocks, but K/V go round twice
(forward and backward) and dK/dV a full turn, (3cp-2) block messages per layer against the (2cp-2)
blocks' worth of one all-gather and one reduce-scatter here. Holding the whole sequence's K/V costs
S * Hkv * D * 2 elements per layer, small next to the queries under GQA, which is why Llama 3 trained
with this scheme and Megatron offers it (`cp_comm_type="all_gather"`).

Forward: one all-gather of this rank's packed [K; V] shard, put back in global token order (the
zig-zag layout: rank r holds chunks r and 2cp-1-r). Each local query chunk g then attends to the
key prefix [0, g*c) fully and to its own chunk [g*c, (g+1)*c) causally (square, so SDPA's top-left
aligned causal mask is exact); the two (out, lse) merge in fp32 (`ring.merge_`). The causal
diagonals read only local K/V, so they run while the gather is in flight. Chunk r sees r + 1/2
chunks of keys and chunk 2cp-1-r sees 2cp-1-r + 1/2: 2cp chunk-squares on every rank, the zig-zag
balance. Non-causal attention is one block over every key.

Backward: the gathered K/V are kept from forward (no second all-gather); every block is
differentiated against the final out and lse, dQ accumulates locally and dK/dV of the whole sequence
in one fp32 buffer, which one reduce-scatter in `grad_dtype` (the plan's `reduce_dtype`) returns to
the owners, each rank summing in fp32 after the transfer.

Packed documents: the int document ids of every rank are all-gathered with the same reordering, and
each block adds its block-diagonal mask.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh

from meshkit._compat.collectives import all_gather_single, reduce_scatter_single
from meshkit.context_parallel.group import as_group
from meshkit.context_parallel.kernels import attention_backward, attention_forward, default_scale
from meshkit.context_parallel.ring import add_sinks_, check_sinks, merge_, sink_grad
from meshkit.context_parallel.scores import ScoreMods, acc_dtype
from meshkit.context_parallel.sharding import shard_indices


def allgather_blocks(cp: int, rank: int, seq_local: int, causal: bool,
                     window: int | None = None) -> list[tuple[slice, slice, str]]:
    """(local query slice, global key slice, causal kind) of every kernel call `rank` makes.

    One list for forward and backward and for the work counter in the tests, so the balance that is
    checked is the plan that runs. A sliding `window` trims each key prefix to the keys its chunk's
    first query can still see (the kernel's band mask does the rest).
    """
    if not causal:
        return [(slice(0, seq_local), slice(0, seq_local * cp), "none")]
    c = seq_local // 2
    blocks = []
    for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        q = slice(half * c, (half + 1) * c)
        start = max(0, chunk * c - window + 1) if window else 0
        if start < chunk * c:
            blocks.append((q, slice(start, chunk * c), "none"))
        blocks.append((q, slice(chunk * c, (chunk + 1) * c), "causal"))
    return blocks


def _global_order(seq_local: int, cp: int, device) -> torch.Tensor:
    """Index that puts the cp-rank-ordered concatenation of zig-zag shards into token order."""
    seq = seq_local * cp
    order = torch.cat([shard_indices(seq, "zigzag", cp, r) for r in range(cp)])
    return torch.argsort(order).to(device)


def _post_gather(x: torch.Tensor, group: dist.ProcessGroup, cp: int):
    """Start gathering every rank's `x` (concatenated on a new leading cp-rank dim); (buffer, work)."""
    parts = torch.empty((cp * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    return parts, all_gather_single(parts, x.contiguous(), group, async_op=True)


def _in_order(pending, x_shape, cp: int, perm: torch.Tensor, dim: int) -> torch.Tensor:
    """Wait for a gather; the ranks' shards along `dim`, put in global token order."""
    parts, work = pending
    work.wait()
    joined = parts.unflatten(0, (cp, x_shape[0])).movedim(0, dim).flatten(dim, dim + 1)  # cp-rank order
    return joined.index_select(dim, perm)


def _block(doc_full_BS, doc_BS, mods: ScoreMods, q_pos_S: torch.Tensor, q: slice, k: slice, kind: str) -> dict:
    """Keywords of `attention_forward` / `attention_backward` for queries `q` (local) and keys `k`
    (global order): causal kind, documents, soft-cap and window."""
    docs = (None, None) if doc_BS is None else (doc_BS[:, q], doc_full_BS[:, k])
    pos = (q_pos_S[q], torch.arange(k.start, k.stop)) if mods.window else (None, None)
    return dict(causal_kind=kind, q_doc_BS=docs[0], kv_doc_BS=docs[1], **mods.block(*pos))


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHSD, k_BHSD, v_BHSD, group, causal, scale, doc_BS, backend, grad_dtype, sinks_H, mods):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        S_l = q_BHSD.shape[2]
        q_pos = shard_indices(S_l * cp, "zigzag", cp, rank)
        perm = _global_order(S_l, cp, q_BHSD.device)
        kv = torch.stack([k_BHSD, v_BHSD])
        kv_pending = _post_gather(kv, group, cp)
        doc_full = None if doc_BS is None else _in_order(_post_gather(doc_BS, group, cp), doc_BS.shape, cp, perm, 1)
        acc = acc_dtype(q_BHSD.dtype)
        out_BHSD = torch.zeros(q_BHSD.shape, dtype=acc, device=q_BHSD.device)
        lse_BHS = torch.full(q_BHSD.shape[:3], -math.inf, dtype=acc, device=q_BHSD.device)
        blocks = allgather_blocks(cp, rank, S_l, causal, mods.window)
        # The causal diagonals need only this rank's own K/V: computed while the gather is in flight.
        local_first = sorted(blocks, key=lambda b: b[2] != "causal")
        kv_full = None
        for qs, ks, kind in local_first:
            if kind == "causal":
                k_i, v_i = kv[0][:, :, qs], kv[1][:, :, qs]
            else:
                if kv_full is None:
                    kv_full = _in_order(kv_pending, kv.shape, cp, perm, 3)  # [2, B, Hkv, S, D]
                k_i, v_i = kv_full[0][:, :, ks], kv_full[1][:, :, ks]
            o_i, lse_i = attention_forward(q_BHSD[:, :, qs], k_i, v_i, scale=scale, backend=backend,
                                           **_block(doc_full, doc_BS, mods, q_pos, qs, ks, kind))
            merge_(out_BHSD[:, :, qs], lse_BHS[:, :, qs], o_i, lse_i)
        if kv_full is None:
            kv_full = _in_order(kv_pending, kv.shape, cp, perm, 3)
        lse_BHS = add_sinks_(out_BHSD, lse_BHS, sinks_H)  # as in ring.py: once, after every block
        out = out_BHSD.to(q_BHSD.dtype)
        ctx.save_for_backward(q_BHSD, kv_full, out, lse_BHS)
        ctx.opts = (group, blocks, scale, backend, doc_full, doc_BS, perm, grad_dtype, mods, q_pos)
        ctx.sinks = sinks_H
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout_BHSD):
        q_BHSD, kv_full, out_BHSD, lse_BHS = ctx.saved_tensors
        group, blocks, scale, backend, doc_full, doc_BS, perm, grad_dtype, mods, q_pos = ctx.opts
        cp = dist.get_world_size(group)
        acc = acc_dtype(q_BHSD.dtype)
        dq_BHSD = torch.zeros(q_BHSD.shape, dtype=acc, device=q_BHSD.device)
        dkv_full = torch.zeros(kv_full.shape, dtype=acc, device=kv_full.device)
        for qs, ks, kind in blocks:
            dq_i, dk_i, dv_i = attention_backward(
                dout_BHSD[:, :, qs], q_BHSD[:, :, qs], kv_full[0][:, :, ks], kv_full[1][:, :, ks],
                out_BHSD[:, :, qs], lse_BHS[:, :, qs], scale=scale, backend=backend,
                **_block(doc_full, doc_BS, mods, q_pos, qs, ks, kind),
            )
            dq_BHSD[:, :, qs].add_(dq_i)
            dkv_full[0][:, :, ks].add_(dk_i)
            dkv_full[1][:, :, ks].add_(dv_i)
        # Back to cp-rank order, one [2, B, Hkv, S/cp, D] slot per rank, sent in the reduce dtype.
        S_l = q_BHSD.shape[2]
        by_rank = torch.empty_like(dkv_full).index_copy_(3, perm, dkv_full)
        send = by_rank.unflatten(3, (cp, S_l)).movedim(3, 0).to(grad_dtype or acc).contiguous()
        recv = torch.empty(send.shape[1:], dtype=send.dtype, device=send.device)
        reduce_scatter_single(recv, send.flatten(0, 1), group)
        return (
            dq_BHSD.to(q_BHSD.dtype), recv[0].to(kv_full.dtype), recv[1].to(kv_full.dtype),
            None, None, None, None, None, None, sink_grad(ctx.sinks, dout_BHSD, out_BHSD, lse_BHS), None,
        )


def allgather_attention(
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
    grad_dtype: torch.dtype | None = None,
    sinks_H: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the local query shard against the whole sequence's K/V, gathered; returns local out.

    Inputs are this rank's zig-zag shard (`sharding.shard(..., "zigzag", ...)`), K/V with their own
    GQA head count, never repeated. grad_dtype: the dtype dK/dV travel in (None: fp32, the
    accumulator's); the owner sums in fp32 either way. sinks_H: per-head attention sinks (gpt-oss),
    added after the merge as in `ring_attention`; softcap and window as in `ring_attention`.
    """
    mods = ScoreMods(softcap, window).checked(causal)
    if dropout_p:
        raise ValueError(
            f"attention dropout_p={dropout_p} is not supported under context parallelism; set the "
            "model's attention_dropout to 0"
        )
    pg = as_group(group)
    S = q_BHSD.shape[2]
    if k_BHSD.shape[2] != S or v_BHSD.shape != k_BHSD.shape:
        raise ValueError(
            f"all-gather attention needs q, k, v shards of equal length; got q {tuple(q_BHSD.shape)}, "
            f"k {tuple(k_BHSD.shape)}, v {tuple(v_BHSD.shape)}"
        )
    if S % 2:
        raise ValueError(
            f"the all-gather kind uses the zigzag layout (two equal chunks per rank), but the local sequence "
            f"length is {S}; the global length must be a multiple of 2*cp = {2 * dist.get_world_size(pg)}"
        )
    scale = default_scale(q_BHSD.shape[-1]) if scale is None else float(scale)
    if doc_ids_BS is not None:
        doc_ids_BS = doc_ids_BS.to(q_BHSD.device)
    check_sinks(sinks_H, q_BHSD)
    return _AllGatherAttention.apply(q_BHSD, k_BHSD, v_BHSD, pg, causal, scale, doc_ids_BS, backend, grad_dtype,
                                     sinks_H, mods)
