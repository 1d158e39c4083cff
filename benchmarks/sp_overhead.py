"""Where sequence parallelism's extra CPU goes on CPU ranks: each collective's cost per call, and SP
against no SP in one world (`python -m benchmarks.sp_overhead [--reps N] [--out FILE]`).

Issue #34 item 2 asks SP (tp=2) to cost within 5% of no SP on CPU. Per block and direction SP issues
an all-gather and a reduce-scatter at each of the two boundaries where no SP issues one all-reduce;
the bytes are the same. So SP's CPU depends on what a transport charges per call, measured first:
one all-reduce of a [B, S, H] activation, the all-gather producing it from sequence shards and the
reduce-scatter consuming it, through c10d on gloo, as the pairwise messages meshkit sends on gloo
(`tensor_parallel.pairwise`; c10d's reduce-scatter on gloo is an all-reduce of a clone) and through
the shared-memory channel meshkit opens among a host's CPU ranks (`shared_memory`).
Then four variants of the same step train in one world, order rotated per repetition: tp=2 without
and with SP as meshkit runs them (shared memory), and both again with `MESHKIT_SHARED_MEMORY=0`
(gloo: c10d's all-reduce, the pairwise messages). A ratio is the median over repetitions of
(variant / its transport's no SP) of that repetition's median step CPU (process time, every thread
included, summed over both ranks). Steps call `forward_backward` without zeroing gradients, an
accumulation window: SP's norm gradients, Partial sums, add locally and are all-reduced once per
call (`tensor_parallel.styles.grads_as_partial_sums`).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import meshkit
from benchmarks.launch import run_ranks, seeded_llama
from benchmarks.report import emit, machine_line, table
from benchmarks.trainer import MODEL
from meshkit._compat.collectives import all_gather_single, reduce_scatter_single
from meshkit.tensor_parallel import pairwise
from meshkit.transport import shared_memory

BATCH, SEQ = 2, 256
VARIANTS = ("no SP", "SP", "no SP, gloo", "SP, gloo")
BASELINE = {"no SP": "no SP", "SP": "no SP", "no SP, gloo": "no SP, gloo", "SP, gloo": "no SP, gloo"}


def collective_costs(calls: int = 80) -> dict[str, tuple[float, float]]:
    """On every rank: (CPU ms, wall ms) per call of each collective on one [B, S, H] activation."""
    torch.set_num_threads(1)
    tp, hidden = dist.get_world_size(), MODEL["hidden_size"]
    full = torch.randn(tp * BATCH, SEQ // tp, hidden)  # rank-major, as c10d's reduce-scatter input
    activation = torch.randn(BATCH, SEQ, hidden)  # [B, S, H], as the pairwise reduce-scatter's
    shard, gathered = torch.randn(BATCH, SEQ // tp, hidden), torch.empty(tp * BATCH, SEQ // tp, hidden)
    out, group = torch.empty(BATCH, SEQ // tp, hidden), dist.group.WORLD
    channel = shared_memory.open_for(group, "cpu")
    ops = {"all-reduce (c10d)": lambda: dist.all_reduce(full.clone()),
           "all-reduce (shared memory)": lambda: channel.all_reduce(activation, group),
           "all-gather (c10d)": lambda: all_gather_single(gathered, shard, group),
           "all-gather (pairwise)": lambda: pairwise.all_gather(shard, group, tp),
           "all-gather (shared memory)": lambda: channel.all_gather(shard, group),
           "reduce-scatter (c10d)": lambda: reduce_scatter_single(out, full, group),
           "reduce-scatter (pairwise)": lambda: pairwise.reduce_scatter(activation, group, tp),
           "reduce-scatter (shared memory)": lambda: channel.reduce_scatter(activation, group)}
    costs = {}
    for name, op in ops.items():
        for _ in range(5):
            op()
        dist.barrier()
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(calls):
            op()
        costs[name] = ((time.process_time() - cpu) / calls * 1e3, (time.perf_counter() - wall) / calls * 1e3)
    return costs


# thread name prefix -> the share of the process's CPU it stands for
THREADS = {"python": "main thread", "gloo_tcp_loop": "gloo transport", "pt_gloo_runloop": "c10d workers"}


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed by `THREADS` kind (Linux /proc)."""
    tick, out = os.sysconf("SC_CLK_TCK"), dict.fromkeys(THREADS.values(), 0.0)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        kind = next((v for k, v in THREADS.items() if name.startswith(k)), None)
        if kind is not None:
            out[kind] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def step_cpu(variant: str, steps: int = 8, warmup: int = 2) -> tuple[float, float, dict[str, float]]:
    """On every rank: the median step CPU seconds of `variant`, its last loss, and the timed steps'
    CPU seconds per step by thread kind."""
    os.environ["MESHKIT_SHARED_MEMORY"] = "0" if variant.endswith("gloo") else "1"
    torch.set_num_threads(1)
    plan = "tp=2" + (",sequence_parallel=false" if variant.startswith("no SP") else "")
    pm = meshkit.parallelize(seeded_llama(MODEL), meshkit.Plan.from_string(plan))
    pm.check_inputs = False
    gen, cpu, loss = torch.Generator().manual_seed(0), [], torch.zeros(())
    for step in range(warmup + steps):
        ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=gen)
        dist.barrier()
        if step == warmup:
            before = thread_cpu()
        start = time.process_time()
        loss = pm.forward_backward(ids, ids)
        if step >= warmup:
            cpu.append(time.process_time() - start)
    after = thread_cpu()
    os.environ.pop("MESHKIT_SHARED_MEMORY")
    return statistics.median(cpu), float(loss), {k: (after[k] - before[k]) / steps for k in after}


