"""PNG charts for context parallelism: per-rank causal work balance and saved memory vs sequence length.

    python -m benchmarks.charts [--out benchmarks/results] [--cp 4]

Both charts are cheap (no processes): the balance chart counts attention scores with meshkit's own
`score_elements`, the same schedule its ring kernels run (`benchmarks.context_parallel` checks that
count against the kernels that actually ran). The memory chart plots the *measured* saved-for-backward
bytes from section 4 of benchmarks/results/context_parallel.md when that file exists (the runner
writes it just before this script runs), and otherwise an *analytic* count of the tensors the
attention op saves; the chart's title says which, so a reader never mistakes one for the other.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")  # headless: no display on a benchmark machine
import matplotlib.pyplot as plt  # noqa: E402

from meshkit.context_parallel import kv_replication, score_elements  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
FP32 = 4
# The attention shape of benchmarks.context_parallel's memory section (its defaults).
SHAPE = {"batch": 1, "heads": 8, "kv_heads": 2, "head_dim": 64}
SEQS = (512, 1024, 2048, 4096, 8192)
VARIANTS = ("cp=1", "ring", "zigzag", "ulysses")


# ------------------------------------------------------------------------------------- balance


def rank_work(layout: str, cp: int, seq: int) -> list[int]:
    """Causal score elements each rank computes over all ring steps (per batch row and head)."""
    return [sum(score_elements(layout, True, cp, rank, seq // cp)) for rank in range(cp)]


def balance_chart(path: Path, cp: int = 4, seq: int = 8192) -> dict[str, list[int]]:
    """Grouped bars, work relative to a perfect split: a contiguous ring leaves the last rank with
    ~2x the mean (it sees every earlier key), which sets the step time; zig-zag evens it out."""
    work = {"ring (contiguous)": rank_work("contiguous", cp, seq), "zig-zag ring": rank_work("zigzag", cp, seq)}
    ideal = (seq * (seq + 1) // 2) / cp
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    width = 0.38
    for i, (name, per_rank) in enumerate(work.items()):
        xs = [r + (i - 0.5) * width for r in range(cp)]
        ys = [w / ideal for w in per_rank]
        bars = ax.bar(xs, ys, width, label=f"{name}: max/mean {max(per_rank) / ideal:.2f}",
                      color=("tab:red", "tab:blue")[i])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="perfect balance (S(S+1)/2 / cp)")
    ax.set_xticks(range(cp), [f"rank {r}" for r in range(cp)])
    ax.set_ylabel("causal attention work / perfect share")
    ax.set_title(f"CP balance: per-rank causal attention work, cp={cp}, S={seq}\n"
                 "(score elements from meshkit's ring schedule; computed, not timed)", fontsize=10)
    ax.set_ylim(0, max(max(w) for w in work.values()) / ideal * 1.2)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return work


# -------------------------------------------------------------------------------------- memory


def analytic_saved(variant: str, seq: int, cp: int, shape: dict[str, int] = SHAPE) -> int:
    """Bytes meshkit's attention op saves per rank: fp32 local q, k, v, out and the per-row lse.

    Ring and zig-zag keep the S/cp shard of everything. Ulysses keeps all S positions of H/cp q heads
    and of the K/V heads each rank receives after replication (when Hkv < cp each K/V head is copied,
    which is why Ulysses saves more than S/cp's share). This reproduces section 4's measured table.
    """
    B, H, Hkv, D = shape["batch"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    if variant == "cp=1":
        s, hq, hkv = seq, H, Hkv
    elif variant in ("ring", "zigzag"):
        s, hq, hkv = seq // cp, H, Hkv
    elif variant == "ulysses":
        s, hq, hkv = seq, H // cp, Hkv * kv_replication(H, Hkv, cp) // cp
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return FP32 * B * s * (2 * hq * D + 2 * hkv * D + hq)  # q + out, k + v, lse


def measured_saved(md: Path) -> dict[str, dict[int, float]] | None:
    """{variant: {S: saved bytes per rank}} from context_parallel.md's section 4, or None if absent."""
    if not md.is_file():
        return None
    text = md.read_text()
    start = text.find("## 4.")
    if start < 0:
        return None
    out: dict[str, dict[int, float]] = {}
    for line in text[start:].splitlines():
        m = re.match(r"\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|\s*([\d.]+)\s*\|", line)
        if m:
            out.setdefault(m.group(2), {})[int(m.group(1))] = float(m.group(3)) * 2**20
        elif line.startswith("## ") and out:
            break
    return out if all(v in out for v in VARIANTS) else None


def memory_chart(path: Path, cp: int = 4, md: Path = RESULTS / "context_parallel.md") -> str:
    """Log-log lines of saved bytes per rank vs S. Returns "measured" or "analytic" (what was drawn)."""
    measured = measured_saved(md) if cp == 4 else None  # the benchmark measures at its --cp, 4 by default
    source = "measured" if measured else "analytic"
    styles = {"cp=1": ("black", "o", "-"), "ring": ("tab:red", "s", "-"), "zigzag": ("tab:blue", "x", "--"),
              "ulysses": ("tab:green", "^", "-")}
    fig, ax = plt.subplots(figsize=(7, 4.4), dpi=110)
    for variant in VARIANTS:
        if measured:
            seqs = sorted(measured[variant])
            ys = [measured[variant][s] / 2**20 for s in seqs]
        else:
            seqs = list(SEQS)
            ys = [analytic_saved(variant, s, cp) / 2**20 for s in seqs]
        color, marker, ls = styles[variant]
        label = variant if variant == "cp=1" else f"cp={cp} {variant}"
        if variant == "ulysses":
            rep = kv_replication(SHAPE["heads"], SHAPE["kv_heads"], cp)
            label += f" (K/V heads replicated x{rep})" if rep > 1 else ""
        ax.plot(seqs, ys, color=color, marker=marker, linestyle=ls, label=label, markersize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(list(SEQS) if not measured else sorted(measured["cp=1"]))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("sequence length S (tokens)")
    ax.set_ylabel("saved-for-backward MiB per rank")
    what = ("MEASURED (saved_tensors_hooks, context_parallel.md section 4)" if measured
            else "ANALYTIC (fp32 q,k,v,out + lse the op saves; not measured)")
    ax.set_title(f"Attention memory per rank vs S: cp=1 vs cp={cp}\n{what}, fp32, B={SHAPE['batch']}, "
                 f"H={SHAPE['heads']}, Hkv={SHAPE['kv_heads']}, D={SHAPE['head_dim']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, title="ring and zig-zag coincide", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return source


def main(argv: list[str] | None = None) -> int:
    """Draw both charts into --out and print the markdown that shows them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS), help="directory for the PNGs")
    parser.add_argument("--cp", type=int, default=4)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = balance_chart(out / "cp_balance.png", args.cp)
    source = memory_chart(out / "cp_memory_vs_seq.png", args.cp)
    print("## Charts\n")
    for name, per_rank in work.items():
        mean = sum(per_rank) / len(per_rank)
        print(f"- CP balance, {name}: max/mean causal work {max(per_rank) / mean:.2f}")
    print(f"- memory vs sequence length: {source} saved bytes per rank\n")
    for title, name in (("CP balance", "cp_balance.png"), ("CP memory vs S", "cp_memory_vs_seq.png")):
        path = out / name
        print(f"![{title}]({path.relative_to(HERE) if path.is_relative_to(HERE) else path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
