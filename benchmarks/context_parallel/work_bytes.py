"""Sections 1 and 2 of the context-parallel benchmark: attention work per rank and bytes per call,
each measured on the ranks and set against its theory (`ring_schedule`/`score_elements` for the
work, the volume of each algorithm for the bytes)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from benchmarks.context_parallel.ranks import usp_name
from benchmarks.report import ratio, table
from meshkit.context_parallel import kv_replication, score_elements

FP32 = 4
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def kinds_for(cp: int, heads: int, ulysses: int) -> list[str]:
    """The kinds a cp group can run: Ulysses needs heads % cp == 0, USP a proper Ulysses divisor."""
    out = ["ring", "zigzag"] + (["ulysses"] if heads % cp == 0 else [])
    return out + ([usp_name(ulysses)] if cp >= 4 and cp % ulysses == 0 and cp > ulysses else [])


# ------------------------------------------------------------------------- (1) work, theory


def expected_kernels(kind: str, cp: int, rank: int, shape: dict, ulysses: int) -> list[tuple[int, int]]:
    """(scores per batch row and q head, batch*heads) of every forward kernel call `rank` makes.

    ring/zigzag: the nonzero entries of `score_elements` (skipped blocks issue no call); Ulysses: one
    causal call over the whole sequence for H/P heads; USP: the zig-zag ring over cp/U ranks for H/U
    heads; all-gather: one masked (not causal-skipping) call of S_local x S for all heads.
    """
    B, H, S = shape["batch"], shape["heads"], shape["seq"]
    if kind in ("ring", "zigzag"):
        layout = "contiguous" if kind == "ring" else "zigzag"
        return [(e, B * H) for e in score_elements(layout, True, cp, rank, S // cp) if e]
    if kind == "ulysses":
        return [(S * (S + 1) // 2, B * H // cp)]
    if kind.startswith("usp"):
        ring = cp // ulysses
        steps = score_elements("zigzag", True, ring, rank // ulysses, S // ring)
        return [(e, B * H // ulysses) for e in steps if e]
    return [((S // cp) * S, B * H)]  # all-gather KV


def rank_scores(kind: str, cp: int, rank: int, shape: dict, ulysses: int) -> int:
    """Score elements one rank should compute for a kind (the schedule's expected kernels), to check the measured ones."""
    return sum(e * bh for e, bh in expected_kernels(kind, cp, rank, shape, ulysses))


def step_scores(kind: str, cp: int, shape: dict, ulysses: int) -> list[list[int]]:
    """Per rank, per ring step: scores summed over batch and the heads the rank computes."""
    B, H, S = shape["batch"], shape["heads"], shape["seq"]
    if kind in ("ring", "zigzag"):
        layout = "contiguous" if kind == "ring" else "zigzag"
        return [[e * B * H for e in score_elements(layout, True, cp, r, S // cp)] for r in range(cp)]
    if kind.startswith("usp"):
        ring = cp // ulysses
        return [[e * B * H // ulysses for e in score_elements("zigzag", True, ring, r // ulysses, S // ring)]
                for r in range(cp)]
    return [[rank_scores(kind, cp, r, shape, ulysses)] for r in range(cp)]


def kernel_check(kind: str, cp: int, shape: dict, ulysses: int, record: dict | None) -> str:
    """Compare the kernels every rank ran (forward and backward) with the schedule; '—' if not run."""
    if record is None:
        return "—"
    calls = 0
    for rank, counts in enumerate(record):
        want = expected_kernels(kind, cp, rank, shape, ulysses)
        fwd = [(k[0], k[1]) for k in counts["kernels"]["fwd"]]
        bwd = [(k[0], k[1]) for k in counts["kernels"]["bwd"]]
        if fwd != want or bwd != want:
            return f"MISMATCH on rank {rank}: fwd {fwd[:4]} bwd {bwd[:4]} vs schedule {want[:4]}"
        calls += len(fwd)
    return f"yes ({calls} fwd + {calls} bwd calls)"


def work_section(shape: dict, cps: Sequence[int], ulysses: int, counts: dict[int, dict]) -> list[str]:
    """Section 1: attention work per rank and per step, the load balance zig-zag is for."""
    S, B, H = shape["seq"], shape["batch"], shape["heads"]
    triangle = B * H * S * (S + 1) // 2
    lines = [
        "## 1. Attention work per rank (causal, score elements)",
        "",
        f"Scores = query-key pairs a rank's kernels evaluate, summed over batch and the q heads it computes "
        f"(B={B}, H={H}, S={S}); a causal diagonal block counts its triangle. 'per-step max/min' is the worst "
        "ring step (ranks run steps in lock-step, so an idle rank waits for the busiest). 'kernels = "
        "schedule' replays every attention kernel call the ranks issued (forward and backward, fp32 run) "
        "against `ring_schedule`/`score_elements`.",
        "",
    ]
    rows = []
    for cp in cps:
        for kind in kinds_for(cp, H, ulysses) + ["all-gather KV"]:
            per_rank = [rank_scores(kind, cp, r, shape, ulysses) for r in range(cp)]
            steps = step_scores(kind, cp, shape, ulysses)
            worst = max((max(col) / min(col) if min(col) else math.inf) for col in zip(*steps))
            record = counts.get(cp, {}).get(f"{kind}|float32")
            rows.append([kind, cp, f"{min(per_rank) / 1e6:.2f} – {max(per_rank) / 1e6:.2f}",
                         f"{max(per_rank) / min(per_rank):.2f}", "inf" if math.isinf(worst) else f"{worst:.2f}",
                         f"{sum(per_rank) / triangle:.3f}", kernel_check(kind, cp, shape, ulysses, record)])
    lines += table(["kind", "cp", "scores per rank (M, min – max)", "max/min", "per-step max/min",
                    "total / causal triangle", "kernels = schedule"], rows)
    lines.append("all-gather KV: one masked SDPA call of S/cp queries x S keys; the CPU kernel gets no causal "
                 "flag there, so it evaluates the masked half too (total ~2x the triangle).")
    lines.append("")
    return lines


def step_detail(shape: dict, cp: int) -> list[str]:
    """Per-rank, per-step scores for the two ring layouts at the main cp: the imbalance made visible."""
    lines = [f"Per-step scores (thousands) at cp={cp}: rank r holds its own block at step 0 and the block "
             "of rank r-s at step s.", ""]
    for kind in ("ring", "zigzag"):
        steps = step_scores(kind, cp, shape, 1)
        rows = [[kind, r] + [f"{e / 1e3:,.0f}" for e in steps[r]] + [f"{sum(steps[r]) / 1e3:,.0f}"]
                for r in range(cp)]
        lines += table(["kind", "rank"] + [f"step {s}" for s in range(cp)] + ["total"], rows)
    return lines


# ------------------------------------------------------------------------ (2) bytes, theory


def theory_bytes(kind: str, cp: int, shape: dict, itemsize: int, ulysses: int) -> tuple[float, float]:
    """Bytes one rank sends (forward, backward) for one attention call.

    ring/zigzag: forward passes K/V (cp-1) times; backward passes K/V again (cp-1) times plus the fp32
    dK/dV buffer cp times (it travels a full turn back to its owner). GQA heads are never repeated.
    Ulysses: (P-1)/P of the packed q,k,v (K/V replicated P/gcd(Hkv,P) times) and of the output,
    forward; the same volumes backward (dout, then dq,dk,dv). USP: Ulysses over U ranks on the local
    shard, then the ring over cp/U ranks with H/U heads. all-gather: (P-1)/P of the gathered K/V
    forward and of the reduce-scattered dK/dV (input dtype) backward.
    """
    B, H, Hkv, S, D = shape["batch"], shape["heads"], shape["kv_heads"], shape["seq"], shape["head_dim"]
    if kind in ("ring", "zigzag"):
        return _ring_bytes(cp, B * Hkv * (S // cp) * D, itemsize)
    if kind == "ulysses":
        return _ulysses_bytes(cp, B * (S // cp) * D, H, Hkv, itemsize)
    if kind.startswith("usp"):
        rep = kv_replication(H, Hkv, ulysses)
        a2a = _ulysses_bytes(ulysses, B * (S // cp) * D, H, Hkv, itemsize)
        ring = _ring_bytes(cp // ulysses, B * (Hkv * rep // ulysses) * (S // (cp // ulysses)) * D, itemsize)
        return a2a[0] + ring[0], a2a[1] + ring[1]
    kv = (cp - 1) / cp * 2 * B * Hkv * S * D * itemsize
    return kv, kv


def _ring_bytes(n: int, kv_elems: int, itemsize: int) -> tuple[float, float]:
    """Ring theory (forward, backward): K/V blocks sent n-1 times; backward sends them again and dK/dV n times in fp32."""
    forward = (n - 1) * 2 * kv_elems * itemsize
    return forward, forward + n * 2 * kv_elems * FP32


def _ulysses_bytes(P: int, token_elems: int, H: int, Hkv: int, itemsize: int) -> tuple[float, float]:
    """Theory for Ulysses: the (P-1)/P of q, k, v (replicated KV heads counted) and the output that leave the rank, each way."""
    rep = kv_replication(H, Hkv, P)
    one_way = (P - 1) / P * token_elems * itemsize * ((H + 2 * Hkv * rep) + H)
    return one_way, one_way


def _calls(record: list[dict], phase: str) -> str:
    """The collective calls of one phase, for the table (a kind's byte count alone hides a call-count regression)."""
    calls = record[0]["calls"]
    return ", ".join(f"{k.split(':')[1]} x{v}" for k, v in sorted(calls.items()) if k.startswith(phase)) or "none"


def bytes_section(shape: dict, counts: dict[int, dict], ulysses: int, dtypes: Sequence[str],
                  torch_cp: dict[int, dict]) -> list[str]:
    """Section 2: bytes each rank sends, measured on the collectives against the closed forms above."""
    lines = [
        "## 2. Bytes sent per rank per attention call (measured on the collectives vs theory)",
        "",
        "Measured: every c10d / functional collective seen by a TorchDispatchMode on each rank, forward and "
        "backward (autograd's own collectives included); a send counts its buffer, an all-to-all the "
        "(n-1)/n of its input that leaves the rank, all-gather/reduce-scatter (n-1)/n of the full buffer. "
        "The max over ranks is shown (ranks are symmetric here). Theory: see `theory_bytes` — ring "
        "forward (cp-1) x packed K+V of one shard (Hkv heads, never repeated), backward the same plus cp x "
        "packed dK+dV in fp32; Ulysses (P-1)/P of q,k,v (+KV replication) and out, each way.",
        "",
    ]
    rows = []
    for cp in sorted(counts):
        for dtype in dtypes:
            for kind in kinds_for(cp, shape["heads"], ulysses) + ["all-gather KV"]:
                record = counts[cp].get(f"{kind}|{dtype}")
                if record is None:
                    continue
                fwd = max(r["sent"].get("fwd", 0) for r in record)
                bwd = max(r["sent"].get("bwd", 0) for r in record)
                t_fwd, t_bwd = theory_bytes(kind, cp, shape, ITEMSIZE[dtype], ulysses)
                rows.append([kind, cp, dtype, f"{fwd:,}", f"{t_fwd:,.0f}", ratio(fwd, t_fwd), f"{bwd:,}",
                             f"{t_bwd:,.0f}", ratio(bwd, t_bwd), _calls(record, "fwd"), _calls(record, "bwd")])
    lines += table(["kind", "cp", "dtype", "fwd measured B", "fwd theory B", "ratio", "bwd measured B",
                    "bwd theory B", "ratio", "fwd collectives (rank 0)", "bwd collectives (rank 0)"], rows)
    others = sorted({o for cp in counts for rec in counts[cp].values() for r in rec for o in r["other"]})
    if others:
        lines += [f"Collectives seen but not classified (not in the byte counts): {', '.join(others)}", ""]
    lines += _torch_cp_bytes(torch_cp)
    lines += ring_vs_ulysses(shape, counts)
    return lines


def _torch_cp_bytes(torch_cp: dict[int, dict]) -> list[str]:
    """torch's experimental CP bytes at each cp, or why it did not run, as the peer line of section 2."""
    lines = []
    for cp, res in sorted(torch_cp.items()):
        if res["reason"] is not None:
            lines.append(f"torch experimental CP at cp={cp}: not measured, it refused to run: {res['reason']}")
        else:
            sent = res["record"]["sent"]
            lines.append(f"torch experimental CP at cp={cp} (alltoall rotation, fp32): fwd {sent.get('fwd', 0):,} B, "
                         f"bwd {sent.get('bwd', 0):,} B sent by rank 0")
    return lines + [""]


def ring_vs_ulysses(shape: dict, counts: dict[int, dict]) -> list[str]:
    """Ring bytes over Ulysses bytes, measured, vs the notes' rule P*Hkv/(H+Hkv).

    The rule is the forward ratio without KV replication; with replication (P > Hkv) Ulysses sends
    rep x the K/V, so the exact forward ratio is P*Hkv/(H + rep*Hkv). Backward the ring also returns
    dK/dV in fp32, so the fwd+bwd ratio sits above the forward one.
    """
    H, Hkv = shape["heads"], shape["kv_heads"]
    rows = []
    for cp in sorted(counts):
        ring, uly = counts[cp].get("ring|float32"), counts[cp].get("ulysses|float32")
        if ring is None or uly is None:
            continue
        rf, uf = (max(r["sent"].get("fwd", 0) for r in rec) for rec in (ring, uly))
        rb, ub = (max(r["sent"].get("bwd", 0) for r in rec) for rec in (ring, uly))
        rep = kv_replication(H, Hkv, cp)
        rows.append([cp, f"{H}:{Hkv}", rep, ratio(rf, uf), ratio(rf + rb, uf + ub), f"{cp * Hkv / (H + Hkv):.2f}",
                     f"{cp * Hkv / (H + rep * Hkv):.2f}"])
    head = ["Ring / Ulysses bytes (fp32). The notes' rule P*Hkv/(H+Hkv) assumes no KV replication; Ulysses "
            "must replicate K/V heads when P > Hkv, which moves the forward ratio to P*Hkv/(H+rep*Hkv). Below 1 "
            "the ring moves fewer bytes (and overlaps them with compute).", ""]
    return head + table(["cp", "H:Hkv", "KV replication", "measured fwd", "measured fwd+bwd", "rule P*Hkv/(H+Hkv)",
                         "rule with replication"], rows)


