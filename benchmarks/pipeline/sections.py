"""The pipeline benchmark's tables: every rank's records against meshkit's simulator, torch's schedules
and the closed bubble formulas (sections 1-3), and the simulated timelines (section 4)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from benchmarks.pipeline import torch_pipeline as torch_pp
from benchmarks.pipeline.critical_path import CATEGORIES, critical_path
from benchmarks.pipeline.replay import (
    exact_ms,
    expected_sequences,
    replay_ratios,
    sleep_times,
    spread,
    stage_times,
)
from benchmarks.report import ms, paired, pct, table
from meshkit.pipeline.schedules import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    build_schedule,
    with_communication,
)
from meshkit.pipeline.simulate import Costs, SimulationResult, render_png, render_text, simulate

# DualPipe with v=1: each of its two stages per rank is a whole chunk (1/pp of the layers), so it sleeps a
# rank's full TF/TB/TW, where the V schedules' half-size stages sleep half.
SCHEDULES: tuple[tuple[str, int], ...] = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1),
                                          ("zb_h2", 1), ("zb_v", 2), ("dualpipe_v", 2), ("dualpipe", 1))
MS = 1000.0

# ---------------------------------------------------------------------------------------- formatting


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
    return paired(getattr(a, what), getattr(b, what))


# --------------------------------------------------------------------------------------- simulation


def stage_costs(costs_ms: Sequence[float], v: int) -> Costs:
    """Per-stage costs: a rank's work per microbatch is spread over its v stages."""
    f, b, w = (Fraction(c).limit_denominator(1000) / v for c in costs_ms)
    return Costs(forward=f, backward_input=b, backward_weight=w)


def records(ranks: list[dict], variant: str) -> list[list[dict]]:
    """Every rank's repetitions of one sleep-section variant."""
    return [r["sleep"]["times"][variant] for r in ranks]


