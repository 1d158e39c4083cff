"""Ring attention (plain and zig-zag) as one autograd Function over a 1D cp process group.

Each rank keeps its queries and passes its K/V block around the ring; after cp steps every query has
met every key, and no rank ever holds more than two K/V blocks (never the full sequence).

Forward, per step: post the exchange for the next step (K and V packed into one buffer, one
`batch_isend_irecv`), run the local kernel on the block in hand while the bytes move, then merge the
block's (out, lse) into fp32 accumulators with the stable sigmoid/logsigmoid form (`merge_`).
cp-1 exchanges in total.

Backward: only the local q, k, v and the final out and lse are saved. K/V go round the ring again;
every block is differentiated against the FINAL out and lse (so its gradient is its exact share of
the global softmax), dQ accumulates locally, and the dK/dV of the block in hand accumulate in a
buffer that travels with it and arrives at the owner after the last step (cp-1 K/V exchanges plus cp
dK/dV exchanges). The dK/dV buffer is sent in `grad_dtype` (the plan's reduce_dtype, fp32 by
default) and every rank adds its share in fp32 after receiving. By default memory stays minimal (no
K/V block outlives its ring step; `allgather.py` is the bytes-first kind).

`keep_kv=True` (the plan's `cp_keep_kv`) trades memory for bytes: forward keeps every K/V block it
received, so backward sends no K/V at all, and each block's dK/dV goes straight to its owner (step s:
to rank - s, from rank + s) instead of travelling a full turn: cp-1 K/V messages and cp-1 dK/dV
messages per rank in all, the all-gather kind's bytes (half the default ring's at cp=2), for (cp-1)
extra [K; V] shards held per layer between forward and backward (one at cp=2; at larger cp the whole
sequence's K/V, as the all-gather kind holds it).

Which blocks are computed, and how, is decided by `ring_schedule` alone, which the work counter
`score_elements` shares, so the balance test checks the schedule that actually runs:

* contiguous, causal: step 0 is the square diagonal (causal); a block from a lower rank is fully
  visible; a block from a higher rank lies in the future and is skipped (but still forwarded).
* zigzag, causal: rank r holds chunks r and 2cp-1-r. Step 0 is causal on both local chunks (their
  local order is increasing, so the square causal mask is exact). A block from a lower rank j holds
  chunks j < r and 2cp-1-j > 2cp-1-r: all queries see its first half only. A block from a higher rank
  j: only the second query half (chunk 2cp-1-r) sees it, and sees all of it. Every rank computes
  the same number of scores at every step.
* non-causal: every block is full.

Attention sinks (gpt-oss: one learned logit per head in every row's softmax denominator, no value)
enter once, after the last merge: lse' = logaddexp(lse, sink) and out' = out * exp(lse - lse'). That
is exactly attention over the keys plus a sink column with a zero value, so backward needs nothing
new: every block differentiated against out' and lse' gets P' = exp(S - lse'), the true
probabilities, and D = rowsum(dO * out'), the true row term; the sink's own gradient is
-sum over rows of exp(sink - lse') * D.

Document masks (packed sequences) are applied on top of this plan: every rank learns every rank's
document ids once per call (one small all-gather of int ids, not K/V), and each block adds the
block-diagonal mask for its (query, key) pair.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable
from torch.distributed.device_mesh import DeviceMesh

from meshkit.context_parallel.group import as_group
from meshkit.context_parallel.kernels import attention_backward, attention_forward, default_scale
from meshkit.context_parallel.scores import ScoreMods, acc_dtype
from meshkit.context_parallel.sharding import LAYOUTS, Layout, shard_indices

_KV_TAG, _DKV_TAG = 11, 12


@dataclass(frozen=True)
class BlockStep:
    """The part of one ring step's block that a rank computes.

    q_half / kv_half: None for the whole local sequence, 0 or 1 for the first or second half.
    causal: square diagonal causal mask (only ever on the local block at step 0).
    """

    src: int
    q_half: int | None
    kv_half: int | None
    causal: bool


def ring_schedule(layout: Layout, causal: bool, cp: int, rank: int) -> list[BlockStep | None]:
    """Per ring step, what `rank` computes with the K/V block it holds (None: skipped)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; use one of {LAYOUTS}")
    plan: list[BlockStep | None] = []
    for step in range(cp):
        src = (rank - step) % cp
        if not causal:
            plan.append(BlockStep(src, None, None, False))
        elif step == 0:
            plan.append(BlockStep(src, None, None, True))
        elif layout == "contiguous":
            plan.append(BlockStep(src, None, None, False) if src < rank else None)
        elif src < rank:
            plan.append(BlockStep(src, None, 0, False))
        else:
            plan.append(BlockStep(src, 1, None, False))
    return plan


