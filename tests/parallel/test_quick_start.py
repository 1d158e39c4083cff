"""The README's quick start is a complete program: run exactly as written on 4 ranks, it trains
(every rank prints the same global loss) and generates."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def quick_start_code() -> str:
    """The first python block under the README's "## Quick start" heading."""
    text = README.read_text()
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(code: str) -> None:
    exec(compile(code, "README.md quick start", "exec"), {"__name__": "__main__"})


def test_the_quick_start_runs_as_written(dist):
    code = quick_start_code()
    assert "--nproc-per-node 4" in code
    outcomes = dist(4).run_raw(_run, code)
    assert all(o.ok for o in outcomes), "\n".join(f"rank {o.rank}: {o.message}\n{o.traceback}" for o in outcomes)
    losses = [re.findall(r"step (\d) loss (\d+\.\d+)", o.output) for o in outcomes]
    assert len(losses[0]) == 5 and all(rank == losses[0] for rank in losses), losses
    assert all("tensor([[" in o.output for o in outcomes), outcomes[0].output[-500:]
