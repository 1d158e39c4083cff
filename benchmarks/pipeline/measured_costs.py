"""zb_auto against the handcrafted schedules at per-action costs measured on this machine.

Two steps, both on the benchmark's gloo ranks:

1. `hf_costs_on_rank`: the real HF Llama stages of the benchmark's section 3, split as 1F1B splits
   them (pp stages) and as ZB-V does (2pp), run traced (ZB-H1's and ZB-V's orders, a few steps after
   a warm-up), each stage's F, B and W timed by the runtime's trace exactly as zb_auto's own profiling
   run does (`meshkit.pipeline.costs.local_times`), plus one boundary activation's P2P time
   (`costs.p2p_time`). These are the costs: unequal (the first stage embeds, the last one runs the
   LM head), measured at normal priority on a shared machine.
2. `sleep_on_rank`: every schedule built for those costs (zb_auto at its memory limits, ZB-H1,
   ZB-H2, ZB-V, 1F1B, DualPipe) run on sleep stages that sleep each stage's measured F, B and W, under
   the sleep sections' scheduling (SCHED_FIFO with --priority fifo), traced: measured step against
   the simulator at the measured costs, and against its replay at each repetition's own stage times.

`table` writes the section. Nothing here asserts on time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.pipeline import ranks
from benchmarks.pipeline.replay import exact_ms, replay_ratios, spread, stage_times
from benchmarks.report import ms, paired, table
from meshkit.pipeline import costs as pipeline_costs
from meshkit.pipeline.p2p import TensorMeta
from meshkit.pipeline.runtime import run_schedule
from meshkit.pipeline.schedules import Schedule, build_schedule, stage_chunks, stage_placement
from meshkit.pipeline.simulate import render_png, simulate

MS = 1000.0
#: The orders whose traces time each split's stages: one stage per rank, and the V's 2pp stages.
SPLITS = {"1f1b": "zb_h1", "zb_v": "zb_v"}


def hf_costs_on_rank(spec: dict) -> dict[str, Any]:
    """One rank: per split, the median seconds of each of its stages' F, B and W (NaN for other ranks'
    stages), and the P2P time of one boundary activation (NaN on the ranks that do not time it)."""
    pp, m, rank = dist.get_world_size(), spec["microbatches"], dist.get_rank()
    cfg = spec["hf"]
    model = ranks.hf_spec(cfg).build()
    ids, labels = ranks.hf_batch(cfg, m)
    inputs, label_mbs = list(ids.chunk(m)), list(labels.chunk(m))
    meta = TensorMeta((cfg["rows"], cfg["seq"], cfg["heads"] * cfg["head_dim"]), torch.float32)
    out: dict[str, Any] = {}
    for split, order in SPLITS.items():
        schedule = build_schedule(order, pp, m)
        modules = ranks.hf_stages(model, order, pp, 1, rank)
        trace: list = []
        for step in range(spec["warmup"] + spec["reps"]):
            ranks._zero(modules.values())
            dist.barrier()
            run_schedule(schedule, modules, pp_group=dist.group.WORLD, microbatch_inputs=inputs,
                         loss_fn=lambda out, mb: ranks.hf_loss(out, label_mbs[mb]) / m, shapes=meta,
                         trace=trace if step >= spec["warmup"] else None)
        out[split] = pipeline_costs.local_times(trace, schedule.num_stages)
    out["p2p"] = pipeline_costs.p2p_time(dist.group.WORLD, meta, torch.device("cpu"))
    return out


def stage_costs(per_rank: list[dict[str, Any]], split: str) -> list[tuple[Fraction, Fraction, Fraction]]:
    """Each stage's (F, B, W) in ms, to the microsecond, from the rank that ran it."""
    stages = len(per_rank[0][split]) // 3
    out = []
    for s in range(stages):
        cell = []
        for k in range(3):
            values = [r[split][3 * s + k] for r in per_rank if not math.isnan(r[split][3 * s + k])]
            cell.append(exact_ms(statistics.median(values)))
        out.append(tuple(cell))
    return out


def p2p_ms(per_rank: list[dict[str, Any]]) -> Fraction:
    """The median measured P2P time (ms) over the ranks that timed it."""
    return exact_ms(statistics.median(r["p2p"] for r in per_rank if not math.isnan(r["p2p"])))


