"""Pipeline schedules on gloo ranks: measured step time and bubble vs meshkit's simulator, vs torch.

    .venv/bin/python benchmarks/pipeline.py [--pp 4] [--microbatches 8] [--costs 20,20,20] [--quick]
                                            [--out benchmarks/results]

The script forks its own gloo ranks (per-rank code in `benchmarks/_pipeline_worker.py`, everything
taken from `torch.distributed.pipelining` in `benchmarks/_pipeline_torch.py`) and prints markdown:

1. sleep stages (F, B and W each a fixed `time.sleep`, so a noisy shared CPU barely matters): for
   GPipe, 1F1B, interleaved 1F1B (v=2) and ZB-H1, the measured step time against the simulator's
   ideal for the same costs (and against the simulator fed the sleeps actually observed, which
   leaves the runtime's own overhead, also expressed as an implied overhead per action), the
   bubble fraction measured vs simulated vs the closed formula, a check that every rank slept F, B
   and W in its action order, then ZB-H1's idle time against 1F1B's;
2. the same stages under torch's `ScheduleGPipe`, `Schedule1F1B`, `ScheduleInterleaved1F1B` and
   `ScheduleInterleavedZeroBubble`: step time and CPU ratio meshkit/torch (or why torch refused),
   and torch's own action order replayed in meshkit's simulator;
3. a small HF `LlamaForCausalLM` split by `meshkit.pipeline.split`: step time, tokens/s and CPU of
   each schedule vs the unsplit model on one process, and vs torch's schedules on the same stage
   modules, with the loss of each as evidence that all computed the same step;
4. a PNG timeline per schedule from the simulator in the --out folder, and one text timeline.

Variants are interleaved (order rotated every repetition) and medians are printed; ratios are
medians of per-repetition ratios. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import _launch  # benchmarks/ is on sys.path when this file runs as a script
import _pipeline_torch as torch_pp  # benchmarks/ is on sys.path when this file runs as a script
import _pipeline_worker as worker
import torch

from meshkit.pipeline.schedules import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    build_schedule,
    compute_only,
    with_communication,
)
from meshkit.pipeline.simulate import Costs, SimulationResult, render_png, render_text, simulate

SCHEDULES: tuple[tuple[str, int], ...] = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1))
#: The sleeps one action of each kind triggers in SleepStage (a full backward fires W's hook first).
SLEEPS_OF = {ActionKind.F: "F", ActionKind.B: "B", ActionKind.W: "W", ActionKind.BW: "WB"}
MS = 1000.0

# ---------------------------------------------------------------------------------------- formatting


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table; cells arrive formatted so each column keeps its own precision."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows] + [""]


def pct(x: float | Fraction) -> str:
    return f"{float(x):.1%}"


def ms(seconds: float) -> str:
    return f"{seconds * MS:.1f}"


def label(name: str, v: int) -> str:
    return f"{name} (v={v})" if v > 1 else name


# ------------------------------------------------------------------------------------- measurements


@dataclass
class Timing:
    """One variant's repetitions, seen from all ranks (times in seconds)."""

    steps: list[float]  # per repetition: last rank's end minus first rank's start
    bubbles: list[float]  # per repetition: 1 - sum of ranks' sleep time / (ranks * step)
    idle: list[float]  # per repetition: mean over ranks of step minus the rank's sleep time
    cpu: list[float]  # per repetition: CPU seconds of all ranks together
    sleeps: list[dict[str, float]]  # per repetition: mean seconds one sleep of each kind actually took
    sequences: list[str]  # per rank, the sleep kinds in order (first repetition)

    @property
    def step(self) -> float:
        return statistics.median(self.steps)

    @property
    def cpu_ms(self) -> str:
        return ms(statistics.median(self.cpu))

    @property
    def per_sleep(self) -> dict[str, float]:
        return {kind: statistics.median(rep.get(kind, 0.0) for rep in self.sleeps) for kind in "FBW"}


