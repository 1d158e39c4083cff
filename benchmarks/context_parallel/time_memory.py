"""Sections 3 and 4 of the context-parallel benchmark: step time (interleaved, paired ratios) and
memory per rank against sequence length."""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence

from benchmarks.report import mib, paired, ratio, table

# ---------------------------------------------------------------------------------- (3) time


def per_rep(times: list[list[list[float]]], name: str) -> list[float]:
    """Wall seconds per repetition: the slowest rank (a step ends when every rank is done)."""
    ranks = [t[name] for t in times]
    reps = max(len(r) for r in ranks)
    return [max(r[i][0] for r in ranks if r and r[i]) for i in range(reps)]


def cpu_rep(times: list[dict], name: str) -> list[float]:
    """CPU seconds per repetition summed over ranks: on shared cores the CPU a step burns, beside its wall time."""
    ranks = [t[name] for t in times]
    reps = max(len(r) for r in ranks)
    return [sum(r[i][1] for r in ranks if r and r[i]) for i in range(reps)]


def time_rows(times: list[dict], baselines: list[str], extra: Callable[[str], list[str]]) -> list[list[str]]:
    """Table rows (median, best, CPU) per timed variant with its ratio to each baseline, measured in the same run."""
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
    """Section 3: attention and whole-model step times against the single-process baselines of the same run."""
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
    """Why torch's experimental CP has a row or not, so a missing peer is explained rather than silently absent."""
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
    """Section 4: saved bytes per rank against cp=1's divided by cp, the memory claim CP exists for."""
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
    """The largest peak of the ranks that reported one, formatted (none: not measured on this platform)."""
    peaks = [r[key] for r in recs if r[key] is not None]
    return mib(max(peaks) if peaks else None)


