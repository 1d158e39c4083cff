"""meshkit's plan search against the Ultra-Scale Playbook's measured best configurations.

Why this exists: the project's issue asks for a README table that compares the plan families
meshkit's estimator picks with the ones Hugging Face's "The Ultra-Scale Playbook: Training LLMs on
GPU Clusters" (Tazi et al., 2025) *measured* to be fastest on 1-64 nodes of 8xH100 (sequence 4096,
global batch 256 x 4096 = 2**20 tokens). The search is pure arithmetic (no GPU), so this script
only re-runs `plan_search.search` for the same cells and sets the Playbook's winner beside it;
docs/playbook_comparison.md discusses the differences.

    python -m benchmarks.playbook_configs [--jobs N] [--cells llama3-8b:64 ...]

Cells run in parallel processes (one search each); the 512-GPU searches take minutes of CPU.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ProcessPoolExecutor

from benchmarks.report import table
from meshkit import estimate as est
from meshkit.estimate import search as plan_search

SEQ, TOKENS, DEVICE = 4096, 2**20, "h100"

# The Playbook's model sizes and the meshkit preset used for each. The Playbook's largest model is
# an "80B" Llama (its text: "the 80B parameter model training on 4 nodes"), not Llama-3-70B.
MODELS = {"llama3.2-1b": "1B", "llama3.2-3b": "3B", "llama3-8b": "8B", "llama3-70b": "80B"}

# (Playbook model, GPUs) -> (dp, tp, pp, zero, mbs, grad_acc, MFU %, tok/s/GPU) of the configuration
# with the highest measured tokens/s/GPU; None: every configuration crashed or ran out of memory.
# Source: the Playbook's interactive benchmark figure, assets/data/benchmarks/benchmarks_interactive.html
# (section "Benchmarking thousands of configurations"; read from the copy of the Space in GitHub repo
# vinjn/nanotron-ultrascale-playbook @ e3bcfc5c). Hover texts of each (model, nodes) panel, sorted by
# tok/s. Note: its summary heatmap (what_we_learnt_heatmap.svg) colours cells by MFU, and in 1B@8 and
# 1B@64 a slower pp=2 run reports a higher MFU (44.3%, 32.5%) than the fastest run listed here.
PLAYBOOK: dict[tuple[str, int], tuple[int, int, int, int, int, int, float, int] | None] = {
    ("1B", 8): (8, 1, 1, 0, 2, 16, 39.2, 40150),
    ("1B", 16): (16, 1, 1, 1, 2, 8, 37.9, 38840),
    ("1B", 64): (64, 1, 1, 1, 1, 4, 30.5, 31297),
    ("1B", 512): (128, 2, 2, 1, 2, 1, 5.2, 4603),
    ("3B", 8): (4, 1, 2, 1, 2, 32, 46.7, 16426),
    ("8B", 8): (2, 1, 4, 1, 1, 128, 45.2, 7503),
    ("8B", 64): (32, 1, 2, 1, 1, 8, 39.5, 6555),
    ("8B", 512): (128, 4, 1, 0, 2, 1, 18.7, 3101),
    ("80B", 8): None,
    ("80B", 64): (1, 4, 16, 0, 1, 256, 30.6, 665),
    ("80B", 512): (32, 16, 1, 1, 2, 4, 17.8, 343),
}
PRESET = {label: preset for preset, label in MODELS.items()}
DEFAULT_CELLS = [(PRESET[label], gpus) for label, gpus in PLAYBOOK]


def playbook_family(cfg: tuple | None) -> str:
    """The Playbook config named like `plan_search.family`, so the two columns compare directly.
    ZeRO-0/1/2 keep full parameters on every data-parallel rank, which is meshkit's ddp; ZeRO-3 is fsdp."""
    if cfg is None:
        return "-"
    dp, tp, pp, zero = cfg[:4]
    parts = [name for name, degree in (("pp", pp), ("tp", tp)) if degree > 1]
    if dp > 1:
        parts.append("fsdp" if zero == 3 else "ddp")
    return "+".join(parts) or "single"