def score_elements(layout: Layout, causal: bool, cp: int, rank: int, seq_local: int) -> list[int]:
    """Attention scores (q, k pairs, per batch row and head) `rank` computes at each ring step.

    A causal diagonal block of n queries counts n(n+1)/2: the kernels skip the masked triangle.
    """
    counts = []
    for blk in ring_schedule(layout, causal, cp, rank):
        if blk is None:
            counts.append(0)
            continue
        nq = seq_local if blk.q_half is None else seq_local // 2
        nk = seq_local if blk.kv_half is None else seq_local // 2
        counts.append(nq * (nq + 1) // 2 if blk.causal else nq * nk)
    return counts


def merge_(
    out_BHSD: torch.Tensor, lse_BHS: torch.Tensor, block_out_BHSD: torch.Tensor, block_lse_BHS: torch.Tensor
) -> None:
    """Merge one block's (out, lse) into running fp32 accumulators, in place.

    Stable form: O <- O - sigmoid(L_i - L) * (O - O_i), L <- L - logsigmoid(L - L_i). Guards: when
    both are -inf the block adds nothing (not NaN); when only L is -inf the block is taken as is.
    The output update is one in-place `lerp_` with a per-row weight: no temporary of O's size.
    """
    d = block_lse_BHS - lse_BHS
    d = torch.where(torch.isnan(d), -math.inf, d)  # -inf - -inf: nothing on either side
    out_BHSD.lerp_(block_out_BHSD.to(out_BHSD.dtype), torch.sigmoid(d).unsqueeze(-1))
    merged = lse_BHS - torch.nn.functional.logsigmoid(-d)
    lse_BHS.copy_(torch.where(lse_BHS == -math.inf, block_lse_BHS.to(lse_BHS.dtype), merged))


def _half(x: torch.Tensor, half: int | None, dim: int) -> torch.Tensor:
    if half is None:
        return x
    n = x.shape[dim] // 2
    return x.narrow(dim, half * n, n)


class _Ring:
    """Neighbour exchange on a 1D group: send to rank+1, receive from rank-1 (global ranks)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def post(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Start sending `send` forward and receiving its predecessor's; returns (buffer, works)."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending: tuple[torch.Tensor, list]) -> torch.Tensor:
        recv, works = pending
        for w in works:
            w.wait()
        return recv


def _gather_docs(doc_BS: torch.Tensor | None, group: dist.ProcessGroup, size: int) -> list | None:
    if doc_BS is None:
        return None
    doc_BS = doc_BS.contiguous()
    out = [torch.empty_like(doc_BS) for _ in range(size)]
    dist.all_gather(out, doc_BS, group=group)
    return out


class _Blocks:
    """The per-block keywords of one call: documents, soft-cap, and the window over the positions of
    each rank's shard (blocks the window hides entirely are dropped from the plan)."""

    def __init__(self, mods: ScoreMods, layout: str, ring: _Ring, seq_local: int, docs, doc_BS):
        self.mods, self.rank, self.docs, self.doc_BS = mods, ring.rank, docs, doc_BS
        self.pos = [shard_indices(seq_local * ring.size, layout, ring.size, r) for r in range(ring.size)] \
            if mods.window else None

    def _pos(self, blk: BlockStep):
        if self.pos is None:
            return None, None
        return _half(self.pos[self.rank], blk.q_half, 0), _half(self.pos[blk.src], blk.kv_half, 0)

    def visible(self, plan: list[BlockStep | None]) -> list[BlockStep | None]:
        """`plan` without the blocks the window hides."""
        return [blk if blk is not None and self.mods.visible(*self._pos(blk)) else None for blk in plan]

    def kwargs(self, blk: BlockStep) -> dict:
        """Keywords of `attention_forward` / `attention_backward` for block `blk`."""
        q_doc, kv_doc = _block_docs(self.docs, self.doc_BS, blk)
        return dict(causal_kind="causal" if blk.causal else "none", q_doc_BS=q_doc, kv_doc_BS=kv_doc,
                    **self.mods.block(*self._pos(blk)))


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHSD, k_BHSD, v_BHSD, group, layout, causal, scale, doc_BS, backend, grad_dtype, keep_kv,
                sinks_H, mods):
        ring = _Ring(group)
        docs = _gather_docs(doc_BS, group, ring.size)
        blocks = _Blocks(mods, layout, ring, q_BHSD.shape[2], docs, doc_BS)
        plan = blocks.visible(ring_schedule(layout, causal, ring.size, ring.rank))
        acc = acc_dtype(q_BHSD.dtype)
        out_BHSD = torch.zeros(q_BHSD.shape, dtype=acc, device=q_BHSD.device)
        lse_BHS = torch.full(q_BHSD.shape[:3], -math.inf, dtype=acc, device=q_BHSD.device)
        kv = torch.stack([k_BHSD, v_BHSD])  # one buffer, one message per step
        received = []  # keep_kv: the blocks of steps 1.. cp-1, kept for backward
        for step, blk in enumerate(plan):
            if keep_kv and step > 0:
                received.append(kv)
            pending = ring.post(kv, _KV_TAG) if step < ring.size - 1 else None
            if blk is not None:
                o_i, lse_i = attention_forward(
                    _half(q_BHSD, blk.q_half, 2), _half(kv[0], blk.kv_half, 2), _half(kv[1], blk.kv_half, 2),
                    scale=scale, backend=backend, **blocks.kwargs(blk),
                )
                merge_(_half(out_BHSD, blk.q_half, 2), _half(lse_BHS, blk.q_half, 2), o_i, lse_i)
            if pending is not None:
                kv = ring.wait(pending)
        lse_BHS = add_sinks_(out_BHSD, lse_BHS, sinks_H)
        out = out_BHSD.to(q_BHSD.dtype)
        ctx.save_for_backward(q_BHSD, k_BHSD, v_BHSD, out, lse_BHS, *received)
        ctx.opts = (group, plan, scale, backend, blocks, grad_dtype, keep_kv)
        ctx.sinks = sinks_H
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout_BHSD):
        q_BHSD, k_BHSD, v_BHSD, out_BHSD, lse_BHS, *received = ctx.saved_tensors
        group, plan, scale, backend, blocks, grad_dtype, keep_kv = ctx.opts
        ring = _Ring(group)
        acc = acc_dtype(q_BHSD.dtype)
        wire = grad_dtype or acc  # dK/dV travel in the reduce dtype; every rank adds in fp32
        dq_BHSD = torch.zeros(q_BHSD.shape, dtype=acc, device=q_BHSD.device)
        kv = torch.stack([k_BHSD, v_BHSD])
        dsinks_H = sink_grad(ctx.sinks, dout_BHSD, out_BHSD, lse_BHS)
        if keep_kv:
            dq, dkv = _backward_kept(ring, plan, [kv, *received], dout_BHSD, q_BHSD, out_BHSD, lse_BHS, dq_BHSD,
                                     scale, backend, blocks, wire)
            return dq.to(q_BHSD.dtype), dkv[0].to(k_BHSD.dtype), dkv[1].to(v_BHSD.dtype), *([None] * 8), dsinks_H, None
        dkv_pending = None
        for step, blk in enumerate(plan):
            kv_pending = ring.post(kv, _KV_TAG) if step < ring.size - 1 else None
            # this rank's dK/dV for the block in hand
            own = _block_grads(blk, kv, dout_BHSD, q_BHSD, out_BHSD, lse_BHS, dq_BHSD, scale, backend, blocks, acc)
            if dkv_pending is not None:  # what the ranks before us accumulated for this block
                own.add_(ring.wait(dkv_pending).to(acc))
            if ring.size == 1:
                dkv_pending = None
                break
            dkv_pending = ring.post(own.to(wire), _DKV_TAG)
            if kv_pending is not None:
                kv = ring.wait(kv_pending)
        # After a full turn the buffer arriving from our predecessor is our own block's gradient.
        dkv = own if dkv_pending is None else ring.wait(dkv_pending)
        return (
            dq_BHSD.to(q_BHSD.dtype), dkv[0].to(k_BHSD.dtype), dkv[1].to(v_BHSD.dtype),
            None, None, None, None, None, None, None, None, dsinks_H, None,
        )


