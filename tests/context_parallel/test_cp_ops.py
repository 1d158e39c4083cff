"""Context-parallel attention at the op level, against the single-process fp64 reference.

Every sharded run (ring, zig-zag ring, all-gather K/V, Ulysses, USP) is compared with `reference_attention` on the
full sequence in fp64: the output AND dq/dk/dv, compared in fp32 with one tolerance for every cp (the
notes' ring-flash-attention #42: gradients break while outputs look fine). Ranks build their inputs
from the case's seed, so only small results travel back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from unittest import mock

import pytest
import torch
import torch.distributed as tdist
from hypothesis import given, settings
from hypothesis import strategies as st

from meshkit.context_parallel import allgather, kernels, ring, sharding
from meshkit.context_parallel.allgather import allgather_attention, allgather_blocks
from meshkit.context_parallel.kernels import attention_block, reference_attention
from meshkit.context_parallel.ring import merge_, ring_attention, ring_schedule, score_elements
from meshkit.context_parallel.ulysses import kv_replication, ulysses_attention
from meshkit.context_parallel.usp import usp_attention, usp_group_ranks

ATOL, RTOL = 2e-5, 1e-4  # fp32 vs fp64; the same for every cp


@dataclass(frozen=True)
class Case:
    cp: int
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    causal: bool
    docs: bool
    seed: int


def _inputs(case: Case):
    """Full-sequence fp64 q, k, v, upstream grad and (packed) document ids, from the seed alone."""
    g = torch.Generator().manual_seed(case.seed)
    B, S, D = case.batch, case.seq, case.head_dim
    q = torch.randn(B, case.heads, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, case.kv_heads, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, case.kv_heads, S, D, generator=g, dtype=torch.float64)
    dout = torch.randn(B, case.heads, S, D, generator=g, dtype=torch.float64)
    docs = None
    if case.docs:  # random document lengths, 1 .. S/2 tokens, boundaries anywhere (shard edges too)
        rows = []
        for _ in range(B):
            pos: list[int] = []
            while len(pos) < S:
                pos += range(int(torch.randint(1, max(2, S // 2) + 1, (1,), generator=g)))
            rows.append(pos[:S])
        docs = sharding.document_ids(torch.tensor(rows))
    return q, k, v, dout, docs


def _reference(case: Case, dtype=torch.float32):
    """fp64 reference on the full sequence, from the inputs as rounded to the ranks' `dtype`."""
    q, k, v, dout, docs = _inputs(case)
    q, k, v, dout = (t.to(dtype).double() for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, _ = reference_attention(
        q, k, v, causal_kind="causal" if case.causal else "none", q_doc_BS=docs, kv_doc_BS=docs
    )
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _local(case: Case, layout: str, rank: int, ulysses: int = 1, dtype=torch.float32):
    """This rank's shards: leaves stored [B, S, H, D] like HF's projections (so the ops see
    non-contiguous [B, H, S, D] views), their views, the upstream grad and the document ids."""
    q, k, v, dout, docs = _inputs(case)

    def sh(t, dim=2):
        return sharding.shard(t, layout, case.cp, rank, dim=dim, ulysses=ulysses)

    leaves = [sh(t).to(dtype).transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    views = [t.transpose(1, 2) for t in leaves]
    return leaves, views, sh(dout).to(dtype), None if docs is None else sh(docs, dim=1)


def _backward_and_pack(out, leaves, dout):
    out.backward(dout)
    return (out.detach(), *(t.grad.transpose(1, 2) for t in leaves))


def _check_against_reference(
    case: Case, results, layout: str, ulysses: int = 1, atol: float = ATOL, rtol: float = RTOL,
    dtype=torch.float32,
) -> None:
    ref = _reference(case, dtype)
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        got = sharding.unshard([r[i] for r in results], layout, dim=2, ulysses=ulysses).float()
        torch.testing.assert_close(
            got, ref[i].float(), atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n} differs: {m}"
        )


# -- worker functions (module level: the pool pickles them by reference) ---------------------------


def _ring_worker(case: Case, layout: str, dtype=torch.float32, backend: str = "auto", grad_dtype=None):
    leaves, qkv, dout, docs = _local(case, layout, tdist.get_rank(), dtype=dtype)
    out = ring_attention(*qkv, causal=case.causal, layout=layout, doc_ids_BS=docs, backend=backend,
                         grad_dtype=grad_dtype)
    assert out.dtype == dtype
    return _backward_and_pack(out, leaves, dout)


def _allgather_worker(case: Case, dtype=torch.float32, grad_dtype=None):
    leaves, qkv, dout, docs = _local(case, "zigzag", tdist.get_rank(), dtype=dtype)
    out = allgather_attention(*qkv, causal=case.causal, doc_ids_BS=docs, grad_dtype=grad_dtype)
    assert out.dtype == dtype
    return _backward_and_pack(out, leaves, dout)


def _counting_allgather_worker(case: Case):
    """All-gather attention with its collectives and kernel calls recorded."""
    leaves, qkv, dout, docs = _local(case, "zigzag", tdist.get_rank())
    colls: list[tuple[str, int]] = []
    kernel_calls: list[tuple[int, int, str]] = []
    real_ag, real_rs, real_fwd = allgather.all_gather_single, allgather.reduce_scatter_single, allgather.attention_forward

    def ag(out, inp, group):
        colls.append(("all_gather", out.numel() * out.element_size()))
        return real_ag(out, inp, group)

    def rs(out, inp, group):
        colls.append(("reduce_scatter", inp.numel() * inp.element_size()))
        return real_rs(out, inp, group)

    def fwd(q, k, v, **kw):
        kernel_calls.append((q.shape[2], k.shape[2], kw["causal_kind"]))
        return real_fwd(q, k, v, **kw)

    with mock.patch.object(allgather, "all_gather_single", ag), mock.patch.object(
        allgather, "reduce_scatter_single", rs
    ), mock.patch.object(allgather, "attention_forward", fwd):
        out = allgather_attention(*qkv, causal=case.causal, doc_ids_BS=docs)
        n_forward = list(colls)
        out.backward(dout)
    return n_forward, colls[len(n_forward):], kernel_calls


def _ulysses_worker(case: Case):
    leaves, qkv, dout, docs = _local(case, "contiguous", tdist.get_rank())
    out = ulysses_attention(*qkv, causal=case.causal, doc_ids_BS=docs)
    return _backward_and_pack(out, leaves, dout)


_USP_GROUPS: dict[int, tuple] = {}


def _usp_groups(ulysses: int):
    """(ulysses group, ring group) of this rank; created once per worker process (collective)."""
    if ulysses not in _USP_GROUPS:
        world = tdist.get_world_size()
        inner, outer = usp_group_ranks(list(range(world)), ulysses)
        mine = []
        for ranks_list in (inner, outer):
            for ranks in ranks_list:
                g = tdist.new_group(ranks)
                if tdist.get_rank() in ranks:
                    mine.append(g)
        _USP_GROUPS[ulysses] = tuple(mine)
    return _USP_GROUPS[ulysses]


def _usp_worker(case: Case, ulysses: int, outer_kind: str = "ring"):
    inner, outer = _usp_groups(ulysses)
    leaves, qkv, dout, docs = _local(case, "zigzag", tdist.get_rank(), ulysses)
    out = usp_attention(*qkv, inner, outer, causal=case.causal, doc_ids_BS=docs, outer=outer_kind)
    return _backward_and_pack(out, leaves, dout)


def _counting_ring_worker(case: Case, layout: str):
    """Ring forward/backward with every P2P batch and every kernel call recorded."""
    leaves, qkv, dout, docs = _local(case, layout, tdist.get_rank())
    calls: list[int] = []
    kernel_calls: list[tuple[int, int, str]] = []
    real_batch, real_fwd = tdist.batch_isend_irecv, ring.attention_forward

    def batch(ops):
        calls.append(len(ops))
        return real_batch(ops)

    def fwd(q, k, v, **kw):
        kernel_calls.append((q.shape[2], k.shape[2], kw["causal_kind"]))
        return real_fwd(q, k, v, **kw)

    with mock.patch.object(ring.dist, "batch_isend_irecv", batch), mock.patch.object(
        ring, "attention_forward", fwd
    ):
        out = ring_attention(*qkv, causal=case.causal, layout=layout, doc_ids_BS=docs)
        n_forward = list(calls)
        out.backward(dout)
    return n_forward, calls[len(n_forward):], kernel_calls


def _bad_calls_worker():
    """Every misuse must raise ValueError on every rank before any collective (nothing hangs)."""
    cp = tdist.get_world_size()
    q = torch.randn(1, 3, 4, 8)
    kv = torch.randn(1, 1, 4, 8)
    messages = []
    for call in (
        lambda: ulysses_attention(q, kv, kv),  # 3 heads over cp ranks
        lambda: ring_attention(q[:, :, :3], kv[:, :, :3], kv[:, :, :3], layout="zigzag"),  # odd shard
        lambda: ring_attention(q, kv, kv, dropout_p=0.1),
        lambda: ring_attention(q, kv[:, :, :2], kv[:, :, :2]),
        lambda: allgather_attention(q[:, :, :3], kv[:, :, :3], kv[:, :, :3]),  # odd shard
        lambda: sharding.shard(torch.zeros(1, 7), "zigzag", cp, 0),
    ):
        try:
            call()
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append("")
    tdist.barrier()  # still in step: no rank entered a collective the others skipped
    return messages


# -- strategies ------------------------------------------------------------------------------------


@st.composite
def cases(draw, *, layout: str, ulysses_divides_heads: int = 0, ulysses: int = 1, cp=None):
    cp = draw(st.sampled_from([2, 3, 4])) if cp is None else cp
    kv_heads = draw(st.sampled_from([1, 2, 3]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    if ulysses_divides_heads:  # smallest multiple of kv_heads that the degree divides, times 1 or 2
        heads = math.lcm(kv_heads, ulysses_divides_heads) * draw(st.sampled_from([1, 2]))
    multiple = sharding.required_multiple(layout, cp, ulysses=ulysses)
    seq = multiple * draw(st.integers(1, max(1, 24 // multiple)))
    return Case(
        cp=cp, batch=draw(st.integers(1, 2)), heads=heads, kv_heads=kv_heads, seq=seq,
        head_dim=draw(st.sampled_from([4, 8, 16])), causal=draw(st.booleans()), docs=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


# -- single-process: layouts -----------------------------------------------------------------------


@settings(max_examples=40)
@given(
    layout=st.sampled_from(["contiguous", "zigzag"]), ring_deg=st.integers(1, 4),
    ulysses=st.integers(1, 3), n=st.integers(1, 4),
)
def test_shard_unshard_roundtrip(layout, ring_deg, ulysses, n):
    cp = ring_deg * ulysses
    seq = sharding.required_multiple(layout, cp, ulysses=ulysses) * n
    x = torch.arange(2 * seq).view(2, seq)
    shards = [sharding.shard(x, layout, cp, r, ulysses=ulysses) for r in range(cp)]
    assert torch.equal(sharding.unshard(shards, layout, ulysses=ulysses), x)
    for r, s in enumerate(shards):  # local order increasing: square causal masks stay exact
        assert s.shape[1] == seq // cp and bool((s[0].diff() > 0).all())
        assert torch.equal(s[0], sharding.position_ids(seq, layout, cp, r, ulysses=ulysses))


def test_zigzag_chunks():
    cp, chunk = 4, 3
    for r in range(cp):
        idx = sharding.shard_indices(2 * cp * chunk, "zigzag", cp, r)
        assert (idx // chunk).unique().tolist() == [r, 2 * cp - 1 - r]


def test_indivisible_sequence_names_multiple():
    with pytest.raises(ValueError, match="multiple of 8"):
        sharding.shard(torch.zeros(1, 12), "zigzag", 4, 0)
    with pytest.raises(ValueError, match="multiple of 3"):
        sharding.check_seq_len(10, "contiguous", 3)
    with pytest.raises(ValueError, match="multiple of 8"):  # R=2, U=4: R * lcm(2, 4)
        sharding.check_seq_len(12, "zigzag", 8, ulysses=4)


@settings(max_examples=30)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    layout=st.sampled_from(["contiguous", "zigzag"]),
)
def test_document_ids_match_hf_and_shard(lengths, layout):
    from transformers.masking_utils import find_packed_sequence_indices

    pos = torch.tensor([[p for n in lengths for p in range(n)]])
    cp = 2
    seq = pos.shape[1] - pos.shape[1] % sharding.required_multiple(layout, cp)
    pos = pos[:, :seq]
    if seq == 0:
        return
    docs = sharding.document_ids(pos)
    hf = find_packed_sequence_indices(pos)
    assert torch.equal(docs, torch.zeros_like(docs) if hf is None else hf)
    for r in range(cp):
        p_l, d_l = sharding.shard_packed(pos, layout, cp, r)
        assert torch.equal(p_l, sharding.shard(pos, layout, cp, r))
        assert torch.equal(d_l, sharding.shard(docs, layout, cp, r))


# -- single-process: kernel and merge --------------------------------------------------------------


@settings(max_examples=40)
@given(
    kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 4]), sq=st.integers(1, 9),
    sk=st.integers(1, 9), head_dim=st.sampled_from([3, 8, 16]), causal=st.booleans(), docs=st.booleans(),
    backend=st.sampled_from(["auto", "reference"]), seed=st.integers(0, 2**16),
)
def test_attention_block_matches_reference(kv_heads, group, sq, sk, head_dim, causal, docs, backend, seed):
    if causal:
        sk = sq
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, kv_heads * group, sq, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(2, kv_heads, sk, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, sk, head_dim, generator=g, dtype=torch.float64)
    dout = torch.randn_like(q)
    # Query documents 0..3, key documents 0..2: query rows of document 3 are empty.
    q_doc = torch.randint(0, 4, (2, sq), generator=g).sort(-1).values if docs else None
    kv_doc = torch.randint(0, 3, (2, sk), generator=g).sort(-1).values if docs else None
    kind = "causal" if causal else "none"
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*leaves, causal_kind=kind, q_doc_BS=q_doc, kv_doc_BS=kv_doc)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout)
    leaves32 = [t.float().requires_grad_() for t in (q, k, v)]
    out, lse = attention_block(*leaves32, causal_kind=kind, q_doc_BS=q_doc, kv_doc_BS=kv_doc, backend=backend)
    grads = torch.autograd.grad(out, leaves32, dout.float())
    assert lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out.float(), atol=ATOL, rtol=RTOL)
    assert torch.equal(lse.isneginf(), ref_lse.isneginf())  # empty rows: -inf, never 0 or +inf
    torch.testing.assert_close(
        lse.nan_to_num(neginf=0), ref_lse.float().nan_to_num(neginf=0), atol=ATOL, rtol=RTOL
    )
    assert not out[lse.isneginf()].any()
    for got, want in zip(grads, ref_grads):
        assert got.isfinite().all()
        torch.testing.assert_close(got, want.float(), atol=ATOL, rtol=RTOL)


def test_fully_masked_block_gives_neg_inf_and_zero_grads():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k = torch.randn(1, 1, 4, 8, requires_grad=True)
    v = torch.randn(1, 1, 4, 8, requires_grad=True)
    docs_q, docs_k = torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long)
    for backend in ("auto", "reference"):
        out, lse = attention_block(q, k, v, q_doc_BS=docs_q, kv_doc_BS=docs_k, backend=backend)
        assert lse.isneginf().all() and not out.any()
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert all(not g.any() for g in grads)


def test_merge_is_exact_and_guards_empty_rows():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    full = kernels.attention_forward(q, k, v)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], -math.inf)
    empty = (torch.zeros_like(q), torch.full(q.shape[:3], -math.inf))
    merge_(out, lse, *empty)  # -inf with -inf: still empty, no NaN
    assert not out.isnan().any() and lse.isneginf().all()
    for block in (slice(0, 2), slice(2, 5)):
        merge_(out, lse, *kernels.attention_forward(q, k[:, :, block], v[:, :, block]))
        merge_(out, lse, *empty)
    torch.testing.assert_close(out, full[0])
    torch.testing.assert_close(lse, full[1])


