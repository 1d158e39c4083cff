"""Context-parallel attention on a CPU gloo mesh: work balance, bytes vs theory, step time, memory.

    .venv/bin/python benchmarks/context_parallel.py [--cp 4] [--seq 1024] [--quick] [--gpu] [--out FILE]

The script forks its own gloo ranks (one process group per world size; the per-rank code is in
`benchmarks/_cp_worker.py`) and prints markdown:

1. attention work per rank for ring (contiguous), zig-zag ring, Ulysses and USP: score elements
   from `ring_schedule`/`score_elements`, checked against the attention kernels that actually ran;
2. bytes each rank sends per attention call, forward and backward, counted on the real collectives
   and compared with the theoretical volume of each algorithm, and the Ring/Ulysses ratio vs the rule
   P*Hkv/(H+Hkv) from the field notes;
3. fwd+bwd time of the attention op and of a tiny HF Llama step through `meshkit.parallelize`, vs
   torch's experimental `context_parallel` where it runs (else the reason), vs the naive all-gather
   baseline and vs one process doing the full sequence;
4. memory per rank vs sequence length (saved-for-backward bytes, the longest K/V run a rank ever
   holds, peak RSS);
5. with `--gpu` and a CUDA device: kernel efficiency of ring blocks vs one full SDPA call.

Timings on a shared 2-core machine are noisy: variants are interleaved and medians (and medians of
per-repetition ratios) are printed. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import _cp_worker as worker  # benchmarks/ is on sys.path when this file runs as a script
import _launch  # benchmarks/ is on sys.path when this file runs as a script
import torch

from meshkit.context_parallel import kv_replication, score_elements

FP32 = 4
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}

# ---------------------------------------------------------------------------------- helpers


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table; numbers arrive already formatted so each column keeps its own precision."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f}"


def ratio(a: float, b: float) -> str:
    return "n/a" if not b else f"{a / b:.2f}"


def kinds_for(cp: int, heads: int, ulysses: int) -> list[str]:
    """The kinds a cp group can run: Ulysses needs heads % cp == 0, USP a proper Ulysses divisor."""
    out = ["ring", "zigzag"] + (["ulysses"] if heads % cp == 0 else [])
    return out + ([worker.usp_name(ulysses)] if cp >= 4 and cp % ulysses == 0 and cp > ulysses else [])


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
    forward = (n - 1) * 2 * kv_elems * itemsize
    return forward, forward + n * 2 * kv_elems * FP32


def _ulysses_bytes(P: int, token_elems: int, H: int, Hkv: int, itemsize: int) -> tuple[float, float]:
    rep = kv_replication(H, Hkv, P)
    one_way = (P - 1) / P * token_elems * itemsize * ((H + 2 * Hkv * rep) + H)
    return one_way, one_way


def _calls(record: list[dict], phase: str) -> str:
    calls = record[0]["calls"]
    return ", ".join(f"{k.split(':')[1]} x{v}" for k, v in sorted(calls.items()) if k.startswith(phase)) or "none"


def bytes_section(shape: dict, counts: dict[int, dict], ulysses: int, dtypes: Sequence[str],
                  torch_cp: dict[int, dict]) -> list[str]:
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


# ---------------------------------------------------------------------------------- (3) time


def per_rep(times: list[list[list[float]]], name: str) -> list[float]:
    """Wall seconds per repetition: the slowest rank (a step ends when every rank is done)."""
    ranks = [t[name] for t in times]
    reps = max(len(r) for r in ranks)
    return [max(r[i][0] for r in ranks if r and r[i]) for i in range(reps)]


def cpu_rep(times: list[dict], name: str) -> list[float]:
    ranks = [t[name] for t in times]
    reps = max(len(r) for r in ranks)
    return [sum(r[i][1] for r in ranks if r and r[i]) for i in range(reps)]


def paired(a: list[float], b: list[float]) -> float:
    """Median of per-repetition ratios: both ran back to back in every repetition, so load that
    drifts across the run cancels."""
    return statistics.median(x / y for x, y in zip(a, b))


def time_rows(times: list[dict], baselines: list[str], extra: Callable[[str], list[str]]) -> list[list[str]]:
    names = list(times[0])
    walls = {n: per_rep(times, n) for n in names}
    rows = []
    for name in names:
        w = walls[name]
        cells = [name, f"{statistics.median(w) * 1e3:.1f}", f"{min(w) * 1e3:.1f}",
                 f"{statistics.median(cpu_rep(times, name)) * 1e3:.0f}"]
        cells += [f"{paired(w, walls[b]):.2f}" if b in walls else "n/a" for b in baselines]
        rows.append(cells + extra(name))
    return rows


def time_section(res: dict, cp: int, shape: dict, model: dict, reps: tuple[int, int],
                 torch_hf: str | None) -> list[str]:
    att = [r["attention_time"] for r in res["ranks"]]
    hf = [r["hf_time"] for r in res["ranks"]]
    single_att, single_hf = "single process (full SDPA)", "single process (plain HF)"
    torch_att = res["ranks"][0]["torch_cp"]["reason"]
    errors = att[0]["max_error"]
    lines = [
        f"## 3. Step time at cp={cp} (forward + backward; {reps[0]} / {reps[1]} interleaved repetitions)",
        "",
        f"{cp} gloo ranks x 1 thread share {os.cpu_count()} cores (and the machine's other load), while the "
        "single-process baseline runs one thread: the best possible 'wall / single process' is "
        f"1/min(cp, cores) = {1 / min(cp, os.cpu_count() or 1):.2f}, so these ratios measure overheads under "
        "oversubscription, not scaling. wall = slowest rank per repetition; CPU = process CPU time summed over "
        "ranks (all the work, gloo threads included; compare it with the single process's to see the extra "
        "work CP adds). Ratios are medians of per-repetition ratios (< 1: faster than the baseline).",
        "",
        f"### Attention op alone (B={shape['batch']}, H={shape['heads']}, Hkv={shape['kv_heads']}, "
        f"D={shape['head_dim']}, S={shape['seq']}, fp32)",
        "",
    ]
    base = [single_att, "all-gather KV"]
    lines += table(["variant", "median wall ms", "min wall ms", "median CPU ms (all ranks)", "wall / single process",
                    "wall / all-gather KV", "max abs err vs single"],
                   time_rows([a["times"] for a in att], base,
                             lambda n: [f"{errors[n]:.1e}" if n in errors else "—"]))
    lines += _torch_cp_line(torch_att, "attention op")
    lines += [f"### Tiny HF Llama step through meshkit.parallelize (hidden {model['hidden']}, {model['layers']} "
              f"layers, heads {model['heads']}/{model['kv_heads']}, vocab {model['vocab']}, S={shape['seq']}; "
              "fwd+bwd, FSDP over cp included, no optimizer)", ""]
    losses = hf[0]["losses"]
    lines += table(["variant", "median wall ms", "min wall ms", "median CPU ms (all ranks)", "wall / single process",
                    "wall / all-gather KV", "loss"],
                   time_rows([h["times"] for h in hf], [single_hf, "all-gather KV"],
                             lambda n: [f"{losses[n]:.6f}" if losses.get(n) is not None else "—"]))
    lines.append("The all-gather row is meshkit's ring plan with each layer's attention swapped for the all-gather "
                 "baseline (same sharding, loss and FSDP), so the rows differ only in attention.")
    lines += _torch_cp_line(torch_hf, "HF Llama step")
    return lines


def _torch_cp_line(reason: str | None, what: str) -> list[str]:
    if reason is None:
        return ["torch experimental CP ran (row 'torch CP (alltoall ring)'): it reshards its buffers inside "
                "the context manager on every call, which is included in its time.", ""]
    lines = [f"**torch experimental `context_parallel` ({what}, `set_rotate_method('alltoall')`): no ratio, it "
             f"refused to run here:** {reason.rstrip('.')}. It dispatches only the CUDA SDPA ops (flash, efficient, cuDNN); "
             "on CPU, SDPA lowers to `_scaled_dot_product_flash_attention_for_cpu`, which has no DTensor "
             "sharding rule."]
    if "stuck in a collective" in reason:
        lines.append("The ranks fail at different points because HF reads the position ids of a load-balanced "
                     "shard (rank r holds chunks r and 2cp-1-r) as packed documents whenever the two chunks are "
                     "not adjacent, and passes an attention mask on those ranks only; torch CP wraps that mask "
                     "into a DTensor too and redistributes it, while the rank holding adjacent chunks goes "
                     "straight to the kernel and fails there. (Probed in a throwaway world of its own.)")
    return lines + [""]


# -------------------------------------------------------------------------------- (4) memory


def memory_section(res: dict, cp: int, shape: dict, seqs: Sequence[int]) -> list[str]:
    ranks = [r["memory"] for r in res["ranks"]]
    lines = [
        f"## 4. Memory per rank vs sequence length (cp=1 vs cp={cp}, fp32, B={shape['batch']}, H={shape['heads']}, "
        f"Hkv={shape['kv_heads']}, D={shape['head_dim']})",
        "",
        "saved = bytes autograd keeps for backward (saved_tensors_hooks, one count per storage; includes the "
        "local q,k,v shards the op saves). ideal = cp=1's saved / cp. longest K/V run = the most sequence "
        "positions in any [.., S, D] tensor created during fwd+bwd (S/cp means the rank never held "
        "full-sequence K/V). peak RSS = highest RSS during the forward, and during the backward, above the RSS "
        "before the forward (the kernel's high-water mark, reset through /proc/self/clear_refs), max over ranks. cp=1 is meshkit's local attention op over the whole sequence on rank 0.",
        "",
    ]
    rows = []
    for seq in seqs:
        single = ranks[0].get(f"{seq}|cp=1")
        for name in ["cp=1"] + [k.split("|", 1)[1] for k in ranks[0] if k.startswith(f"{seq}|") and k != f"{seq}|cp=1"]:
            recs = [r[f"{seq}|{name}"] for r in ranks if f"{seq}|{name}" in r]
            saved = max(r["saved"] for r in recs)
            ideal = single["saved"] / (1 if name == "cp=1" else cp) if single else None
            extent = max(r["extent"] for r in recs)
            rows.append([seq, name, mib(saved), mib(ideal), ratio(saved, ideal or 0),
                         f"{extent} ({'S' if extent == seq else f'S/{seq // extent}' if extent else '-'})",
                         _peak(recs, "peak_fwd"), _peak(recs, "peak_bwd")])
    lines += table(["S", "variant", "saved MiB / rank", "ideal MiB", "saved / ideal", "longest K/V run",
                    "peak RSS rise in fwd MiB", "peak RSS rise in bwd MiB"], rows)
    lines += [
        "Reading it: ring and zig-zag save exactly 1/cp of cp=1 (their local q, k, v, out, lse) and never hold "
        "more than S/cp positions of K/V. Ulysses holds the whole sequence for H/P heads by design, and saves "
        "1/cp plus its replicated K/V heads (x P/gcd(Hkv, P)). USP holds the ring rank's zig-zag piece "
        "(S/ring degree). The all-gather baseline holds full K/V, and SDPA turns its [S/cp, S] boolean mask "
        "into an additive float mask that it also saves, which dominates at long S. Peak RSS includes "
        "transients, so it scales less cleanly than the saved bytes: the ring forward holds its fp32 output "
        "accumulator and the block's output (each the size of the local output; the merge is an in-place lerp_ "
        "and adds no temporary of that size) "
        "plus two K/V blocks, and the backward holds the fp32 dQ accumulator and dK/dV buffers in flight.",
        "",
    ]
    return lines


def _peak(recs: list[dict], key: str) -> str:
    peaks = [r[key] for r in recs if r[key] is not None]
    return mib(max(peaks) if peaks else None)


# ------------------------------------------------------------------------------------ (5) GPU


def gpu_section(args: argparse.Namespace) -> list[str]:
    lines = ["## 5. GPU: kernel efficiency of ring blocks vs one SDPA call", ""]
    if not args.gpu:
        return lines + ["Not requested (pass `--gpu`; it runs only when torch.cuda.is_available()).", ""]
    if not torch.cuda.is_available():
        return lines + ["Skipped: torch.cuda.is_available() is False on this machine.", ""]
    shape = {"batch": 1, "heads": args.gpu_heads, "kv_heads": args.gpu_kv_heads, "head_dim": args.gpu_head_dim}
    lines += [f"{torch.cuda.get_device_name()}, bf16, B=1, H={shape['heads']}, Hkv={shape['kv_heads']}, "
              f"D={shape['head_dim']}; CUDA-event medians of {args.gpu_reps} reps after warm-up. (a) one ring step: "
              "meshkit's block fwd+bwd (out + lse, backward from final out/lse) on an S/cp x S/cp off-diagonal "
              "block vs F.scaled_dot_product_attention fwd+bwd on the same shapes (same work). (b) every block "
              "kernel + merge of one zig-zag rank over a whole ring turn, no communication, vs a full causal SDPA "
              "fwd+bwd on S divided by cp (the ideal share). efficiency = SDPA time / meshkit time.", ""]
    rows = []
    for seq in args.gpu_seqs:
        for cp in (4, 8):
            try:
                rows.append([seq, cp] + gpu_rows(dict(shape, seq=seq), cp, torch.device("cuda"), torch.bfloat16,
                                                  args.gpu_reps))
            except Exception as e:  # noqa: BLE001 - report the kernel's refusal, keep the other rows
                rows.append([seq, cp, f"failed: {worker.first_line(e)}", "", "", "", "", ""])
    return lines + table(["S", "cp", "(a) block ms", "(a) SDPA ms", "(a) efficiency", "(b) zig-zag turn ms",
                          "(b) full SDPA / cp ms", "(b) efficiency"], rows)


def device_timer(device: torch.device, reps: int) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of fn: CUDA events on a GPU (kernels are async), perf_counter elsewhere."""

    def measure(fn: Callable[[], Any]) -> float:
        for _ in range(2):
            fn()
        samples = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    return measure