def add_sinks_(out_BHSD: torch.Tensor, lse_BHS: torch.Tensor, sinks_H: torch.Tensor | None) -> torch.Tensor:
    """After the last merge: the sink's exp joins every row's denominator once; `out_BHSD` (fp32
    accumulator) is rescaled in place and the row lse including the sink is returned. No-op (the
    same lse) without sinks. Shared by every kind that merges blocks by log-sum-exp."""
    if sinks_H is None:
        return lse_BHS
    with_sink_BHS = torch.logaddexp(lse_BHS, sinks_H.to(lse_BHS.dtype).view(1, -1, 1))
    out_BHSD.mul_(torch.exp(lse_BHS - with_sink_BHS).unsqueeze(-1))
    return with_sink_BHS


def check_sinks(sinks_H: torch.Tensor | None, q_BHSD: torch.Tensor) -> None:
    """One sink per local query head, or a ValueError naming the shapes."""
    if sinks_H is not None and tuple(sinks_H.shape) != (q_BHSD.shape[1],):
        raise ValueError(f"sinks_H has shape {tuple(sinks_H.shape)}; one logit per local query head: "
                         f"({q_BHSD.shape[1]},)")


def sink_grad(sinks_H, dout_BHSD, out_BHSD, lse_BHS):
    """d loss / d sink_h = -sum over rows of p_sink * rowsum(dO * out'), p_sink = exp(sink - lse'):
    the softmax gradient of the sink's column, whose value is zero. None without sinks."""
    if sinks_H is None or not sinks_H.requires_grad:
        return None
    acc = lse_BHS.dtype
    rows_BHS = (dout_BHSD.to(acc) * out_BHSD.to(acc)).sum(-1)
    p_sink_BHS = torch.exp(sinks_H.to(acc).view(1, -1, 1) - lse_BHS)
    return -(p_sink_BHS * rows_BHS).sum(dim=(0, 2)).to(sinks_H.dtype)