def timing(ranks: list[dict], section: str, variant: str) -> Timing | str:
    """Combine every rank's records of `variant`; a string is the reason it did not run."""
    per_rank = [r[section]["times"].get(variant) for r in ranks]
    if any(not recs for recs in per_rank):
        return "not run"
    if "error" in per_rank[0][0]:
        return per_rank[0][0]["error"]
    steps, bubbles, idle, cpu, sleeps = [], [], [], [], []
    for rep in zip(*per_rank):
        step = max(r["t1"] for r in rep) - min(r["t0"] for r in rep)
        busy = [sum(r["busy"].values()) for r in rep]
        steps.append(step)
        bubbles.append(1 - sum(busy) / (len(rep) * step))
        idle.append(statistics.fmean(step - b for b in busy))
        cpu.append(sum(r["cpu"] for r in rep))
        kinds = {kind for r in rep for kind in r["busy"]}
        sleeps.append({k: sum(r["busy"].get(k, 0.0) for r in rep) / sum(r["count"].get(k, 0) for r in rep)
                       for k in kinds})
    return Timing(steps, bubbles, idle, cpu, sleeps, [recs[0].get("sequence", "") for recs in per_rank])


def paired_ratio(a: Timing, b: Timing, what: str = "steps") -> float:
    """Median of per-repetition ratios: both ran within the same rotation, so load drifts cancel."""
    return statistics.median(x / y for x, y in zip(getattr(a, what), getattr(b, what)))


# --------------------------------------------------------------------------------------- simulation


def exact_ms(seconds: float) -> Fraction:
    """Milliseconds to the microsecond, exact, so the simulator's rendering stays readable."""
    return Fraction(round(seconds * MS * 1000), 1000)


def stage_costs(costs_ms: Sequence[float], v: int) -> Costs:
    """Per-stage costs: a rank's work per microbatch is spread over its v stages."""
    f, b, w = (Fraction(c).limit_denominator(1000) / v for c in costs_ms)
    return Costs(forward=f, backward_input=b, backward_weight=w)


def overhead_ratio(schedule: Schedule, t: Timing) -> float:
    """Median over repetitions of step / simulated step at that repetition's own sleep durations.

    Per repetition, because one badly overslept sleep on a loaded machine would skew a mean over all.
    """
    ratios = []
    for step, sleeps in zip(t.steps, t.sleeps):
        costs = Costs(*(exact_ms(sleeps.get(kind, 0.0)) for kind in "FBW"))
        ratios.append(step * MS / float(simulate(schedule, costs).step_time))
    return statistics.median(ratios)


@dataclass(frozen=True)
class CostsWithOverhead(Costs):
    """Costs plus a fixed `overhead` on every compute action (a BW is one action: one overhead)."""

    overhead: Fraction = Fraction(0)

    def duration(self, action: Action) -> Fraction:
        return super().duration(action) + (self.overhead if action.is_compute else 0)


def implied_overhead(schedule: Schedule, t: Timing) -> float:
    """The per-action overhead (s) at which the simulator, fed the measured sleeps, gives the median step.

    Everything the runtime adds (Python, autograd, transfers, wake-ups on a loaded machine) charged to
    each compute action: a schedule with more actions on its critical path (interleaved) pays it more
    often. Step time grows monotonically with it, so bisection finds it; 0 if there is nothing to explain.
    """
    sleeps = [exact_ms(t.per_sleep[kind]) for kind in "FBW"]

    def step_at(overhead_ms: Fraction) -> float:
        return float(simulate(schedule, CostsWithOverhead(*sleeps, overhead=overhead_ms)).step_time)

    target, low, high = t.step * MS, Fraction(0), Fraction(20)
    if step_at(low) >= target:
        return 0.0
    for _ in range(16):
        middle = (low + high) / 2
        low, high = (middle, high) if step_at(middle) < target else (low, middle)
    return float(low + high) / 2 / MS


