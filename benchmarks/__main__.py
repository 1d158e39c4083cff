"""Run every benchmark and collect their tables in benchmarks/RESULTS.md (`python -m benchmarks`).

Each benchmark measures meshkit against a peer in the same run and prints markdown; this runner only
launches them one after another as `python -m benchmarks.<name>` (each starts its own gloo ranks,
and sharing 2 cores between two benchmarks would corrupt both timings), keeps each one's output,
and writes one file with the machine, the commands and every table. `--quick` passes `--quick` to
the benchmarks that have it. One that fails is reported in the file with its exit code and last
lines, never hidden.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# (module under benchmarks/, its own arguments, whether it accepts --quick)
BENCHMARKS = [
    ("overhead", [], False),
    ("communication", ["--out", str(RESULTS / "communication.md")], False),
    ("cpu_time", ["--profile", "--out", str(RESULTS)], True),
    ("context_parallel", ["--out", str(RESULTS / "context_parallel.md")], True),
    ("attention_scores", ["--out", str(RESULTS / "attention_scores.md")], True),
    ("pipeline", ["--out", str(RESULTS)], True),
    ("expert_parallel", ["--out", str(RESULTS / "expert_parallel.md")], True),
    ("data", ["--out", str(RESULTS / "data.md")], True),
    ("trainer", ["--out", str(RESULTS / "trainer.md")], True),
    ("memory", ["--out", str(RESULTS)], False),
    ("lora", ["--out", str(RESULTS / "lora.md")], True),
    ("charts", ["--out", str(RESULTS)], False),  # after context_parallel: plots its measured memory table
    ("gpu_mfu", [], True),  # prints "no CUDA device: skipped" without a GPU
]


def _run(name: str, args: list[str]) -> tuple[int, str, float]:
    """One benchmark in its own process (the way a user runs it), so one that crashes or leaks ranks cannot take the others down."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], capture_output=True, text=True,
                          cwd=HERE.parent, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    return proc.returncode, proc.stdout + (proc.stderr if proc.returncode else ""), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Run the selected benchmarks in sequence and write RESULTS.md; exit non-zero if any failed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the scripts' short variants")
    parser.add_argument("--only", nargs="*", help="benchmark names to run (default: all)")
    parser.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    import torch

    sections = [
        "# meshkit benchmark results\n",
        f"- written by `python -m benchmarks{' --quick' if args.quick else ''}` on "
        f"{datetime.datetime.now().isoformat(timespec='minutes')}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
        f"{os.cpu_count()} CPU cores, CUDA {'available' if torch.cuda.is_available() else 'not available'}",
        "- every number below was measured in the run that wrote this file; ratios compare meshkit with a peer "
        "measured in the same script run\n",
    ]
    failed = 0
    for name, extra, has_quick in BENCHMARKS:
        if args.only and name not in args.only:
            continue
        cmd = extra + (["--quick"] if args.quick and has_quick else [])
        print(f"running python -m benchmarks.{name} {' '.join(cmd)}", flush=True)
        code, output, seconds = _run(name, cmd)
        sections.append(f"\n---\n\n<!-- benchmarks.{name}: exit {code}, {seconds:.0f} s -->\n")
        if code:
            failed += 1
            tail = "\n".join(output.strip().splitlines()[-30:])
            sections.append(f"## benchmarks.{name} FAILED (exit {code})\n\n```\n{tail}\n```\n")
        else:
            sections.append(output.strip() + "\n")
        print(f"  {'FAILED' if code else 'ok'} in {seconds:.0f} s", flush=True)
    Path(args.out).write_text("\n".join(sections))
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