def playbook_text(cfg: tuple | None) -> str:
    """One table cell for the Playbook's winner (or why there is none)."""
    if cfg is None:
        return "nothing ran (OOM/crash)"
    dp, tp, pp, zero, mbs, gas, mfu, tok = cfg
    degrees = ",".join(f"{n}={d}" for n, d in (("dp", dp), ("tp", tp), ("pp", pp)) if d > 1)
    return f"{degrees} zero={zero} mbs={mbs} gas={gas}: {mfu:.1f}% MFU, {tok:,} tok/s/GPU"


def agreement(ours: str | None, theirs: str) -> str:
    """'yes' for the same family, 'axes' when only the data-parallel flavour (ddp/hsdp/fsdp) differs."""
    if ours is None or theirs == "-":
        return "yes" if ours is None and theirs == "-" else "no"
    if ours == theirs:
        return "yes"
    def axes(f: str) -> set[str]:
        """A family's axes with ddp/hsdp/fsdp folded into one dp, so a flavour-only difference reads as 'axes', not 'no'."""
        return {"dp" if a in ("ddp", "hsdp", "fsdp") else a for a in f.split("+")}
    return "axes" if axes(ours) == axes(theirs) else "no"


def run_cell(cell: tuple[str, int]) -> tuple:
    """Search one (preset, world) cell: meshkit's best plan, its family and estimated MFU, the
    estimated MFU of meshkit's best plan in the Playbook's family (how far off its winner is by
    meshkit's own model) or why there is none, and the CPU seconds the search took."""
    model, world = cell
    start = time.process_time()
    result = plan_search.search(est.load_config(model), world, SEQ, TOKENS, DEVICE, top=1)
    cpu = time.process_time() - start
    fam = playbook_family(PLAYBOOK.get((MODELS[model], world)))
    theirs = result.best_by_family.get(fam)
    if theirs:
        theirs_text = f"{theirs.estimate.mfu:.1%}: {theirs.describe()}"
    else:  # the search's own reason, cut before its details: "nothing fits: ... budget", "invalid ..."
        theirs_text = "none: " + result.rejected.get(fam, "not searched").split(", ")[0] if fam != "-" else "-"
    if not result.plans:
        return model, world, None, "nothing fits", 0.0, theirs_text, cpu
    best = result.plans[0]
    return model, world, best.family, best.describe(), best.estimate.mfu, theirs_text, cpu


def comparison(rows: list[tuple]) -> list[str]:
    """The markdown comparison table, one row per cell in the order given."""
    out = []
    for model, world, fam, text, mfu, in_theirs, _ in rows:
        cfg = PLAYBOOK.get((MODELS[model], world), "n/a")
        if cfg == "n/a":
            theirs, their_text, agree = "n/a", "n/a", "n/a"
        else:
            theirs, their_text = playbook_family(cfg), playbook_text(cfg)
            agree = agreement(fam, theirs)
        out.append([f"{model} ({MODELS[model]})", world, text, fam or "-", f"{mfu:.1%}" if fam else "-",
                    their_text, theirs, agree, in_theirs])
    return table(["model (Playbook)", "GPUs", "meshkit best plan", "meshkit family", "est. MFU",
                  "Playbook best (measured)", "Playbook family", "agree", "meshkit's best in the Playbook's family"],
                 out)


def parse_cell(text: str) -> tuple[str, int]:
    """'llama3-8b:64' -> ('llama3-8b', 64)."""
    model, _, world = text.partition(":")
    if model not in MODELS or not world.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected PRESET:GPUS with PRESET in {', '.join(MODELS)}")
    return model, int(world)


def main(argv: list[str] | None = None) -> int:
    """Run the cells (largest worlds first, to balance the pool) and print the table and the cost."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", type=parse_cell, default=DEFAULT_CELLS, metavar="PRESET:GPUS")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel searches")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    order = sorted(args.cells, key=lambda c: -c[1])
    with ProcessPoolExecutor(max_workers=max(1, min(args.jobs, len(order)))) as pool:
        results = dict(zip(order, pool.map(run_cell, order)))
    rows = [results[c] for c in args.cells]
    wall = time.perf_counter() - start
    print(f"seq {SEQ}, global batch {TOKENS:,} tokens, {DEVICE}, meshkit's assumed kernel efficiency 45%\n")
    print("\n".join(comparison(rows)))
    print(f"\n{len(rows)} searches, jobs={args.jobs}: {wall:.0f} s wall, "
          f"{sum(r[-1] for r in rows):.0f} s CPU in the searches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
