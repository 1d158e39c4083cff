"""Soft-capped scores (Gemma 2) and sliding windows through ring, zig-zag ring, all-gather K/V and USP
attention, against the one-process explicit-score attention (`masked.quirk_attention`, fp64, plain
autograd) on the whole sequence: the output and dq, dk, dv, with packed documents, GQA and sinks.

The cap sits inside the scores' range (tanh bends them by tens of percent) and the window is shorter
than one rank's shard, so a cap applied in the forward only, a backward that skips the tanh's slope,
or a window on local instead of global positions shows at any tolerance (`test_mods_change_the_result`
checks that they matter)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as tdist

from meshkit.context_parallel import ring, sharding
from meshkit.context_parallel.allgather import allgather_attention, allgather_blocks
from meshkit.context_parallel.kernels import attention_backward, attention_forward, reference_attention
from meshkit.context_parallel.masked import quirk_attention
from meshkit.context_parallel.ring import ring_attention
from meshkit.context_parallel.usp import usp_attention, usp_group_ranks

ATOL, RTOL = 2e-5, 1e-4  # fp32 vs fp64, the same for every cp
B, H, KV, S, D = 2, 4, 2, 16, 8
SOFTCAP, WINDOW = 1.5, 3


def _inputs(seed: int, docs: bool):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) * 2 for _ in range(2))
    k, v = (torch.randn(B, KV, S, D, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    positions = torch.cat([torch.arange(5), torch.arange(S - 5)]).expand(B, S) if docs else torch.arange(S)[None]
    return q, k, v, dout, sinks, sharding.document_ids(positions).expand(B, S)


def _reference(seed: int, docs: bool, softcap, window, sinks: bool):
    q, k, v, dout, s, doc_ids = _inputs(seed, docs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = quirk_attention(q, k, v, scale=D ** -0.5, doc_ids_BS=doc_ids, softcap=softcap, sliding_window=window,
                          sinks_H=s if sinks else None)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


_USP: dict[int, tuple] = {}


def _usp_groups(ulysses: int):
    if ulysses not in _USP:  # every rank creates every group (collective), keeps its own
        inner, outer = usp_group_ranks(list(range(tdist.get_world_size())), ulysses)
        mine = [g for ranks in (*inner, *outer) if (g := tdist.new_group(ranks)) and tdist.get_rank() in ranks]
        _USP[ulysses] = tuple(mine)
    return _USP[ulysses]


def _worker(seed: int, kind: str, layout: str, docs: bool, softcap, window, sinks: bool, keep_kv: bool = False):
    cp, rank = tdist.get_world_size(), tdist.get_rank()
    ulysses = 2 if kind == "usp" else 1
    q, k, v, dout, s, doc_ids = _inputs(seed, docs)

    def shard(t, dim=2):
        return sharding.shard(t, layout, cp, rank, dim=dim, ulysses=ulysses).float().contiguous()

    q, k, v = (shard(t).requires_grad_() for t in (q, k, v))
    kw = dict(scale=D ** -0.5, doc_ids_BS=shard(doc_ids, 1).long() if docs else None, softcap=softcap,
              window=window, sinks_H=s.float() if sinks else None)
    if kind == "allgather":
        out = allgather_attention(q, k, v, **kw)
    elif kind == "usp":
        out = usp_attention(q, k, v, *_usp_groups(ulysses), layout=layout, **kw)
    else:
        out = ring_attention(q, k, v, layout=layout, keep_kv=keep_kv, **kw)
    out.backward(shard(dout))
    return out.detach(), q.grad, k.grad, v.grad


# (kind, layout, cp, docs, softcap, window, sinks, keep_kv)
CASES = {
    "ring_window_softcap": ("ring", "contiguous", 4, True, SOFTCAP, WINDOW, False, False),
    "zigzag_softcap": ("zigzag", "zigzag", 2, True, SOFTCAP, None, False, False),
    "zigzag_window_kept_kv_sinks": ("zigzag", "zigzag", 4, False, None, WINDOW, True, True),
    "allgather_window_softcap": ("allgather", "zigzag", 4, True, SOFTCAP, WINDOW, False, False),
    "usp_window_softcap": ("usp", "zigzag", 4, False, SOFTCAP, WINDOW, False, False),
}
CI = ("ring_window_softcap", "zigzag_softcap", "allgather_window_softcap")


@pytest.mark.parametrize("case", [c if c in CI else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_mods_match_explicit_attention(dist, case):
    kind, layout, cp, docs, softcap, window, sinks, keep_kv = CASES[case]
    results = dist(cp).run(_worker, 5, kind, layout, docs, softcap, window, sinks, keep_kv)
    want = _reference(5, docs, softcap, window, sinks)
    ulysses = 2 if kind == "usp" else 1
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        got = sharding.unshard([r[i] for r in results], layout, dim=2, ulysses=ulysses).double()
        torch.testing.assert_close(got, want[i], atol=ATOL, rtol=RTOL, msg=lambda m, n=name: f"{case} {n}: {m}")


def test_mods_change_the_result():
    """The test above would pass with a plain ring if the cap and the window did not matter: they do,
    in the output and in the gradients."""
    plain = _reference(5, True, None, None, False)
    for softcap, window in ((SOFTCAP, None), (None, WINDOW)):
        modded = _reference(5, True, softcap, window, False)
        for a, b in zip(plain, modded):
            assert (a - b).abs().max() > 0.05, (softcap, window)


def test_block_kernel_with_mods_matches_reference_autograd():
    """One block's fused-API forward and backward (against the block's own out and lse), soft-capped and
    windowed over global positions that are not the block's local indices, equal plain autograd through
    the explicit reference in fp64."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64) * 2
    k, v = (torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn_like(q)
    q_pos, kv_pos = torch.arange(20, 25), torch.arange(15, 22)  # keys before and overlapping the queries' rows
    kw = dict(causal_kind="none", softcap=SOFTCAP, window=4, q_pos_S=q_pos, kv_pos_S=kv_pos)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*leaves, **kw)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout)
    out, lse = attention_forward(q.float(), k.float(), v.float(), **kw)
    grads = attention_backward(dout.float(), q.float(), k.float(), v.float(), out, lse, **kw)
    torch.testing.assert_close(out.double(), ref_out, atol=ATOL, rtol=RTOL)
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())  # rows the window leaves empty
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)