def formula_bubble(name: str, p: int, m: int, v: int, costs_ms: Sequence[float]) -> Fraction:
    """The closed forms of docs/pipeline_schedules.md, with TF/TB/TW a rank's whole part per microbatch."""
    tf, tb, tw = (Fraction(c).limit_denominator(1000) for c in costs_ms)
    if name == "zb_h1":
        idle = (p - 1) * (tf + tb - min(tf, tb, tw))
    else:
        idle = (p - 1) * (tf + tb + tw) / v
    return idle / (m * (tf + tb + tw) + idle)


def formula_text(name: str) -> str:
    return {"zb_h1": "(p-1)(TF+TB-TW)", "interleaved_1f1b": "(p-1)/(vm+p-1)"}.get(name, "(p-1)/(m+p-1)")


def expected_sequences(schedule: Schedule, torch_first_stage: bool = False) -> list[str]:
    """Per rank, the sleeps its actions trigger; torch's first stage sleeps nothing in B and both in W."""
    sleeps = dict(SLEEPS_OF)
    first = {**sleeps, ActionKind.B: "", ActionKind.W: "WB"} if torch_first_stage else sleeps
    return ["".join((first if a.stage == 0 else sleeps)[a.kind] for a in actions)
            for actions in compute_only(schedule).ranks]


def sequence_check(expected: list[str], got: list[str]) -> str:
    """Whether every rank slept F, B and W exactly in its action order; else the first difference."""
    for rank, (want, have) in enumerate(zip(expected, got)):
        if want != have:
            at = next((i for i, (x, y) in enumerate(zip(want, have)) if x != y), min(len(want), len(have)))
            return f"no: rank {rank} at sleep {at}: expected {want[at:at + 6]!r}, got {have[at:at + 6]!r}"
    return "yes"


class TorchFirstStageCosts(Costs):
    """torch's B/W split on the first stage: its I does nothing and its W runs the whole backward."""

    def duration(self, action: Action) -> Fraction:
        if action.stage == 0 and action.kind is ActionKind.B:
            return Fraction(0)
        if action.stage == 0 and action.kind is ActionKind.W:
            return self.backward_input + self.backward_weight
        return super().duration(action)


def torch_schedule(order: Any, name: str, num_stages: int, m: int) -> Schedule | str:
    """torch's own compute order as a meshkit schedule, or why meshkit's checker rejects it."""
    if isinstance(order, str):
        return order
    try:
        ranks = tuple(tuple(Action(ActionKind[k], s, mb) for k, s, mb in actions) for actions in order)
        return with_communication(Schedule(ranks, num_stages, m, f"torch {name}"))
    except (ScheduleError, ValueError, KeyError) as error:
        return f"invalid listing: {str(error).splitlines()[0]}"


def simulate_torch(schedule: Schedule | str, costs: Costs) -> SimulationResult | str:
    if isinstance(schedule, str):
        return schedule
    torch_costs = TorchFirstStageCosts(costs.forward, costs.backward_input, costs.backward_weight)
    try:
        return simulate(schedule, torch_costs)
    except ScheduleError as error:
        return f"torch's order does not pass meshkit's check: {str(error).splitlines()[0]}"


# ------------------------------------------------------------------------------------------ sections


def runnable(p: int, m: int) -> tuple[list[tuple[str, int]], list[str]]:
    """The schedules meshkit can build for (p, m), and why the others are left out."""
    keep, notes = [], []
    for name, v in SCHEDULES:
        try:
            build_schedule(name, p, m, v)
            keep.append((name, v))
        except ValueError as error:
            notes.append(f"pp={p}: {label(name, v)} left out: {error}")
    return keep, notes


