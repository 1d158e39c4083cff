"""CPU time per training step against the peers, paired (`python -m benchmarks.cpu_time [--out DIR]`).

Two gloo ranks, one process each (1 thread), the same tiny Llama and the same inputs on both sides:

- TP: meshkit `Plan(tp=2)` (sequence parallel on, and off) vs transformers' own tensor parallelism,
  `LlamaForCausalLM.from_pretrained(..., tp_plan="auto", device_mesh=...)`, which applies the model's
  `base_model_tp_plan` (colwise q/k/v/gate/up, rowwise o/down, the head gathering its output);
- FSDP: meshkit `Plan(dp_shard=2)` vs a hand-written per-layer `fully_shard` (embedding, each block,
  [norm, head] kept gathered, root), stepped as plain HF.

A step is forward + backward and dropping the gradients. The machine is 2 cores shared with other
work, so absolute times drift by tens of percent over a run: every repetition runs every variant back
to back (order rotated), a barrier starts each one, and the reported ratio is the median over
repetitions of (meshkit's CPU seconds / the peer's) in that repetition, summed over both ranks
(`time.process_time`: gloo waits block, so it is work, not waiting). The load average is recorded.
Losses are compared before timing: the sides must compute the same step.

The pipeline's CPU ratio against torch's schedules is measured by `python -m benchmarks.pipeline`
(sections 2 and 3 of benchmarks/results/pipeline.md), not repeated here.

`--profile` adds, per TP variant, rank 0's breakdown of one warm step: CPU self time per category of
code (cProfile timed by process time: DTensor's dispatch and redistribution, transformers' model
code, C++ ops, ...) and the aten ops and collectives dispatched (torch.profiler counts), to show
where one side spends what the other does not.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaForCausalLM

from benchmarks.launch import handwritten_fsdp, meshkit_model, run_ranks, seeded_llama
from benchmarks.report import emit, machine_line, table

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt  # noqa: E402

MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=1024, max_position_embeddings=1024, use_cache=False,
             tie_word_embeddings=False, attn_implementation="sdpa")
BATCH, SEQ = 2, 256
QUICK = dict(reps=5, warmup=1)
FULL = dict(reps=15, warmup=2)


def _ids() -> torch.Tensor:
    """The same token ids on every rank and for every variant, so the losses must agree."""
    return torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _hf_step(model: torch.nn.Module, ids: torch.Tensor) -> Callable[[], float]:
    """A timed step of an HF-side model (the peers: transformers' TP, hand-written FSDP2)."""
    def step() -> float:
        """Forward and backward; gradients dropped so repetitions do not accumulate."""
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return float(loss.detach())
    return step


def _meshkit_step(pm: Any, ids: torch.Tensor) -> Callable[[], float]:
    """A timed meshkit step on the same ids, gradients dropped as the peer drops them."""
    def step() -> float:
        """Forward and backward; gradients dropped so repetitions do not accumulate."""
        loss = pm.forward_backward(ids, ids)
        for p in pm.parameters():
            p.grad = None
        return float(loss)
    return step


def _hf_tp(folder: str) -> LlamaForCausalLM:
    """transformers' own tensor parallelism (`tp_plan="auto"`) of the saved model: the TP peer."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    return LlamaForCausalLM.from_pretrained(folder, tp_plan="auto", device_mesh=mesh, dtype=torch.float32)


def _variants(group: str, folder: str) -> dict[str, Callable[[], float]]:
    """The steps compared in one group, peer first; every rank feeds the same ids."""
    ids = _ids()
    if group == "tp":
        return {"transformers tp_plan=auto": _hf_step(_hf_tp(folder), ids),
                "meshkit TP+SP": _meshkit_step(meshkit_model(MODEL, "tp=2"), ids),
                "meshkit TP (no SP)": _meshkit_step(meshkit_model(MODEL, "tp=2,sequence_parallel=false"), ids)}
    return {"hand-written fully_shard": _hf_step(handwritten_fsdp(seeded_llama(MODEL))[0], ids),
            "meshkit FSDP": _meshkit_step(meshkit_model(MODEL, "dp_shard=2"), ids)}


def time_group(group: str, folder: str, reps: int, warmup: int) -> dict[str, Any]:
    """On every rank: the first losses, then per repetition each variant's CPU and wall seconds."""
    steps = _variants(group, folder)
    losses = {name: step() for name, step in steps.items()}
    for _ in range(warmup):
        for step in steps.values():
            step()
    names = list(steps)
    cpu: dict[str, list[float]] = defaultdict(list)
    wall: dict[str, list[float]] = defaultdict(list)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            dist.barrier()
            c0, w0 = time.process_time(), time.perf_counter()
            steps[name]()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    return {"losses": losses, "cpu": dict(cpu), "wall": dict(wall)}


CATEGORIES = (  # (label, path fragment of the Python function's file); first match wins
    ("DTensor (dispatch, sharding propagation, redistribute)", "torch/distributed/tensor/"),
    ("other torch.distributed Python (c10d, functional collectives, FSDP)", "torch/distributed/"),
    ("meshkit", "meshkit/"),
    ("transformers model code", "transformers/"),
    ("other torch Python (nn.Module call, autograd functions, hooks)", "torch/"),
    ("C++ ops and builtins (aten compute, collectives, autograd engine)", "~"),
)


def profile_group(group: str, folder: str) -> dict[str, Any]:
    """Rank 0's breakdown of one warm step per variant.

    CPU seconds of self time per category from `cProfile` timed by `time.process_time` (so load on
    the machine does not inflate it; cProfile's own cost inflates the Python rows alike on both
    sides), and the aten ops and collectives dispatched, counted by `torch.profiler`.
    """
    steps = _variants(group, folder)
    out = {}
    for name, step in steps.items():
        step()
        step()
        c0 = time.process_time()
        step()
        plain = time.process_time() - c0
        prof = cProfile.Profile(time.process_time)
        prof.enable()
        step()
        prof.disable()
        cats: dict[str, float] = defaultdict(float)
        for (path, _, _), (_, _, self_s, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
            label = next((lab for lab, frag in CATEGORIES if frag in path.replace(os.sep, "/")), "other Python")
            cats[label] += self_s
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
            step()
        counts = {e.key: e.count for e in tp.key_averages() if e.key.startswith(("aten::", "c10d::"))}
        out[name] = {"plain": plain, "cats": dict(cats), "counts": counts}
    return out


def _save_model(folder: str) -> None:
    """Rank 0 saves the seeded model once so `from_pretrained` gives the TP peer the same weights."""
    if dist.get_rank() == 0:
        seeded_llama(MODEL).save_pretrained(folder)
    dist.barrier()


def run_group(group: str, folder: str, reps: int, warmup: int, profile: bool) -> dict[str, Any]:
    """One comparison group on every rank: timings, and the cProfile breakdown when asked."""
    _save_model(folder)
    result = time_group(group, folder, reps, warmup)
    if profile:
        result["profile"] = profile_group(group, folder)
    return result


def _summarise(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-repetition CPU summed over ranks; wall = the slowest rank's."""
    names = list(results[0]["cpu"])
    reps = len(results[0]["cpu"][names[0]])
    cpu = {n: [sum(r["cpu"][n][i] for r in results) for i in range(reps)] for n in names}
    wall = {n: [max(r["wall"][n][i] for r in results) for i in range(reps)] for n in names}
    return {"names": names, "cpu": cpu, "wall": wall, "losses": results[0]["losses"]}


def _ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median of the paired ratios a_i/b_i and its interquartile range."""
    rs = sorted(x / y for x, y in zip(a, b))
    q = statistics.quantiles(rs, n=4) if len(rs) > 1 else [rs[0]] * 3
    return statistics.median(rs), q[0], q[2]


def _profile_lines(prof: dict[str, Any]) -> list[str]:
    """The cProfile table: where each variant's CPU goes, by category, to explain a ratio rather than only state it."""
    names = list(prof)
    rows = [["step CPU, not profiled (ms)"] + [f"{prof[n]['plain'] * 1e3:.1f}" for n in names]]
    labels = [lab for lab, _ in CATEGORIES] + ["other Python"]
    rows += [[f"cProfile: {lab} (ms)"] + [f"{prof[n]['cats'].get(lab, 0.0) * 1e3:.1f}" for n in names]
             for lab in labels]
    rows.append(["cProfile: total (ms)"] + [f"{sum(prof[n]['cats'].values()) * 1e3:.1f}" for n in names])

    def count(n: str, pred: Callable[[str], bool]) -> int:
        """Calls of the profiled functions whose name passes `pred` (a count per category)."""
        return sum(c for k, c in prof[n]["counts"].items() if pred(k))

    rows.append(["aten ops dispatched"] + [f"{count(n, lambda k: k.startswith('aten::'))}" for n in names])
    rows.append(["collectives (c10d calls)"] + [f"{count(n, lambda k: k.startswith('c10d::'))}" for n in names])
    keys = sorted({k for n in names for k in prof[n]["counts"]},
                  key=lambda k: -(max(prof[n]["counts"].get(k, 0) for n in names)
                                  - min(prof[n]["counts"].get(k, 0) for n in names)))
    rows += [[f"`{k}` calls"] + [f"{prof[n]['counts'].get(k, 0)}" for n in names] for k in keys[:12]]
    return table(["rank 0, one warm step"] + names, rows)


def main(argv: list[str] | None = None) -> int:
    """Time each group on 2 ranks, print the ratios, write the table and chart with --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder: writes cpu_time.md and cpu_time.png there")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK['reps']} repetitions instead of {FULL['reps']}")
    parser.add_argument("--profile", action="store_true", help="per-op breakdown of one step per variant")
    parser.add_argument("--groups", nargs="*", default=["tp", "fsdp"])
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    load_before = os.getloadavg()
    summaries, profiles = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for group in args.groups:
            results = run_ranks(run_group, 2, group, folder, cfg["reps"], cfg["warmup"],
                                args.profile)
            summaries[group] = _summarise(results)
            if "profile" in results[0]:
                profiles[group] = results[0]["profile"]
    lines = ["# CPU time per training step vs the peers (paired, 2 gloo ranks)", "", machine_line(
        f"; load average at start {', '.join(f'{x:.1f}' for x in load_before)}"),
             f"- model: {MODEL['num_hidden_layers']} Llama blocks, hidden {MODEL['hidden_size']}, "
             f"{MODEL['num_attention_heads']} q / {MODEL['num_key_value_heads']} kv heads, MLP "
             f"{MODEL['intermediate_size']}, vocab {MODEL['vocab_size']}; batch {BATCH} x {SEQ} tokens, fp32; "
             f"step = forward + backward; {cfg['reps']} paired repetitions after {cfg['warmup']} warm-up, order "
             "rotated; CPU = process time summed over both ranks; ratio = median of per-repetition ratios "
             "(interquartile range in brackets)", ""]
    bars = {}
    for group, s in summaries.items():
        peer = s["names"][0]
        rows = []
        for n in s["names"]:
            r, lo, hi = _ratio(s["cpu"][n], s["cpu"][peer])
            rw = _ratio(s["wall"][n], s["wall"][peer])[0]
            rows.append([n, f"{s['losses'][n]:.6f}", f"{statistics.median(s['cpu'][n]) * 1e3:.1f}",
                         f"{statistics.median(s['wall'][n]) * 1e3:.1f}", f"{r:.3f} [{lo:.3f}, {hi:.3f}]", f"{rw:.3f}"])
            if n != peer:
                bars[f"{n} / {peer}"] = (r, lo, hi)
        lines += [f"## {group.upper()}, 2 ranks (peer: {peer})", ""] + table(
            ["variant", "loss", "CPU ms/step (median)", "wall ms/step (median)", "CPU / peer", "wall / peer"], rows)
    for group, prof in profiles.items():
        lines += [f"## Where one {group.upper()} step's CPU goes", ""]
        lines += _profile_lines(prof)
    lines.append(f"- load average at end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        emit(lines, str(Path(args.out) / "cpu_time.md"))
        _chart(Path(args.out) / "cpu_time.png", bars)
    else:
        emit(lines, None)
    return 0


def _chart(path: Path, bars: dict[str, tuple[float, float, float]]) -> None:
    """CPU per step as a ratio to the peer, with the interquartile range of the paired ratios."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    names = list(bars)
    mid = [bars[n][0] for n in names]
    err = [[m - bars[n][1] for n, m in zip(names, mid)], [bars[n][2] - m for n, m in zip(names, mid)]]
    ax.barh(range(len(names)), mid, xerr=err, color="tab:blue", capsize=3)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel("CPU time per step, meshkit / peer (median of paired ratios)")
    ax.set_title("CPU time vs peers, 2 gloo ranks (benchmarks.cpu_time)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
