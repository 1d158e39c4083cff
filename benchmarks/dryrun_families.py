"""Every plan family through the dry run at a realistic size: measured vs estimated peak.

    python -m benchmarks.dryrun_families [--only zero1 --only cp_ring ...] [--reestimate]

The presets' table (benchmarks/dryrun_presets.py) covers dense, MoE and mixed stacks under ZeRO-3,
the zig-zag ring keeping K/V and 1F1B. Here every other family runs on one real model shape
(Llama 3.2 3B, 4096-16384 tokens, bf16 compute with fp32 reduction as the recipes do, but for the DDP
row's fp32) on a world of 8: each CP kind, each pipeline schedule (8 microbatches), ZeRO-1/2/3 with
and without `grad_sync="last_microbatch"` over a window of two calls, every offload, activation
offload, float8, LoRA and DDP. Per simulated rank (default: the first, middle and last pipeline
rank; both ends of a ring) the table lists the measured peak, the estimate, their ratio, whether the collectives equal
the estimate byte for byte, and the seconds the rank took. No GPU is used.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from benchmarks.dryrun_presets import parse_args, rank_cells, reestimate_ranks
from meshkit.dryrun import dry_run
from meshkit.estimate.spec import Workload, load_config
from meshkit.integrations.peft.model import with_lora
from meshkit.plan import Plan

MODEL, WORLD = "llama3.2-3b", 8
_CP = "cp=4,dp_shard=-1,"
_PP = "pp=4,dp_shard=-1,pp_microbatches=8,"
_NVME = "/tmp/meshkit_dryrun_nvme"
# family: (plan, seq, AC, calls per step, LoRA rank); bf16 compute, fp32 reduction unless the plan says
FAMILIES = {
    "cp_ring": (_CP + "cp_attention=ring,cp_keep_kv=false", 16384, "selective", 1, 0),
    "cp_zigzag": (_CP + "cp_attention=zigzag,cp_keep_kv=false", 16384, "selective", 1, 0),
    "cp_zigzag_keep_kv": (_CP + "cp_attention=zigzag,cp_keep_kv=true", 16384, "none", 1, 0),
    "cp_allgather": (_CP + "cp_attention=allgather", 16384, "none", 1, 0),
    "cp_ulysses": (_CP + "cp_attention=ulysses", 16384, "selective", 1, 0),
    "cp_usp": (_CP + "cp_attention=usp,cp_ulysses=2", 16384, "selective", 1, 0),
    "pp_gpipe": (_PP + "pp_schedule=gpipe", 4096, "selective", 1, 0),
    "pp_1f1b": (_PP + "pp_schedule=1f1b", 4096, "selective", 1, 0),
    "pp_interleaved_1f1b": (_PP + "pp_schedule=interleaved_1f1b,pp_virtual_stages=2", 4096, "selective", 1, 0),
    "pp_zb_h1": (_PP + "pp_schedule=zb_h1", 4096, "selective", 1, 0),
    "pp_zb_h2": (_PP + "pp_schedule=zb_h2", 4096, "selective", 1, 0),
    "pp_zb_v": (_PP + "pp_schedule=zb_v", 4096, "selective", 1, 0),
    "pp_dualpipe": (_PP + "pp_schedule=dualpipe", 4096, "selective", 1, 0),
    "pp_dualpipe_v": (_PP + "pp_schedule=dualpipe_v", 4096, "selective", 1, 0),
    "pp_zb_auto": (_PP + "pp_schedule=zb_auto,pp_costs=1/2/1", 4096, "selective", 1, 0),
    "zero1": ("dp_shard=-1,zero=1", 4096, "selective", 2, 0),
    "zero1_last_microbatch": ("dp_shard=-1,zero=1,grad_sync=last_microbatch", 4096, "selective", 2, 0),
    "zero2": ("dp_shard=-1,zero=2", 4096, "selective", 2, 0),
    "zero2_last_microbatch": ("dp_shard=-1,zero=2,grad_sync=last_microbatch", 4096, "selective", 2, 0),
    "zero3_last_microbatch": ("dp_shard=-1,zero=3,grad_sync=last_microbatch", 4096, "selective", 2, 0),
    "offload_optimizer": ("dp_shard=-1,zero=2,offload=optimizer", 4096, "selective", 1, 0),
    "offload_params": ("dp_shard=-1,zero=3,offload=params", 4096, "selective", 1, 0),
    "offload_nvme": (f"dp_shard=-1,zero=3,offload=nvme,offload_dir={_NVME}", 4096, "selective", 1, 0),
    "activation_offload": ("dp_shard=-1,activation_offload=true", 4096, "none", 1, 0),
    "float8": ("dp_shard=-1,float8=tensorwise", 4096, "selective", 1, 0),
    "lora": ("dp_shard=-1", 4096, "selective", 1, 16),
    "ddp_fp32": ("dp_replicate=8,param_dtype=float32", 4096, "selective", 1, 0),
}

# Ranks beyond the default (the first, middle and last pipeline rank): a ring's cp ranks compute
# different numbers of blocks, so its first and last cp rank (cp is inside dp_shard: rank 3 is cp 3)
RANKS = {"cp_ring": [0, 3], "cp_zigzag": [0, 3], "cp_usp": [0, 3]}


def setup(name: str) -> tuple:
    """A family's (config, resolved plan, workload)."""
    text, seq, ac, calls, lora_r = FAMILIES[name]
    config = load_config(MODEL)
    if lora_r:
        config = with_lora(config, lora_r, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"])
    plan = Plan.from_string(text)
    if "param_dtype=" not in text:
        plan = dataclasses.replace(plan, param_dtype="bfloat16")
    plan = dataclasses.replace(plan, activation_checkpointing=ac).resolve(WORLD)
    return config, plan, Workload(seq, 1, plan.microbatches * calls)


def run(name: str, jobs: int) -> dict:
    """One family's dry run as plain data."""
    config, plan, workload = setup(name)
    Path(_NVME).mkdir(exist_ok=True)
    start = time.perf_counter()
    result = dry_run(config, plan, WORLD, workload, RANKS.get(name), jobs=jobs,
                     progress=lambda line: print(f"{name}: {line}", flush=True))
    out = {"family": name, "model": MODEL, "ac": plan.activation_checkpointing, **result.as_dict()}
    out["wall_seconds"] = round(time.perf_counter() - start, 1)
    return out


def table(rows: list[dict]) -> str:
    """The markdown table docs/estimate.md shows."""
    lines = ["| family | plan | seq | calls | rank | measured peak GiB | estimate GiB | estimate / measured | "
             "collectives | s (CPU s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        text, _, ac, calls, lora_r = FAMILIES[row["family"]]
        lora = f", LoRA r={lora_r}" if lora_r else ""
        for r in row["ranks"]:
            lines.append(f"| {row['family']} | `{text}`, AC {ac}{lora} | {row['seq']} | {calls} | {rank_cells(r)} |")
    return "\n".join(lines)


def main() -> None:
    """Run the families (all, or `--only`), append their JSON to `--json`, write the table to `--out`."""
    args = parse_args(__doc__, list(FAMILIES), "dryrun_families", "family")
    raw = Path(args.json)
    for name in [] if args.reestimate else args.only or list(FAMILIES):
        row = run(name, args.jobs)
        with raw.open("a") as f:
            f.write(json.dumps(row) + "\n")
    rows = {}
    for line in raw.read_text().splitlines():
        row = json.loads(line)
        if args.reestimate:
            config, plan, workload = setup(row["family"])
            row = reestimate_ranks(row, config, plan, WORLD, workload)
        rows[row["family"]] = row  # the latest run of each family
    ordered = [rows[n] for n in FAMILIES if n in rows]
    Path(args.out).write_text(f"# Dry run of every plan family: {MODEL} on a fake world of {WORLD}\n\n"
                              "`python -m benchmarks.dryrun_families` (2 shared CPU cores, no GPU; "
                              "bf16 compute, fp32 reduction, mbs 1)\n\n" + table(ordered) + "\n")
    print(table(ordered))


if __name__ == "__main__":
    main()