def sleep_row(name: str, v: int, p: int, m: int, costs_ms: Sequence[float], ranks: list[dict]) -> list[str]:
    schedule = build_schedule(name, p, m, v)
    ideal = simulate(schedule, stage_costs(costs_ms, v))
    t = timing(ranks, "sleep", f"meshkit:{name}")
    if isinstance(t, str):
        return [label(name, v), f"{float(ideal.step_time):.0f}", f"did not run: {t}"] + [""] * 9
    return [
        label(name, v), f"{float(ideal.step_time):.0f}", ms(t.step), f"{t.step * MS / float(ideal.step_time):.3f}",
        f"{overhead_ratio(schedule, t):.3f}", f"{implied_overhead(schedule, t) * MS:.2f}",
        "/".join(f"{t.per_sleep.get(k, 0) * MS:.2f}" for k in "FBW"),
        f"{formula_text(name)} = {pct(formula_bubble(name, p, m, v, costs_ms))}"
        + (" (holds for m >= p)" if name == "zb_h1" and m < p else ""), pct(ideal.bubble_fraction),
        pct(statistics.median(t.bubbles)), str(list(ideal.peak_activations)),
        sequence_check(expected_sequences(schedule), t.sequences),
    ]


def sleep_section(p: int, m: int, costs_ms: Sequence[float], ranks: list[dict],
                  schedules: Sequence[tuple[str, int]]) -> list[str]:
    rows = [sleep_row(name, v, p, m, costs_ms, ranks) for name, v in schedules]
    return table(["schedule", "ideal step (ms)", "measured (ms)", "measured / ideal",
                  "measured / sim at measured sleeps", "implied overhead per action (ms)", "one F/B/W sleep (ms)", "bubble: formula", "simulated",
                  "measured", "peak act. (sim)", "sleeps in schedule order"], rows)


ZB_HEADERS = ["pp", "idle/rank 1F1B / ZB-H1, measured (ms)", "ZB/1F1B measured", "simulated (ms)",
              "ZB/1F1B simulated", "formula (TF+TB-TW)/(TF+TB+TW)", "step ZB/1F1B measured",
              "step ZB/1F1B simulated"]


def zb_vs_1f1b(p: int, m: int, costs_ms: Sequence[float], ranks: list[dict]) -> list[Any]:
    """ZB-H1's idle time per rank as a share of 1F1B's: measured, simulated, and by the formulas."""
    sims = {n: simulate(build_schedule(n, p, m), stage_costs(costs_ms, 1)) for n in ("1f1b", "zb_h1")}
    one, zb = timing(ranks, "sleep", "meshkit:1f1b"), timing(ranks, "sleep", "meshkit:zb_h1")
    tf, tb, tw = costs_ms
    formula = (tf + tb - min(tf, tb, tw)) / (tf + tb + tw)
    sim_idle = {n: statistics.fmean(map(float, s.idle)) for n, s in sims.items()}
    if isinstance(one, str) or isinstance(zb, str):
        measured = ["n/a"] * 3
    else:
        idle_one, idle_zb = statistics.median(one.idle), statistics.median(zb.idle)
        measured = [f"{idle_one * MS:.0f} / {idle_zb * MS:.0f}", f"{idle_zb / idle_one:.2f}",
                    f"{paired_ratio(zb, one):.3f}"]
    return [p, measured[0], measured[1], f"{sim_idle['1f1b']:.0f} / {sim_idle['zb_h1']:.0f}",
            f"{sim_idle['zb_h1'] / sim_idle['1f1b']:.2f}", f"{formula:.2f}", measured[2],
            f"{float(sims['zb_h1'].step_time / sims['1f1b'].step_time):.3f}"]