def gpu_rows(shape: dict, cp: int, device: torch.device, dtype: torch.dtype, reps: int) -> list[str]:
    """(a) and (b) of the GPU section for one (S, cp); device-agnostic so it can be smoke-tested on CPU."""
    import torch.nn.functional as F

    from meshkit.context_parallel import ring_schedule, shard
    from meshkit.context_parallel.kernels import attention_backward, attention_forward

    B, H, Hkv, S, D = shape["batch"], shape["heads"], shape["kv_heads"], shape["seq"], shape["head_dim"]
    g = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(B, H, S, D, generator=g, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, Hkv, S, D, generator=g, device=device, dtype=dtype) for _ in range(2))
    measure = device_timer(device, reps)
    n = S // cp

    def sdpa(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor, d_: torch.Tensor, causal: bool) -> None:
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q_, k_, v_))
        F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=Hkv != H).backward(d_)

    # An off-diagonal block: the queries of the second shard against the keys of the first.
    qi, kj, vj, di = (t.contiguous() for t in (q[:, :, n:2 * n], k[:, :, :n], v[:, :, :n], dout[:, :, n:2 * n]))

    def block() -> None:
        out, lse = attention_forward(qi, kj, vj)
        attention_backward(di, qi, kj, vj, out, lse)

    a_block = measure(block)
    a_sdpa = measure(lambda: sdpa(qi, kj, vj, di, False))
    shards = {name: [shard(t, "zigzag", cp, r, dim=2) for r in range(cp)]
              for name, t in (("q", q), ("k", k), ("v", v), ("d", dout))}
    plan = ring_schedule("zigzag", True, cp, 0)
    b_turn = measure(lambda: _zigzag_turn(shards, plan, attention_forward, attention_backward))
    b_full = measure(lambda: sdpa(q, k, v, dout, True)) / cp
    return [f"{a_block:.3f}", f"{a_sdpa:.3f}", f"{a_sdpa / a_block:.2f}", f"{b_turn:.3f}", f"{b_full:.3f}",
            f"{b_full / b_turn:.2f}"]


