"""The one table writer of the benchmarks, and the lines every report shares.

Numbers arrive already formatted, so each column keeps its own precision; `emit` prints the report
and, with `--out`, writes the same markdown to a file.
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import sys
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """A markdown table, then a blank line."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines + [""]


def emit(lines: list[str], out: str | None) -> None:
    """Print the report and, with `out`, write the same markdown to that file."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            f.write(text)


def machine_line(extra: str = "") -> str:
    """`- command: ...` and the software and machine a report was measured on."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    command = shlex.join([_interpreter(), "-m", _module_name()] + sys.argv[1:])
    return (f"- command: `{command}`\n- torch {torch.__version__}, Python {platform.python_version()}, "
            f"{platform.machine()}, {os.cpu_count()} CPU cores (load average {load}){extra}")


def _interpreter() -> str:
    """The interpreter as a user names it from the repository root: the `.venv` that `make` builds when
    the run is in a virtual environment, else `python`. Never this machine's own path to it (a worktree
    elsewhere made results cite `../../main/.venv/bin/python`)."""
    return ".venv/bin/python" if sys.prefix != sys.base_prefix else "python"


def _module_name() -> str:
    """The `python -m` name this run was started as, so a results file cites a command that reruns it."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return spec.name.removesuffix(".__main__") if spec is not None else sys.argv[0]


def paired(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of per-repetition ratios a/b: both ran back to back in every repetition, so load that
    drifts across the run cancels."""
    return statistics.median(x / y for x, y in zip(a, b))


def pct(x: float | Fraction) -> str:
    """A fraction as a percentage with one decimal."""
    return f"{float(x):.1%}"


def ms(seconds: float) -> str:
    """Seconds as milliseconds with one decimal."""
    return f"{seconds * 1e3:.1f}"


def mib(n: float | None) -> str:
    """Bytes as MiB with two decimals ('n/a' for None)."""
    return "n/a" if n is None else f"{n / 2**20:.2f}"


def ratio(a: float, b: float) -> str:
    """a / b with two decimals ('n/a' when b is 0)."""
    return "n/a" if not b else f"{a / b:.2f}"
