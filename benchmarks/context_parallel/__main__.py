"""Context-parallel attention on a CPU gloo mesh: work balance, bytes vs theory, step time, memory.

    python -m benchmarks.context_parallel [--cp 4] [--seq 1024] [--quick] [--gpu] [--out FILE]

The script starts gloo ranks through `benchmarks.launch` (one world per size; the per-rank code is
`hf_ranks.run` and `ranks`) and prints markdown (`work_bytes`, `time_memory`, `gpu`):

1. attention work per rank for ring (contiguous), zig-zag ring, Ulysses and USP: score elements
   from `ring_schedule`/`score_elements`, checked against the attention kernels that actually ran;
2. bytes each rank sends per attention call, forward and backward, counted on the real collectives
   and compared with the theoretical volume of each algorithm, and the Ring/Ulysses ratio vs the rule
   P*Hkv/(H+Hkv) from the field notes;
3. fwd+bwd time of the attention op and of a tiny HF Llama step through `meshkit.parallelize`, vs
   torch's experimental `context_parallel` where it runs (else the reason), vs the naive all-gather
   baseline and vs one process doing the full sequence;
4. memory per rank vs sequence length (saved-for-backward bytes, the longest K/V run a rank ever
   holds, peak RSS);
5. with `--gpu` and a CUDA device: kernel efficiency of ring blocks vs one full SDPA call.

Timings on a shared 2-core machine are noisy: variants are interleaved and medians (and medians of
per-repetition ratios) are printed. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import transformers

import meshkit
from benchmarks.context_parallel import gpu, hf_ranks, time_memory, work_bytes
from benchmarks.launch import run_ranks, run_ranks_raw
from benchmarks.report import emit, machine_line
from meshkit.testing.pool import NO_ANSWER


def launch(world: int, spec: dict) -> dict:
    """Every rank's measurements of one world, as {"world", "ranks"}."""
    return {"world": world, "ranks": run_ranks(hf_ranks.run, world, spec)}


def probe_hf_torch_cp(world: int, spec: dict) -> dict[int, str | None]:
    """Each rank's outcome of one HF step under torch's experimental CP, from a throwaway world
    (one layer and a short sequence: the question is whether it runs, not how fast)."""
    spec = dict(spec, model=dict(spec["model"], layers=1), shape=dict(spec["shape"], seq=16 * world))
    outcomes = run_ranks_raw(hf_ranks.probe_hf_torch_cp, world, spec)
    return {o.rank: None if o.ok else _reason(o.exc_type, o.message) for o in outcomes}


def _reason(exc_type: str, message: str) -> str:
    """One line for a CP kind that could not run, for the table instead of a traceback."""
    if exc_type == NO_ANSWER:
        return "gloo lost its peer: " + message
    text = message.strip().splitlines()
    return f"{exc_type}: {text[0] if text else ''}"


def describe_outcomes(outcomes: dict[int, str | None]) -> str | None:
    """None if every rank ran; else each distinct reason with the ranks that hit it."""
    if all(r is None for r in outcomes.values()):
        return None
    by_reason: dict[str, list[int]] = {}
    for rank, reason in outcomes.items():
        if reason and ("by peer" in reason or "lost its peer" in reason):  # gloo's "closed/reset by peer"
            reason = ("gloo lost its peer: stuck in a collective that a failed rank never joined, until that "
                      "rank exited")
        by_reason.setdefault(reason or "ran", []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {reason}"
                     for reason, r in by_reason.items())


def header(args: argparse.Namespace, worlds: Sequence[int], spec: dict) -> list[str]:
    """The report's title, command, machine and shape lines."""
    s = spec["shape"]
    return [
        "# meshkit context-parallel benchmark",
        "",
        machine_line(f"; transformers {transformers.__version__}; meshkit from `{os.path.relpath(meshkit.__path__[0])}`"),
        f"- backend gloo on CPU, 1 thread per rank; world sizes launched: {', '.join(map(str, worlds))} "
        f"(main cp={args.cp}; cp=8 rows in section 1 are from the schedule"
        + (" and a run" if 8 in worlds else " only") + ")",
        f"- attention shape: B={s['batch']}, H={s['heads']}, Hkv={s['kv_heads']} (GQA {s['heads'] // s['kv_heads']}:1), "
        f"D={s['head_dim']}, S={s['seq']}; USP uses cp_ulysses={spec['ulysses']}",
        "",
    ]