def plans(pp: int, m: int, per_rank: list[dict[str, Any]], limits: Sequence[int]) -> list[dict[str, Any]]:
    """Every schedule of the section, built for the measured costs, with the costs its stages sleep."""
    p2p = p2p_ms(per_rank)
    one = stage_costs(per_rank, "1f1b")
    table_p = pipeline_costs.StageTable(1, 1, 1, p2p, table=tuple(one))
    rows: list[dict[str, Any]] = []
    for limit in limits:
        rows.append({"label": f"zb_auto (limit {limit})", "limit": limit,
                     "schedule": build_schedule("zb_auto", pp, m, costs=table_p, memory_limit=limit)})
    for name in ("zb_h1", "zb_h2", "1f1b", "dualpipe", "zb_v"):
        rows.append({"label": name, "limit": None, "schedule": build_schedule(name, pp, m)})
    for row in rows:
        schedule: Schedule = row["schedule"]
        if row["label"] == "zb_v":
            per_stage = stage_costs(per_rank, "zb_v")
        else:
            per_stage = [one[c] for c in stage_chunks(schedule.name, pp)]
        row["costs"] = pipeline_costs.StageTable(1, 1, 1, p2p, table=tuple(per_stage))
        row["sleeps"] = [[float(t) / MS for t in cell] for cell in per_stage]
    return rows


def draw(rows: list[dict[str, Any]], out: Path, pp: int, m: int) -> Path:
    """The first plan's (zb_auto at the first limit) simulated timeline at the measured costs, as a PNG."""
    row = rows[0]
    out.mkdir(parents=True, exist_ok=True)
    return render_png(simulate(row["schedule"], row["costs"]), out / f"pipeline_zb_auto_pp{pp}_m{m}_measured.png",
                      seconds_per_unit=1 / MS)


def sleep_on_rank(spec: dict) -> dict[str, Any]:
    """One rank: every plan on sleep stages sleeping its stages' measured costs, traced, interleaved."""
    with ranks.scheduling(spec.get("priority", "normal")):
        pp, m, rank = dist.get_world_size(), spec["microbatches"], dist.get_rank()
        rows_, dim = 4, 16
        torch.manual_seed(0)
        inputs = list(torch.randn(m * rows_, dim).chunk(m))
        target = torch.zeros(rows_, dim)
        meta = TensorMeta((rows_, dim), torch.float32)
        variants = []
        for plan in spec["plans"]:
            schedule = plan["schedule"]
            mine = [s for s, r in enumerate(stage_placement(schedule.name, pp)) if r == rank]
            modules = {s: ranks.SleepStage(dim, plan["sleeps"][s]) for s in mine}
            variants.append(ranks.meshkit_variant(plan["label"], schedule, modules, inputs,
                                                  lambda out, mb: ranks.sleep_loss(out, target) / m, meta, trace=True))
        return {"sleep": {"times": ranks.measure(variants, spec["reps"], spec["warmup"])}}


def table_lines(pp: int, m: int, per_rank: list[dict[str, Any]], rows: list[dict[str, Any]],
                results: list[dict[str, Any]]) -> list[str]:
    """The measured costs, then one row per schedule: simulated vs measured step, replay ratio, memory."""
    one, v = stage_costs(per_rank, "1f1b"), stage_costs(per_rank, "zb_v")
    cost_rows = [[f"stage {s} of {pp}", *(f"{float(t):.2f}" for t in c)] for s, c in enumerate(one)]
    cost_rows += [[f"stage {s} of {2 * pp} (ZB-V)", *(f"{float(t):.2f}" for t in c)] for s, c in enumerate(v)]
    lines = [*table(["stage", "F (ms)", "B (ms)", "W (ms)"], cost_rows),
             f"P2P, one boundary activation: {float(p2p_ms(per_rank)):.3f} ms (half the median round trip).", ""]
    auto = rows[0]["label"]
    sims = {r["label"]: simulate(r["schedule"], r["costs"]) for r in rows}
    out = []
    for row in rows:
        name, schedule, sim = row["label"], row["schedule"], sims[row["label"]]
        recs = [r["sleep"]["times"][f"meshkit:{name}"] for r in results]
        if "error" in recs[0][0]:
            out.append([name, f"did not run: {recs[0][0]['error']}"] + [""] * 7)
            continue
        steps = [max(rec["t1"] for rec in rep) - min(rec["t0"] for rec in rep) for rep in zip(*recs)]
        auto_recs = [r["sleep"]["times"][f"meshkit:{auto}"] for r in results]
        auto_steps = [max(rec["t1"] for rec in rep) - min(rec["t0"] for rec in rep) for rep in zip(*auto_recs)]
        peak = list(sim.peak_activations)
        memory = f"{peak} <= {row['limit']}" if row["limit"] is not None else str(peak)
        measured = statistics.median(steps)
        out.append([name, memory, f"{float(sim.step_time):.1f}", ms(measured),
                    f"{measured * MS / float(sim.step_time):.3f}",
                    spread(replay_ratios(schedule, recs, stage_times)),
                    f"{float(sim.step_time / sims[auto].step_time):.3f}", f"{paired(steps, auto_steps):.3f}"])
    return lines + table(["schedule", "peak activations per rank (sim) vs limit", "simulated at measured costs (ms)",
                          "measured (ms)", "measured / simulated", "measured / sim at per-action stage times",
                          f"step / {auto}'s, simulated", "measured (paired)"], out)


__all__ = ["SPLITS", "draw", "hf_costs_on_rank", "plans", "sleep_on_rank", "stage_costs", "table_lines"]