def torch_section(p: int, m: int, costs_ms: Sequence[float], ranks: list[dict],
                  schedules: Sequence[tuple[str, int]]) -> list[str]:
    """meshkit vs torch on the same sleep stages, with torch's own order replayed in the simulator."""
    section = "sleep"
    info = ranks[0][section]
    rows = []
    for name, v in schedules:
        cls, _ = torch_pp.PEERS[name]
        mine, theirs = timing(ranks, section, f"meshkit:{name}"), timing(ranks, section, f"torch:{name}")
        refused = info["torch_refused"].get(name)
        schedule = torch_schedule(info["torch_orders"].get(name, "not built"), cls, p * v, m)
        sim = simulate_torch(schedule, stage_costs(costs_ms, v))
        sim_text = sim if isinstance(sim, str) else f"{float(sim.step_time):.0f} ({pct(sim.bubble_fraction)})"
        mine_cells = [ms(mine.step), mine.cpu_ms] if isinstance(mine, Timing) else [mine, ""]
        if refused or isinstance(theirs, str):
            rows.append([label(name, v), cls, *mine_cells, f"refused: {refused or theirs}", "", "n/a", "n/a", sim_text,
                         "", ""])
            continue
        order = "n/a" if isinstance(schedule, str) else sequence_check(
            expected_sequences(schedule, torch_first_stage=True), theirs.sequences)
        rows.append([label(name, v), cls, *mine_cells, ms(theirs.step), theirs.cpu_ms,
                     *([f"{paired_ratio(mine, theirs, w):.3f}" for w in ("steps", "cpu")] if isinstance(mine, Timing)
                       else ["n/a", "n/a"]), sim_text,
                     pct(statistics.median(theirs.bubbles)), order])
    return table(["meshkit schedule", "torch class", "meshkit (ms)", "meshkit CPU (ms)", "torch (ms)", "torch CPU (ms)",
                  "meshkit / torch (time)", "(CPU)", "torch's order simulated: step (ms) (bubble)",
                  "torch bubble measured",
                  "torch sleeps in its listed order"], rows)


def hf_section(m: int, cfg: dict, ranks: list[dict], schedules: Sequence[tuple[str, int]]) -> list[str]:
    info = ranks[0]["hf"]
    tokens = m * cfg["rows"] * cfg["seq"]
    single = timing(ranks, "hf", "single")
    ref = info["single_loss"]
    rows = []
    if isinstance(single, Timing):
        rows.append(["unsplit HF model, 1 process", ms(single.step), f"{tokens / single.step:.0f}", "1.00",
                     single.cpu_ms, "1.00", "", "", "", "", "", f"{ref:.5f}"])
    for name, v in schedules:
        mine, theirs = timing(ranks, "hf", f"meshkit:{name}"), timing(ranks, "hf", f"torch:{name}")
        loss = info["losses"].get(f"meshkit:{name}")
        torch_loss = info["losses"].get(f"torch:{name}")
        same = "n/a" if loss is None or ref is None else f"{loss:.5f} ({'=' if abs(loss - ref) < 1e-4 else '!='})"
        if torch_loss is not None and ref is not None:
            same += f", torch {torch_loss:.5f}"
        if isinstance(mine, str):
            rows.append([label(name, v), f"did not run: {mine}", *[""] * 9, same])
            continue
        vs_single = ([f"{single.step / mine.step:.2f}", mine.cpu_ms, f"{paired_ratio(mine, single, 'cpu'):.2f}"]
                     if isinstance(single, Timing) else ["n/a", mine.cpu_ms, "n/a"])
        if isinstance(theirs, str):
            torch_cells = [f"n/a ({info['torch_refused'].get(name) or theirs})", "", "", "", ""]
        else:
            torch_cells = [ms(theirs.step), f"{tokens / theirs.step:.0f}", theirs.cpu_ms,
                           f"{paired_ratio(mine, theirs):.3f}", f"{paired_ratio(mine, theirs, 'cpu'):.3f}"]
        rows.append([label(name, v), ms(mine.step), f"{tokens / mine.step:.0f}", *vs_single, *torch_cells, same])
    return table(["variant", "step (ms)", "tokens/s", "speed vs unsplit", "CPU, all ranks (ms)", "CPU vs unsplit",
                  "torch step (ms)", "torch tokens/s", "torch CPU (ms)", "meshkit / torch (time)", "(CPU)",
                  "loss (vs unsplit)"], rows)


def timelines(p: int, m: int, costs_ms: Sequence[float], out: Path,
              schedules: Sequence[tuple[str, int]]) -> tuple[list[str], list[Path]]:
    """PNG per schedule, and the text timeline of ZB-H1 (the one whose W placement matters).

    Time is in units of TF, as in the Playbook's figures (in ms, every chart would hit the width cap).
    """
    out.mkdir(parents=True, exist_ok=True)
    unit = costs_ms[0] or 1.0
    paths, text = [], []
    for name, v in schedules:
        result = simulate(build_schedule(name, p, m, v), stage_costs([c / unit for c in costs_ms], v))
        paths.append(render_png(result, out / f"pipeline_{name}_pp{p}_m{m}.png", seconds_per_unit=unit / MS))
        if name == "zb_h1" or not text:
            text = render_text(result).splitlines()
    return ["```", *text, "```", ""], paths


