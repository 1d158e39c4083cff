"""Every model preset at its reference world size, through the dry run: measured vs estimated peak.

    python -m benchmarks.dryrun_presets --out benchmarks/results/dryrun_presets.md [--only llama3-405b]

For each preset, `meshkit.dryrun` runs meshkit's real training step as the first, middle and last
pipeline rank of a fake world of the reference size (one process per rank, fake tensors) and
`meshkit.estimate` predicts the same ranks; the table lists, per simulated rank, the measured peak,
the estimate, their ratio, whether the collectives equal the estimate byte for byte, and the CPU
seconds the rank took. Llama 3 405B's row also plans a checkpoint of the whole world and reports the
size of its metadata. No GPU is used; on 2 shared cores the whole table takes about an hour.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from meshkit.dryrun import dry_run
from meshkit.dryrun.checkpoint_plan import checkpoint_metadata
from meshkit.dryrun.compare import collective_differences, estimate_rank
from meshkit.estimate.spec import GiB, Workload, load_config
from meshkit.plan import Plan

# preset: (plan, world, seq, mbs, AC); bf16 compute, fp32 reduction (the recipes' mixed precision)
REFERENCE = {
    "llama3.2-1b": ("dp_shard=-1", 8, 4096, 1, "none"),
    "llama3.2-3b": ("dp_shard=-1", 8, 4096, 1, "selective"),
    "llama3-8b": ("tp=8,dp_shard=-1", 64, 8192, 1, "selective"),
    "llama3-70b": ("tp=8,cp=8,dp_shard=-1", 256, 131072, 1, "full"),
    "llama3-405b": ("pp=16,tp=8,dp_shard=-1,pp_microbatches=16", 2048, 8192, 1, "full"),
    "mixtral-8x7b": ("dp_shard=-1,ep=8", 64, 4096, 1, "selective"),
    "qwen3-30b-a3b": ("dp_shard=-1,ep=16", 64, 4096, 1, "selective"),
    "deepseek-v3": ("pp=16,dp_shard=-1,ep=64,pp_microbatches=16", 2048, 4096, 1, "full"),
}
CHECKPOINTED = ("llama3-405b",)


def run(name: str, jobs: int) -> dict:
    """One preset's dry run (and, for the checkpointed ones, its checkpoint plan) as plain data."""
    text, world, seq, mbs, ac = REFERENCE[name]
    config = load_config(name)
    plan = dataclasses.replace(Plan.from_string(text), param_dtype="bfloat16", activation_checkpointing=ac)
    plan = plan.resolve(world)
    start = time.perf_counter()
    result = dry_run(config, plan, world, Workload(seq, mbs, plan.microbatches), jobs=jobs,
                     progress=lambda line: print(f"{name}: {line}", flush=True))
    out = {"preset": name, **result.as_dict()}
    if name in CHECKPOINTED:
        out["checkpoint"] = checkpoint_metadata(config, plan, world, jobs=jobs)
    out["wall_seconds"] = round(time.perf_counter() - start, 1)
    return out


def reestimate(row: dict) -> dict:
    """A stored run with the current estimator's figures for its measured ranks."""
    text, world, seq, mbs, ac = REFERENCE[row["preset"]]
    config = load_config(row["preset"])
    plan = dataclasses.replace(Plan.from_string(text), param_dtype="bfloat16", activation_checkpointing=ac)
    plan = plan.resolve(world)
    return reestimate_ranks(row, config, plan, world, Workload(seq, mbs, plan.microbatches))


def reestimate_ranks(row: dict, config: Any, plan: Plan, world: int, workload: Workload) -> dict:
    """`row`'s measured ranks with the current estimator's figures for `plan` (shared with
    benchmarks/dryrun_families.py)."""
    for r in row["ranks"]:
        e = estimate_rank(config, plan, world, workload, r["coords"], r["axes"])
        measured = r.get("compared_collectives") or _without_scalars(r["collectives"], r)
        r.update(estimate_peak_bytes=e.peak_bytes, estimate_parts=e.parts, estimate_collectives=e.collectives,
                 collective_differences=collective_differences(measured, e.collectives))
    return row