def _block_grads(blk, kv, dout_BHSD, q_BHSD, out_BHSD, lse_BHS, dq_BHSD, scale, backend, blocks: _Blocks, acc):
    """dK/dV (fp32, [2, ...] like `kv`) of one block against the final out and lse; dQ added in place."""
    own = torch.zeros(kv.shape, dtype=acc, device=kv.device)
    if blk is None:
        return own
    dq_i, dk_i, dv_i = attention_backward(
        _half(dout_BHSD, blk.q_half, 2), _half(q_BHSD, blk.q_half, 2),
        _half(kv[0], blk.kv_half, 2), _half(kv[1], blk.kv_half, 2),
        _half(out_BHSD, blk.q_half, 2), _half(lse_BHS, blk.q_half, 2),
        scale=scale, backend=backend, **blocks.kwargs(blk),
    )
    _half(dq_BHSD, blk.q_half, 2).add_(dq_i)
    _half(own[0], blk.kv_half, 2).add_(dk_i)
    _half(own[1], blk.kv_half, 2).add_(dv_i)
    return own


def _backward_kept(ring: _Ring, plan, kept, dout_BHSD, q_BHSD, out_BHSD, lse_BHS, dq_BHSD, scale, backend,
                   blocks: _Blocks, wire):
    """Backward from the K/V blocks forward kept (`kept[s]` came from rank - s): the other ranks'
    blocks first, each block's dK/dV posted straight to its owner while the next is computed, then
    this rank's own block, to which the others' shares are added in fp32 as they arrive."""
    acc = dq_BHSD.dtype
    group = ring.group
    pending = []
    for step in range(1, ring.size):
        grads = _block_grads(plan[step], kept[step], dout_BHSD, q_BHSD, out_BHSD, lse_BHS, dq_BHSD, scale,
                             backend, blocks, acc).to(wire)
        to = dist.get_global_rank(group, (ring.rank - step) % ring.size)
        frm = dist.get_global_rank(group, (ring.rank + step) % ring.size)
        recv = torch.empty_like(grads)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, grads, to, group, _DKV_TAG + step),
                                        dist.P2POp(dist.irecv, recv, frm, group, _DKV_TAG + step)])
        pending.append((recv, works, grads))
    dkv = _block_grads(plan[0], kept[0], dout_BHSD, q_BHSD, out_BHSD, lse_BHS, dq_BHSD, scale, backend,
                       blocks, acc)
    for recv, works, _ in pending:
        for w in works:
            w.wait()
        dkv.add_(recv.to(acc))
    return dq_BHSD, dkv