def _kernel_calls(kind: str, window: int) -> list[tuple[int, int]]:
    """(queries, keys) of every forward kernel call this rank makes."""
    calls: list[tuple[int, int]] = []
    real = ring.attention_forward

    def count(q, k, v, **kw):
        calls.append((q.shape[2], k.shape[2]))
        return real(q, k, v, **kw)

    q, k, v, _, _, _ = _inputs(5, False)
    shard = sharding.shard(q, "zigzag", tdist.get_world_size(), tdist.get_rank(), dim=2).float()
    kv_shard = sharding.shard(k, "zigzag", tdist.get_world_size(), tdist.get_rank(), dim=2).float()
    with mock.patch.object(ring, "attention_forward", count):
        ring_attention(shard, kv_shard, kv_shard, layout="zigzag", window=window)
    return calls


def test_window_skips_hidden_blocks(dist):
    """With a window shorter than a chunk, a zig-zag rank computes only the blocks that hold keys its
    queries can see; the all-gather kind trims each key prefix to the window."""
    full = dist(4).run(_kernel_calls, "zigzag", S)
    short = dist(4).run(_kernel_calls, "zigzag", 2)
    assert sum(map(len, short)) < sum(map(len, full))
    for blocks in (allgather_blocks(4, r, S // 4, True, window=2) for r in range(4)):
        assert all(ks.stop - ks.start <= 2 for _, ks, kind in blocks if kind == "none")


def test_bad_mods_are_refused():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="softcap=0"):
        ring_attention(q, q, q, softcap=0.0)
    with pytest.raises(ValueError, match="window=3"):
        ring_attention(q, q, q, causal=False, window=3)