def _half(x: torch.Tensor, half: int | None) -> torch.Tensor:
    return x if half is None else x.narrow(2, half * (x.shape[2] // 2), x.shape[2] // 2)


def _zigzag_turn(shards: dict, plan: list, forward: Callable, backward: Callable) -> None:
    """Rank 0's block kernels for one zig-zag turn: forward + fp32 merge, then backward from the final
    out/lse, exactly the computation ring.py runs between its transfers."""
    from meshkit.context_parallel import merge_

    q, d = shards["q"][0], shards["d"][0]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
    for blk in plan:
        kv = (_half(shards["k"][blk.src], blk.kv_half), _half(shards["v"][blk.src], blk.kv_half))
        o_i, l_i = forward(_half(q, blk.q_half), *kv, causal_kind="causal" if blk.causal else "none")
        merge_(_half(out, blk.q_half), _half(lse, blk.q_half), o_i, l_i)
    final = out.to(q.dtype)
    for blk in plan:
        kv = (_half(shards["k"][blk.src], blk.kv_half), _half(shards["v"][blk.src], blk.kv_half))
        backward(_half(d, blk.q_half), _half(q, blk.q_half), *kv, _half(final, blk.q_half), _half(lse, blk.q_half),
                 causal_kind="causal" if blk.causal else "none")


# ---------------------------------------------------------------------------------- driver



def launch(world: int, spec: dict) -> dict:
    """Fork `world` gloo ranks running this benchmark's worker; rank 0's JSON result."""
    return _launch.launch(worker.run, world, spec)


def probe_hf_torch_cp(world: int, spec: dict) -> dict[int, str | None]:
    """Each rank's outcome of one HF step under torch's experimental CP, from a throwaway world
    (one layer and a short sequence: the question is whether it runs, not how fast)."""
    spec = dict(spec, model=dict(spec["model"], layers=1), shape=dict(spec["shape"], seq=16 * world))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            torch.multiprocessing.start_processes(worker.probe_hf_torch_cp, args=(world, _launch.free_port(), spec, tmp),
                                                  nprocs=world, start_method="fork")
        except Exception as e:  # noqa: BLE001 - a rank killed by gloo still leaves the others' reasons
            print(f"[context_parallel] torch CP probe world ended with {worker.first_line(e)}", file=sys.stderr)
        outcomes: dict[int, str | None] = {}
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.json")
            outcomes[rank] = json.load(open(path))["reason"] if os.path.exists(path) else "no report (rank died)"
        return outcomes


def describe_outcomes(outcomes: dict[int, str | None]) -> str | None:
    """None if every rank ran; else each distinct reason with the ranks that hit it."""
    if all(r is None for r in outcomes.values()):
        return None
    by_reason: dict[str, list[int]] = {}
    for rank, reason in outcomes.items():
        if reason and "by peer" in reason:  # gloo's "Connection closed/reset by peer"
            reason = ("gloo lost its peer: stuck in a collective that a failed rank never joined, until that "
                      "rank exited")
        by_reason.setdefault(reason or "ran", []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {reason}"
                     for reason, r in by_reason.items())


def header(args: argparse.Namespace, worlds: Sequence[int], spec: dict) -> list[str]:
    import transformers

    import meshkit

    s = spec["shape"]
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return [
        "# meshkit context-parallel benchmark",
        "",
        f"- command: `{shlex.join([os.path.relpath(sys.executable)] + sys.argv)}`",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPU cores (load average {load} at start); meshkit from "
        f"`{os.path.dirname(meshkit.__file__)}`",
        f"- backend gloo on CPU, 1 thread per rank; world sizes launched: {', '.join(map(str, worlds))} "
        f"(main cp={args.cp}; cp=8 rows in section 1 are from the schedule"
        + (" and a run" if 8 in worlds else " only") + ")",
        f"- attention shape: B={s['batch']}, H={s['heads']}, Hkv={s['kv_heads']} (GQA {s['heads'] // s['kv_heads']}:1), "
        f"D={s['head_dim']}, S={s['seq']}; USP uses cp_ulysses={spec['ulysses']}",
        "",
    ]


def make_spec(args: argparse.Namespace) -> dict:
    return {
        "shape": {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "seq": args.seq},
        "model": {"hidden": args.heads * 32, "layers": 2, "heads": args.heads, "kv_heads": args.kv_heads,
                  "inter": args.heads * 64, "vocab": 1024},
        "dtypes": ["float32", "bfloat16"],
        "ulysses": 2,
        "reps": args.reps,
        "hf_reps": args.hf_reps,
        "warmup": 1,
        "mem_seqs": args.mem_seqs,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=4, help="cp degree of the timing and memory sections")
    p.add_argument("--seq", type=int, default=1024, help="sequence length of sections 1-3")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=None, help="attention-op repetitions (default 15, quick 7)")
    p.add_argument("--hf-reps", type=int, default=None, help="HF step repetitions (default 7, quick 3)")
    p.add_argument("--mem-seqs", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated lengths for section 4 (default 512..8192, quick 512..2048)")
    p.add_argument("--quick", action="store_true", help="under ~2 minutes: no cp=8 run, fewer reps and lengths")
    p.add_argument("--gpu", action="store_true", help="add section 5 (runs only with a CUDA device)")
    p.add_argument("--gpu-seqs", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768])
    p.add_argument("--gpu-heads", type=int, default=32)
    p.add_argument("--gpu-kv-heads", type=int, default=8)
    p.add_argument("--gpu-head-dim", type=int, default=128)
    p.add_argument("--gpu-reps", type=int, default=10)
    p.add_argument("--out", help="also write the markdown here (e.g. benchmarks/results/context_parallel.md)")
    args = p.parse_args(argv)
    _validate(p, args)
    args.reps = args.reps or (7 if args.quick else 15)
    args.hf_reps = args.hf_reps or (3 if args.quick else 7)
    args.mem_seqs = args.mem_seqs or ([512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096, 8192])
    return args


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fail before forking anything: zig-zag needs 2*cp equal chunks at every world launched."""
    multiple = 2 * max(args.cp, 2 if args.quick else 8)
    bad = [s for s in [args.seq] + (args.mem_seqs or []) if s % multiple]
    if bad:
        p.error(f"sequence lengths {bad} must be multiples of {multiple} (2 x the largest cp launched)")
    if args.cp < 2 or args.heads % args.kv_heads:
        p.error("need --cp >= 2 and --heads divisible by --kv-heads")


def preload() -> None:
    """Import what the ranks use before forking them, so no rank pays for the imports again."""
    import transformers.models.llama.modeling_llama  # noqa: F401

    import meshkit  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    start = time.perf_counter()
    preload()
    spec = make_spec(args)
    worlds = sorted({2, args.cp} | (set() if args.quick else {8}))
    print(f"[context_parallel] cp={args.cp}: torch CP probe on the HF model", file=sys.stderr, flush=True)
    torch_hf = describe_outcomes(probe_hf_torch_cp(args.cp, spec))
    spec["torch_cp_hf_ok"] = torch_hf is None
    results: dict[int, dict] = {}
    for world in worlds:
        sections = ["counts"] + (["time", "memory"] if world == args.cp else [])
        print(f"[context_parallel] cp={world}: {', '.join(sections)} ({time.perf_counter() - start:.0f}s)",
              file=sys.stderr, flush=True)
        results[world] = launch(world, dict(spec, sections=sections))
    counts = {w: _by_kind(r) for w, r in results.items()}
    torch_cp = {w: r["ranks"][0]["torch_cp"] for w, r in results.items()}
    shape = spec["shape"]
    lines = header(args, worlds, spec)
    lines += work_section(shape, sorted({2, 4, 8} | {args.cp}), spec["ulysses"], counts)
    lines += step_detail(shape, args.cp)
    lines += bytes_section(shape, counts, spec["ulysses"], spec["dtypes"], torch_cp)
    lines += time_section(results[args.cp], args.cp, shape, spec["model"], (args.reps, args.hf_reps), torch_hf)
    lines += memory_section(results[args.cp], args.cp, shape, args.mem_seqs)
    lines += gpu_section(args)
    lines.append(f"Total runtime {time.perf_counter() - start:.0f} s.")
    _launch.emit(lines, args.out)
    return 0


def _by_kind(result: dict) -> dict[str, list[dict]]:
    """'kind|dtype' -> one record per rank."""
    keys = result["ranks"][0].get("counts", {})
    return {key: [r["counts"][key] for r in result["ranks"]] for key in keys}


if __name__ == "__main__":
    sys.exit(main())