# ----------------------------------------------------------------------------------------- driver



def launch(world: int, spec: dict) -> list[dict]:
    """Fork `world` gloo ranks running this benchmark's worker; rank 0's JSON result."""
    return _launch.launch(worker.run, world, spec)


def run_world(world: int, spec: dict, notes: list[str]) -> list[dict]:
    """One world; if it dies (a torch schedule failing mid-step hangs its peers), rerun it without torch."""
    try:
        return launch(world, spec)
    except Exception as error:  # noqa: BLE001 - reported, then measured without the peer
        if not spec["torch"]:
            raise
        notes.append(f"pp={world}: the world with torch's schedules died ({torch_pp.first_line(error)}); "
                     "rerun without them")
        return launch(world, dict(spec, torch=False))


def header(args: argparse.Namespace, worlds: Sequence[int]) -> list[str]:
    import transformers

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return [
        "# meshkit pipeline benchmark",
        "",
        f"- command: `{shlex.join([os.path.relpath(sys.executable)] + sys.argv)}`",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, {os.cpu_count()} CPU cores (load average {load} at start)",
        f"- gloo on CPU, 1 thread per rank; pp worlds: {', '.join(map(str, worlds))}; m={args.microbatches}; "
        f"sleep costs TF/TB/TW = {'/'.join(f'{c:g}' for c in args.costs)} ms per microbatch of a rank's whole "
        f"part (interleaved: each of its v=2 stages sleeps half); {args.reps} timed repetitions "
        f"(HF: {args.hf_reps}) after {args.warmup} warm-up, medians",
        "",
    ]