def test_causal_needs_square_block_and_dropout_is_refused():
    q, kv = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 6, 8)
    with pytest.raises(ValueError, match="square"):
        attention_block(q, kv, kv, causal_kind="causal")
    with pytest.raises(ValueError, match="dropout"):
        attention_block(q, kv, kv, dropout_p=0.1)
    for fn in (ring_attention, ulysses_attention):
        with pytest.raises(ValueError, match="dropout"):
            fn(q, q, q, None, dropout_p=0.1)
    with pytest.raises(ValueError, match="dropout"):
        usp_attention(q, q, q, None, None, dropout_p=0.1)


def test_ulysses_kv_replication_rule():
    assert kv_replication(8, 8, 4) == 1  # kv heads split like q heads
    assert kv_replication(8, 2, 4) == 2  # degree > kv heads: degree / kv heads copies
    assert kv_replication(8, 1, 8) == 8
    assert kv_replication(12, 4, 6) == 3  # neither divides the other: lcm(4, 6) / 4
    with pytest.raises(ValueError, match="must divide the number of q heads"):
        kv_replication(6, 2, 4)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        kv_replication(6, 4, 2)


# -- single-process: the ring schedule -------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5, 8])
def test_zigzag_every_rank_does_equal_work_every_step(cp):
    seq_local = 6
    counts = [score_elements("zigzag", True, cp, r, seq_local) for r in range(cp)]
    for step in range(cp):
        assert len({c[step] for c in counts}) == 1, f"step {step}: {[c[step] for c in counts]}"
    seq = cp * seq_local
    assert sum(map(sum, counts)) == seq * (seq + 1) // 2  # exactly the causal triangle, nothing twice
    plain = [sum(score_elements("contiguous", True, cp, r, seq_local)) for r in range(cp)]
    assert sum(plain) == seq * (seq + 1) // 2
    if cp > 1:
        assert max(plain) > min(plain)  # what zig-zag fixes