def measure(reps: int) -> dict[str, Any]:
    """The per-call costs, then every variant per repetition, order rotated."""
    costs = run_ranks(collective_costs, 2)
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    threads: dict[str, dict[str, list[float]]] = {v: {k: [] for k in THREADS.values()} for v in VARIANTS}
    losses = {}
    for rep in range(reps):
        for variant in VARIANTS[rep % len(VARIANTS):] + VARIANTS[:rep % len(VARIANTS)]:
            ranks = run_ranks(step_cpu, 2, variant)
            cpu[variant].append(sum(r[0] for r in ranks))
            losses[variant] = ranks[0][1]
            for kind in THREADS.values():
                threads[variant][kind].append(sum(r[2][kind] for r in ranks))
    return {"costs": costs, "cpu": cpu, "losses": losses, "threads": threads}


def report(result: dict[str, Any], reps: int) -> list[str]:
    """The markdown: per-call costs, then the variants and their ratio to no SP on the same transport."""
    costs, cpu = result["costs"], result["cpu"]
    lines = ["# Sequence parallelism's CPU on CPU ranks (2 ranks, tp=2)", "", machine_line(),
             f"- activation [B, S, H] = [{BATCH}, {SEQ}, {MODEL['hidden_size']}] fp32; model: "
             f"{MODEL['num_hidden_layers']} Llama blocks; {reps} repetitions x 8 timed steps (forward + backward)",
             "", "## One collective, per call (rank 0; rank 1)", ""]
    rows = [[name, f"{costs[0][name][0]:.3f}; {costs[1][name][0]:.3f}", f"{costs[0][name][1]:.3f}"]
            for name in costs[0]]
    lines += table(["collective", "CPU ms", "wall ms"], rows) + ["", "## One training step", ""]
    rows = [[v, f"{result['losses'][v]:.6f}", f"{statistics.median(cpu[v]) * 1e3:.1f}", BASELINE[v],
             f"{statistics.median(a / b for a, b in zip(cpu[v], cpu[BASELINE[v]])):.3f}"] for v in VARIANTS]
    lines += table(["variant", "loss", "CPU ms/step (both ranks)", "against", "ratio (paired median)"], rows)
    lines += ["", "## Where a step's CPU goes, by thread (ms per step, both ranks, median over repetitions)", "",
              "Linux accounts CPU in 10 ms ticks per thread; over 8 steps and two ranks a figure is good to a few ms.",
              ""]
    kinds = list(THREADS.values())
    rows = [[v, *(f"{statistics.median(result['threads'][v][k]) * 1e3:.1f}" for k in kinds)] for v in VARIANTS]
    return lines + table(["variant", *kinds], rows)


def main(argv: list[str] | None = None) -> None:
    """Measure and print (with --out, write) the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    emit(report(measure(args.reps), args.reps), args.out)


if __name__ == "__main__":
    main()