def sleep_ratios(schedule: Schedule, ranks: list[dict], variant: str, torch_first_stage: bool = False) -> list[float]:
    """Per repetition: step / the simulator's step with every action at the sleeps it actually slept.

    Per repetition and per action, because the critical path collects the slow sleeps of that very
    step (one badly overslept wake-up on a loaded machine), which a mean per kind would smear out.
    """
    return replay_ratios(schedule, records(ranks, variant), lambda rep: sleep_times(schedule, rep, torch_first_stage))


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
    """The closed forms of docs/pipeline_schedules.md, with TF/TB/TW a rank's whole part per microbatch.

    ZB-H2 and the V schedules: the idle time within one step at TF = TB = TW (m >= 2p-1), the start-up
    skew of p-1 forwards of a stage (tests/pipeline/test_pipeline_zero_bubble.py proves it exactly);
    their papers' 0 is the idle inside each rank's span, the 'in spans' column.
    """
    tf, tb, tw = (Fraction(c).limit_denominator(1000) for c in costs_ms)
    if name == "zb_h1":
        idle = (p - 1) * (tf + tb - min(tf, tb, tw))
    elif name in ("zb_h2", "zb_v", "dualpipe_v"):
        idle = (p - 1) * tf / v
    elif name == "dualpipe":  # DualPipeV's on p/2 ranks: the middle ranks' first input crosses p/2-1 ranks
        idle = (p // 2 - 1) * tf
    else:
        idle = (p - 1) * (tf + tb + tw) / v
    return idle / (m * (tf + tb + tw) + idle)


def formula_text(name: str) -> str:
    return {"zb_h1": "(p-1)(TF+TB-TW)", "interleaved_1f1b": "(p-1)/(vm+p-1)", "zb_h2": "(p-1)TF [TF=TB=TW]",
            "zb_v": "(p-1)TF/2 [TF=TB=TW]", "dualpipe_v": "(p-1)TF/2 [TF=TB=TW]",
            "dualpipe": "(p/2-1)TF [TF=TB=TW]"}.get(name, "(p-1)/(m+p-1)")


def span_bubble(result: SimulationResult) -> Fraction:
    """Idle inside every rank's span over the ranks' busy-plus-idle time: the bubble once steps overlap."""
    idle = sum(result.span_idle, Fraction(0))
    return idle / (sum(result.busy, Fraction(0)) + idle)


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
        return [label(name, v), f"{float(ideal.step_time):.0f}", f"did not run: {t}"] + [""] * 10
    return [
        label(name, v), f"{float(ideal.step_time):.0f}", ms(t.step), f"{t.step * MS / float(ideal.step_time):.3f}",
        _ratio_cell(sleep_ratios, schedule, ranks, f"meshkit:{name}"), f"{implied_overhead(schedule, t) * MS:.2f}",
        "/".join(f"{t.per_sleep.get(k, 0) * MS:.2f}" for k in "FBW"),
        f"{formula_text(name)} = {pct(formula_bubble(name, p, m, v, costs_ms))}"
        + (" (holds for m >= p)" if name == "zb_h1" and m < p else ""), pct(ideal.bubble_fraction),
        pct(span_bubble(ideal)),
        pct(statistics.median(t.bubbles)), str(list(ideal.peak_activations)),
        sequence_check(expected_sequences(schedule), t.sequences),
    ]


def sleep_section(p: int, m: int, costs_ms: Sequence[float], ranks: list[dict],
                  schedules: Sequence[tuple[str, int]]) -> list[str]:
    rows = [sleep_row(name, v, p, m, costs_ms, ranks) for name, v in schedules]
    return table(["schedule", "ideal step (ms)", "measured (ms)", "measured / ideal",
                  "measured / sim at measured sleeps", "implied overhead per action (ms)", "one F/B/W sleep (ms)",
                  "bubble: formula", "simulated", "simulated, in rank spans", "measured", "peak act. (sim)",
                  "sleeps in schedule order"], rows)


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


def _ratio_cell(compute: Callable[..., list[float]], *args: Any, **kwargs: Any) -> str:
    """`spread` of the ratios `compute(*args, **kwargs)` returns, or why there are none (records that cannot
    be replayed)."""
    try:
        return spread(compute(*args, **kwargs))
    except (ValueError, KeyError) as error:
        return f"n/a ({torch_pp.first_line(error)})"


def overhead_section(p: int, m: int, ranks: list[dict], schedules: Sequence[tuple[str, int]]) -> list[str]:
    """The runtime-overhead target side by side: each runtime's step over the simulator's replay of its
    own order at what each of its actions took in that repetition (median [min-max] over repetitions),
    and their paired ratio."""
    info = ranks[0]["sleep"]
    rows = []
    for name, v in schedules:
        mine, theirs = timing(ranks, "sleep", f"meshkit:{name}"), timing(ranks, "sleep", f"torch:{name}")
        cls = torch_pp.PEERS[name][0] if name in torch_pp.PEERS else "none"
        if isinstance(mine, Timing):
            schedule = build_schedule(name, p, m, v)
            recs = records(ranks, f"meshkit:{name}")
            traced = all("trace" in rec for recs_ in recs for rec in recs_)
            cells = [ms(mine.step),
                     _ratio_cell(replay_ratios, schedule, recs, stage_times) if traced else "not traced",
                     _ratio_cell(sleep_ratios, schedule, ranks, f"meshkit:{name}")]
            plain = timing(ranks, "sleep", f"meshkit-untraced:{name}")
            cells.append(f"{paired_ratio(plain, mine):.3f}" if isinstance(plain, Timing) else "not run")
        else:
            cells = [f"did not run: {mine}", "", "", ""]
        order = torch_schedule(info["torch_orders"].get(name, "not built"), cls, p * v, m)
        if not isinstance(theirs, Timing):
            why = info["torch_refused"].get(name) or theirs
            rows.append([label(name, v), *cells, cls, f"n/a ({why})", "", ""])
            continue
        ratio = (_ratio_cell(sleep_ratios, order, ranks, f"torch:{name}", torch_first_stage=True)
                 if not isinstance(order, str) else f"n/a ({order})")
        rows.append([label(name, v), *cells, cls, ms(theirs.step), ratio,
                     f"{paired_ratio(mine, theirs):.3f}" if isinstance(mine, Timing) else "n/a"])
    return table(["schedule", "meshkit (ms)", "meshkit measured / sim at its per-action stage times",
                  "meshkit measured / sim at its per-action sleeps", "meshkit untraced / traced (paired)",
                  "torch class", "torch (ms)", "torch measured / sim of torch's order at its per-action sleeps",
                  "meshkit / torch (paired)"], rows)


def breakdown_section(p: int, m: int, ranks: list[dict], schedules: Sequence[tuple[str, int]]) -> list[str]:
    """meshkit's measured critical path per schedule (`critical_path`): median ms per category."""
    rows = []
    for name, v in schedules:
        per_rank = [r["sleep"]["times"].get(f"meshkit:{name}") or [] for r in ranks]
        if not all(per_rank) or any("trace" not in rec for recs in per_rank for rec in recs):
            rows.append([label(name, v), "not traced"] + [""] * (len(CATEGORIES) + 1))
            continue
        schedule = build_schedule(name, p, m, v)
        paths = [critical_path(schedule, list(rep)) for rep in zip(*per_rank)]
        t = timing(ranks, "sleep", f"meshkit:{name}")
        cat = {c: statistics.median(path[c] for path in paths) for c in CATEGORIES}
        runtime = statistics.median(sum(path[c] for c in CATEGORIES if c not in ("sleeps", "stage code"))
                                    for path in paths)
        rows.append([label(name, v), ms(t.step), *(f"{cat[c] * MS:.1f}" for c in CATEGORIES),
                     f"{runtime * MS:.1f} ({runtime / t.step:.1%})",
                     f"{statistics.median(path['hops'] for path in paths):.0f}"])
    return table(["schedule", "step (ms)", *(f"{c} (ms)" for c in CATEGORIES),
                  "the runtime's part: all but sleeps and stage code (ms, share of step)", "P2P hops on the path"],
                 rows)


def torch_section(p: int, m: int, costs_ms: Sequence[float], ranks: list[dict],
                  schedules: Sequence[tuple[str, int]]) -> list[str]:
    """meshkit vs torch on the same sleep stages, with torch's own order replayed in the simulator."""
    section = "sleep"
    info = ranks[0][section]
    rows = []
    for name, v in schedules:
        cls = torch_pp.PEERS[name][0] if name in torch_pp.PEERS else "none"
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