def make_spec(args: argparse.Namespace) -> dict:
    """What every rank needs to know: shapes, the HF model, dtypes, repetitions, lengths."""
    return {
        "shape": {"batch": args.batch, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                  "seq": args.seq},
        "model": {"hidden": args.heads * 32, "layers": 2, "heads": args.heads, "kv_heads": args.kv_heads,
                  "inter": args.heads * 64, "vocab": 1024},
        "dtypes": ["float32", "bfloat16"],
        "ulysses": 2,
        "reps": args.reps,
        "hf_reps": args.hf_reps,
        "warmup": 1,
        "mem_seqs": args.mem_seqs,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with --quick's defaults filled in."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=4, help="cp degree of the timing and memory sections")
    p.add_argument("--seq", type=int, default=1024, help="sequence length of sections 1-3")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=None, help="attention-op repetitions (default 15, quick 7)")
    p.add_argument("--hf-reps", type=int, default=None, help="HF step repetitions (default 7, quick 3)")
    p.add_argument("--mem-seqs", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="comma-separated lengths for section 4 (default 512..8192, quick 512..2048)")
    p.add_argument("--quick", action="store_true", help="under ~2 minutes: no cp=8 run, fewer reps and lengths")
    p.add_argument("--gpu", action="store_true", help="add section 5 (runs only with a CUDA device)")
    p.add_argument("--gpu-seqs", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768])
    p.add_argument("--gpu-heads", type=int, default=32)
    p.add_argument("--gpu-kv-heads", type=int, default=8)
    p.add_argument("--gpu-head-dim", type=int, default=128)
    p.add_argument("--gpu-reps", type=int, default=10)
    p.add_argument("--out", help="also write the markdown here (e.g. benchmarks/results/context_parallel.md)")
    args = p.parse_args(argv)
    _validate(p, args)
    args.reps = args.reps or (7 if args.quick else 15)
    args.hf_reps = args.hf_reps or (3 if args.quick else 7)
    args.mem_seqs = args.mem_seqs or ([512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096, 8192])
    return args


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fail before forking anything: zig-zag needs 2*cp equal chunks at every world launched."""
    multiple = 2 * max(args.cp, 2 if args.quick else 8)
    bad = [s for s in [args.seq] + (args.mem_seqs or []) if s % multiple]
    if bad:
        p.error(f"sequence lengths {bad} must be multiples of {multiple} (2 x the largest cp launched)")
    if args.cp < 2 or args.heads % args.kv_heads:
        p.error("need --cp >= 2 and --heads divisible by --kv-heads")


def main(argv: list[str] | None = None) -> int:
    """Run every world, then print (and with --out write) the report."""
    args = parse(argv)
    start = time.perf_counter()
    spec = make_spec(args)
    worlds = sorted({2, args.cp} | (set() if args.quick else {8}))
    print(f"[context_parallel] cp={args.cp}: torch CP probe on the HF model", file=sys.stderr, flush=True)
    torch_hf = describe_outcomes(probe_hf_torch_cp(args.cp, spec))
    spec["torch_cp_hf_ok"] = torch_hf is None
    results: dict[int, dict] = {}
    for world in worlds:
        sections = ["counts"] + (["time", "memory"] if world == args.cp else [])
        print(f"[context_parallel] cp={world}: {', '.join(sections)} ({time.perf_counter() - start:.0f}s)",
              file=sys.stderr, flush=True)
        results[world] = launch(world, dict(spec, sections=sections))
    counts = {w: _by_kind(r) for w, r in results.items()}
    torch_cp = {w: r["ranks"][0]["torch_cp"] for w, r in results.items()}
    shape = spec["shape"]
    lines = header(args, worlds, spec)
    lines += work_bytes.work_section(shape, sorted({2, 4, 8} | {args.cp}), spec["ulysses"], counts)
    lines += work_bytes.step_detail(shape, args.cp)
    lines += work_bytes.bytes_section(shape, counts, spec["ulysses"], spec["dtypes"], torch_cp)
    lines += time_memory.time_section(results[args.cp], args.cp, shape, spec["model"], (args.reps, args.hf_reps),
                                      torch_hf)
    lines += time_memory.memory_section(results[args.cp], args.cp, shape, args.mem_seqs)
    lines += gpu.gpu_section(args)
    lines.append(f"Total runtime {time.perf_counter() - start:.0f} s.")
    emit(lines, args.out)
    return 0


def _by_kind(result: dict) -> dict[str, list[dict]]:
    """'kind|dtype' -> one record per rank."""
    keys = result["ranks"][0].get("counts", {})
    return {key: [r["counts"][key] for r in result["ranks"]] for key in keys}


if __name__ == "__main__":
    sys.exit(main())