def test_ring_schedule_skips_future_and_uses_causal_only_on_diagonal():
    for layout in ("contiguous", "zigzag"):
        for cp in (2, 3, 4):
            for r in range(cp):
                plan = ring_schedule(layout, True, cp, r)
                assert plan[0].causal and plan[0].src == r
                assert all(b is None or not b.causal for b in plan[1:])
                if layout == "contiguous":
                    assert [b is None for b in plan] == [(r - s) % cp > r for s in range(cp)]


# -- multi-rank ------------------------------------------------------------------------------------


@settings(max_examples=25)
@given(
    data=st.data(), layout=st.sampled_from(["contiguous", "zigzag"]),
    backend=st.sampled_from(["auto", "auto", "reference"]),
)
def test_ring_matches_reference(dist, data, layout, backend):
    case = data.draw(cases(layout=layout))
    results = dist(case.cp).run(_ring_worker, case, layout, torch.float32, backend)
    _check_against_reference(case, results, layout)


@settings(max_examples=15)
@given(data=st.data())
def test_allgather_matches_reference(dist, data):
    case = data.draw(cases(layout="zigzag"))
    _check_against_reference(case, dist(case.cp).run(_allgather_worker, case), "zigzag")


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_allgather_one_gather_one_reduce_scatter_and_balanced_work(dist, cp):
    """Forward: one all-gather of [K; V] (plus nothing else); backward: one reduce-scatter of [dK; dV]
    and no second gather; every rank computes the same scores (zig-zag balance)."""
    case = Case(cp=cp, batch=1, heads=2, kv_heads=1, seq=4 * cp, head_dim=8, causal=True, docs=False, seed=3)
    kv_bytes = 2 * case.batch * case.kv_heads * case.seq * case.head_dim * 4  # the gathered [K; V], fp32
    for rank, (forward, backward, kernel_calls) in enumerate(dist(cp).run(_counting_allgather_worker, case)):
        assert forward == [("all_gather", kv_bytes)]
        assert backward == [("reduce_scatter", kv_bytes)]
        c = case.seq // cp // 2
        done = [sq * (sq + 1) // 2 if kind == "causal" else sq * sk for sq, sk, kind in kernel_calls]
        # (2cp-1) full chunk-squares plus two causal diagonals: the same on every rank
        assert sum(done) == (2 * cp - 1) * c * c + c * (c + 1), (rank, kernel_calls)
        expected = [(q.stop - q.start, k.stop - k.start, kind) for q, k, kind in allgather_blocks(cp, rank, 2 * c, True)]
        assert kernel_calls == expected


def test_allgather_bf16_gradients_sent_in_bf16(dist):
    """bf16 inputs with dK/dV reduce-scattered in bf16 (grad_dtype) and in fp32: both stay at bf16
    rounding of the reference, since each rank sums its blocks in fp32 before the transfer."""
    case = Case(cp=4, batch=1, heads=4, kv_heads=2, seq=64, head_dim=16, causal=True, docs=True, seed=5)
    for grad_dtype in (torch.bfloat16, None):
        results = dist(4).run(_allgather_worker, case, torch.bfloat16, grad_dtype)
        _check_against_reference(case, results, "zigzag", atol=2e-2, rtol=2e-2, dtype=torch.bfloat16)


@settings(max_examples=15)
@given(data=st.data())
def test_ulysses_matches_reference(dist, data):
    cp = data.draw(st.sampled_from([2, 3, 4]))
    case = data.draw(cases(layout="contiguous", ulysses_divides_heads=cp, cp=cp))
    _check_against_reference(case, dist(cp).run(_ulysses_worker, case), "contiguous")


@settings(max_examples=15)
@given(data=st.data())
def test_usp_matches_reference(dist, data):
    cp, ulysses = data.draw(st.sampled_from([(4, 2), (4, 2), (2, 2), (3, 3), (4, 1), (3, 1)]))
    outer = data.draw(st.sampled_from(["ring", "allgather"]))
    case = data.draw(cases(layout="zigzag", ulysses_divides_heads=ulysses, ulysses=ulysses, cp=cp))
    _check_against_reference(case, dist(cp).run(_usp_worker, case, ulysses, outer), "zigzag", ulysses)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_collective_and_kernel_counts(dist, cp, layout):
    case = Case(cp=cp, batch=1, heads=2, kv_heads=1, seq=4 * cp, head_dim=8, causal=True, docs=False, seed=3)
    results = dist(cp).run(_counting_ring_worker, case, layout)
    seq_local = case.seq // cp
    for rank, (forward, backward, kernel_calls) in enumerate(results):
        # Forward: cp-1 exchange steps, each one send + one receive (K and V in one buffer).
        assert forward == [2] * (cp - 1)
        # Backward: cp-1 K/V exchanges and cp dK/dV exchanges (the last one delivers to the owner).
        assert backward == [2] * (2 * cp - 1)
        expected = [n for n in score_elements(layout, True, cp, rank, seq_local) if n]
        done = [sq * (sq + 1) // 2 if kind == "causal" else sq * sk for sq, sk, kind in kernel_calls]
        assert done == expected


@pytest.mark.parametrize("grad_dtype", [None, torch.bfloat16])
def test_ring_bf16_accumulates_in_fp32(dist, grad_dtype):
    """bf16 inputs: blocks merge in fp32 and every rank adds its dK/dV share in fp32, whether the
    buffer travels in fp32 (default) or bf16 (reduce_dtype=bfloat16), so the error stays at bf16
    rounding of the result (ring-flash-attention #42 broke gradients at ring 4-8 with bf16 partials)."""
    case = Case(cp=4, batch=1, heads=4, kv_heads=2, seq=64, head_dim=16, causal=True, docs=False, seed=5)
    results = dist(4).run(_ring_worker, case, "zigzag", torch.bfloat16, "auto", grad_dtype)
    _check_against_reference(case, results, "zigzag", atol=2e-2, rtol=2e-2, dtype=torch.bfloat16)


def test_ring_packed_sequences_cp4(dist):
    """Many short documents, boundaries on shard edges: zig-zag blocks full of empty rows."""
    case = Case(cp=4, batch=2, heads=4, kv_heads=2, seq=32, head_dim=8, causal=True, docs=True, seed=11)
    _check_against_reference(case, dist(4).run(_ring_worker, case, "zigzag"), "zigzag")
    case = replace(case, causal=False, seed=12)
    _check_against_reference(case, dist(4).run(_ring_worker, case, "contiguous"), "contiguous")


def test_misuse_raises_on_every_rank_before_any_collective(dist):
    results = dist(2).run(_bad_calls_worker)
    assert results[0] == results[1]
    expect = ["must divide the number of q heads", "multiple of 2*cp = 4", "dropout", "equal length",
              "multiple of 2*cp = 4", "multiple of 4"]
    for message, fragment in zip(results[0], expect):
        assert fragment in message, (fragment, message)