def make_spec(args: argparse.Namespace, schedules: Sequence[tuple[str, int]]) -> dict:
    return {
        "microbatches": args.microbatches, "costs_ms": list(args.costs), "reps": args.reps, "warmup": args.warmup,
        "torch": not args.no_torch, "schedules": [list(s) for s in schedules], "sections": ["sleep", "hf"],
        "sleep": {"rows": 4, "dim": 16},
        "hf": {"layers": args.layers, "heads": 4, "kv_heads": 2, "head_dim": args.hidden // 4,
               "intermediate": 2 * args.hidden, "vocab": 1024, "rows": 2, "seq": args.seq, "reps": args.hf_reps},
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=4, help="main pipeline size (pp=2 is also run unless --quick)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--costs", type=lambda s: [float(x) for x in s.split(",")], default=[20.0, 20.0, 20.0],
                   help="TF,TB,TW sleep in ms per microbatch of a rank's part (default 20,20,20)")
    p.add_argument("--reps", type=int, default=None, help="sleep-stage repetitions (default 7, quick 3)")
    p.add_argument("--hf-reps", type=int, default=None, help="HF repetitions (default 5, quick 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, default=8, help="HF decoder layers")
    p.add_argument("--hidden", type=int, default=128, help="HF hidden size (4 heads, 2 KV heads)")
    p.add_argument("--seq", type=int, default=128, help="HF tokens per sequence (2 sequences per microbatch)")
    p.add_argument("--no-torch", action="store_true", help="skip torch's schedules")
    p.add_argument("--quick", action="store_true", help="under ~2 minutes: only --pp, fewer repetitions")
    p.add_argument("--out", default="benchmarks/results", help="folder for the PNG timelines and pipeline.md")
    args = p.parse_args(argv)
    if len(args.costs) != 3:
        p.error("--costs takes three numbers: TF,TB,TW in ms")
    args.reps = args.reps or (3 if args.quick else 7)
    args.hf_reps = args.hf_reps or (2 if args.quick else 5)
    return args


def report(args: argparse.Namespace, results: dict[int, list[dict]], plans: dict[int, list[tuple[str, int]]],
           notes: list[str]) -> list[str]:
    m, costs, worlds = args.microbatches, args.costs, list(results)
    cfg = make_spec(args, [])["hf"]
    lines = header(args, worlds)
    lines += ["## 1. Sleep stages: measured vs simulated", "",
              "Ideal = meshkit's simulator at the configured costs and zero P2P latency; 'sim at measured sleeps' "
              "replays the schedule with the sleep durations actually observed (oversleep on a loaded machine), so "
              "that ratio is the runtime's own overhead. Bubble = idle share of ranks x step. 'sleeps in schedule "
              "order': every rank's recorded F/B/W sleeps equal its action list (BW = the W hook, then B). "
              "'implied overhead per action': the fixed time added to every F/B/W/BW at which the simulator "
              "reproduces the measured step (all runtime overhead charged to the actions).", ""]
    for world in worlds:
        lines += [f"pp={world}, m={m}:", "", *sleep_section(world, m, costs, results[world], plans[world])]
    lines += ["ZB-H1 vs 1F1B (idle time per rank and step time):", ""]
    lines += table(ZB_HEADERS, [zb_vs_1f1b(w, m, costs, results[w]) for w in worlds if ("zb_h1", 1) in plans[w]])
    lines += ["## 2. meshkit vs torch.distributed.pipelining on the same sleep stages", "",
              "CPU = process time of all ranks in the step (gloo waits block, so it is the runtime's own work). "
              "torch's order simulated: the action list torch builds (`pipeline_order`, read through the private "
              "accessor `_pipeline_torch.compute_order`) replayed by meshkit's checker and simulator, with torch's "
              "first-stage behaviour under ZB (I does nothing, W runs the whole backward).", ""]
    for world in worlds:
        lines += [f"pp={world}, m={m}:", "", *torch_section(world, m, costs, results[world], plans[world])]
    lines += ["## 3. HF LlamaForCausalLM stages (real compute)", "",
              f"{args.layers} layers, hidden {args.hidden}, 4 heads (2 KV), MLP {2 * args.hidden}, vocab 1024, "
              f"microbatch 2 x {args.seq} tokens, {m * 2 * args.seq} tokens per step, fp32; split by "
              "`meshkit.pipeline.split.split_layers` (embedding and head count as layers). pp ranks share "
              f"{os.cpu_count()} cores with whatever else runs, so wall-clock 'speed vs unsplit' measures CPU "
              "contention as much as the schedule; 'CPU vs unsplit' is the cost of splitting.", ""]
    for world in worlds:
        lines += [f"pp={world}, m={m}:", "", *hf_section(m, cfg, results[world], plans[world])]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    start = time.perf_counter()
    worlds = [args.pp] if args.quick or args.pp == 2 else [args.pp, 2]
    notes: list[str] = []
    results: dict[int, list[dict]] = {}
    plans: dict[int, list[tuple[str, int]]] = {}
    for world in worlds:
        plans[world], left_out = runnable(world, args.microbatches)
        notes += left_out
        print(f"[pipeline] pp={world}: sleep and HF stages ({time.perf_counter() - start:.0f}s)", file=sys.stderr,
              flush=True)
        results[world] = run_world(world, make_spec(args, plans[world]), notes)
    lines = report(args, results, plans, notes)
    text, pngs = timelines(args.pp, args.microbatches, args.costs, Path(args.out), plans[args.pp])
    lines += ["## 4. Simulated timelines", "", f"PNGs: {', '.join(str(p) for p in pngs)}", "",
              f"ZB-H1 at pp={args.pp}, m={args.microbatches} (time in units of TF = {args.costs[0]:g} ms):", "",
              *text]
    lines += [f"- {n}" for n in notes] + ([""] if notes else [])
    lines.append(f"Total runtime {time.perf_counter() - start:.0f} s.")
    text_report = "\n".join(lines) + "\n"
    print(text_report)
    (Path(args.out) / "pipeline.md").write_text(text_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
