"""Attention sinks through ring, zig-zag ring and all-gather K/V attention, against the one-process explicit-score
attention (`masked.quirk_attention`, fp64) on the whole sequence: the output, dq, dk, dv and the
sinks' own gradient (each cp rank's share of the rows, summed over cp), with packed documents and
GQA. The sinks are large enough (about e^2 against a row's sum) that a sink left out, or added
once per ring step instead of once per row, shows at any tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist

from meshkit.context_parallel import sharding
from meshkit.context_parallel.allgather import allgather_attention
from meshkit.context_parallel.masked import quirk_attention
from meshkit.context_parallel.ring import ring_attention

ATOL, RTOL = 2e-5, 1e-4  # fp32 vs fp64, the same for every cp
B, H, KV, S, D = 2, 4, 2, 16, 8


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, KV, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(H, generator=g, dtype=torch.float64) * 2
    positions = torch.cat([torch.arange(5), torch.arange(S - 5)]).expand(B, S)  # two documents a row
    return q, k, v, dout, sinks, sharding.document_ids(positions)


def _reference(seed: int):
    q, k, v, dout, sinks, docs = (t.requires_grad_() if t.is_floating_point() else t for t in _inputs(seed))
    out = quirk_attention(q, k, v, scale=D ** -0.5, doc_ids_BS=docs, sinks_H=sinks)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad, sinks.grad


def _ring_worker(seed: int, layout: str, keep_kv: bool, kind: str = "ring"):
    cp, rank = tdist.get_world_size(), tdist.get_rank()
    q, k, v, dout, sinks, docs = _inputs(seed)

    def shard(t, dim=2):
        return sharding.shard(t, layout, cp, rank, dim=dim).float().contiguous()

    q, k, v = (shard(t).requires_grad_() for t in (q, k, v))
    sinks = sinks.float().requires_grad_()
    docs = shard(docs, 1).long()
    if kind == "allgather":
        out = allgather_attention(q, k, v, scale=D ** -0.5, doc_ids_BS=docs, sinks_H=sinks)
    else:
        out = ring_attention(q, k, v, layout=layout, scale=D ** -0.5, doc_ids_BS=docs, keep_kv=keep_kv,
                             sinks_H=sinks)
    out.backward(shard(dout))
    dsinks = sinks.grad.clone()
    tdist.all_reduce(dsinks)  # each rank differentiated its own rows
    return out.detach(), q.grad, k.grad, v.grad, dsinks


@pytest.mark.parametrize(("kind", "layout", "keep_kv", "cp"), [
    ("ring", "contiguous", False, 4), ("ring", "zigzag", False, 2), ("ring", "zigzag", True, 4),
    ("allgather", "zigzag", False, 4)])
def test_sinks_match_explicit_attention(dist, kind, layout, keep_kv, cp):
    results = dist(cp).run(_ring_worker, 3, layout, keep_kv, kind)
    want = _reference(3)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        got = sharding.unshard([r[i] for r in results], layout, dim=2).double()
        torch.testing.assert_close(got, want[i], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{n}: {m}")
    for rank, r in enumerate(results):
        torch.testing.assert_close(r[4].double(), want[4], atol=ATOL, rtol=RTOL,
                                   msg=lambda m, i=rank: f"sinks gradient on rank {i}: {m}")


def test_sinks_change_the_result():
    """The test above would pass with a sink-free ring if the sinks did not matter: they do."""
    q, k, v, _, sinks, docs = _inputs(3)
    with_sinks = quirk_attention(q, k, v, scale=D ** -0.5, doc_ids_BS=docs, sinks_H=sinks)
    without = quirk_attention(q, k, v, scale=D ** -0.5, doc_ids_BS=docs)
    assert (with_sinks - without).abs().max() > 0.1