def _without_scalars(measured: dict, r: dict) -> dict:
    """For a run stored without `compared_collectives`: the axes and kinds the estimate names."""
    return {a: {k: v for k, v in kinds.items() if k in r["estimate_collectives"].get(a, {})}
            for a, kinds in measured.items() if a in r["estimate_collectives"]}


def table(rows: list[dict]) -> str:
    """The markdown table docs/estimate.md shows."""
    lines = ["| preset | plan | world | seq | rank | measured peak GiB | estimate GiB | estimate / measured | "
             "collectives | s (CPU s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for r in row["ranks"]:
            lines.append(f"| {row['preset']} | `{row['plan']}`, AC {row['ac']} | {row['world']} | {row['seq']} | "
                         f"{rank_cells(r)} |")
    for row in rows:
        ck = row.get("checkpoint")
        if ck:
            lines.append(f"\n{row['preset']} at world {row['world']}: a checkpoint (model and AdamW state) plans "
                         f"{ck['items']:,} write items ({ck['items_after_dedup']:,} after DCP's dedup) over "
                         f"{ck['tensors']:,} tensors in {ck['chunks']:,} chunks; its `.metadata` is "
                         f"{ck['metadata_bytes'] / 2**20:.1f} MiB, built by rank 0 in {ck['planning_seconds']:.0f} s.")
    return "\n".join(lines)


def rank_cells(r: dict) -> str:
    """A simulated rank's columns: where it sits, measured and estimated peak, their ratio, whether the
    collectives are equal, its seconds (shared with benchmarks/dryrun_families.py)."""
    equal = "equal" if not r["collective_differences"] else "differ"
    return (f"{r['rank']} (pp {r['coords']['pp']}) | {r['peak_bytes'] / GiB:.2f} | "
            f"{r['estimate_peak_bytes'] / GiB:.2f} | {r['estimate_peak_bytes'] / r['peak_bytes']:.3f} | {equal} | "
            f"{r['seconds']:.0f} ({r.get('cpu_seconds', 0):.0f})")


def parse_args(doc: str, names: list[str], results: str, what: str) -> argparse.Namespace:
    """The flags of a dry-run table benchmark (this one and benchmarks/dryrun_families.py): `--only` one of
    `names` (repeatable), `--jobs`, `--json` / `--out` under benchmarks/results/`results`, `--reestimate`."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=sorted(names), help=f"{what}s to run (default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="ranks simulated at once")
    parser.add_argument("--json", default=f"benchmarks/results/{results}.jsonl",
                        help=f"raw results, one JSON object per {what} (appended; the table reads the latest of each)")
    parser.add_argument("--out", default=f"benchmarks/results/{results}.md")
    parser.add_argument("--reestimate", action="store_true",
                        help="run nothing: recompute the estimates of the stored measurements (after an estimator change)")
    return parser.parse_args()


def main() -> None:
    """Run the presets (all, or `--only`), append their JSON to `--json`, write the table to `--out`."""
    args = parse_args(__doc__, list(REFERENCE), "dryrun_presets", "preset")
    raw = Path(args.json)
    for name in [] if args.reestimate else args.only or list(REFERENCE):
        row = run(name, args.jobs)
        text, world, seq, mbs, ac = REFERENCE[name]
        row["ac"] = ac
        with raw.open("a") as f:
            f.write(json.dumps(row) + "\n")
    rows = {}
    for line in raw.read_text().splitlines():
        row = json.loads(line)
        rows[row["preset"]] = reestimate(row) if args.reestimate else row  # the latest run of each preset
    ordered = [rows[n] for n in REFERENCE if n in rows]
    command = "python -m benchmarks.dryrun_presets" + "".join(f" --only {n}" for n in args.only or [])
    Path(args.out).write_text(f"# Dry run of every preset at its reference world size\n\n`{command}` "
                              f"(2 shared CPU cores, no GPU)\n\n{table(ordered)}\n")
    print(table(ordered))


if __name__ == "__main__":
    main()