def _block_docs(docs: list | None, doc_BS: torch.Tensor | None, blk: BlockStep):
    if docs is None:
        return None, None
    return _half(doc_BS, blk.q_half, 1), _half(docs[blk.src], blk.kv_half, 1)


def ring_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    group: DeviceMesh | dist.ProcessGroup | None = None,
    *,
    causal: bool = True,
    layout: Layout = "contiguous",
    scale: float | None = None,
    doc_ids_BS: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    grad_dtype: torch.dtype | None = None,
    keep_kv: bool = False,
    sinks_H: torch.Tensor | None = None,
    softcap: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of the local query shard against the whole (sharded) sequence; returns local out.

    q_BHSD / k_BHSD / v_BHSD: this rank's shard (sharding.shard with the same `layout`), K/V with their
    own (GQA) head count, never repeated. doc_ids_BS: this rank's shard of `sharding.document_ids` for
    packed sequences (block-diagonal masking), or None. grad_dtype: the dtype the travelling dK/dV
    buffers are sent in (None: fp32; bf16 halves the backward's gradient bytes); each rank still adds
    its block's share in fp32. keep_kv: keep the received K/V blocks for backward (no K/V resent,
    dK/dV sent straight to their owners: the all-gather kind's bytes, (cp-1) more K/V shards held).
    sinks_H: one logit per local query head in every row's softmax denominator (gpt-oss), or None;
    differentiable. softcap: scores c * tanh(x / c) (Gemma 2; explicit scores, `scores.py`). window:
    causal attention within `window` positions (query i sees key j when i - j < window); blocks it
    hides entirely are skipped.
    """
    mods = ScoreMods(softcap, window).checked(causal)
    if dropout_p:
        raise ValueError(
            f"attention dropout_p={dropout_p} is not supported under ring attention: it would need the "
            "RNG state of every ring step; set the model's attention_dropout to 0"
        )
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}; use one of {LAYOUTS}")
    pg = as_group(group)
    S = q_BHSD.shape[2]
    if k_BHSD.shape[2] != S or v_BHSD.shape != k_BHSD.shape:
        raise ValueError(
            f"ring attention needs q, k, v shards of equal length; got q {tuple(q_BHSD.shape)}, "
            f"k {tuple(k_BHSD.shape)}, v {tuple(v_BHSD.shape)}"
        )
    if layout == "zigzag" and S % 2:
        raise ValueError(
            f"the zigzag layout holds two equal chunks per rank, but the local sequence length is {S}; "
            f"the global length must be a multiple of 2*cp = {2 * dist.get_world_size(pg)}"
        )
    scale = default_scale(q_BHSD.shape[-1]) if scale is None else float(scale)
    if doc_ids_BS is not None:
        doc_ids_BS = doc_ids_BS.to(q_BHSD.device)
    check_sinks(sinks_H, q_BHSD)
    return _RingAttention.apply(q_BHSD, k_BHSD, v_BHSD, pg, layout, causal, scale, doc_ids_BS, backend,
                                grad_dtype, bool(keep_kv), sinks_H, mods)
