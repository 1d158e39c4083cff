"""The README's own training loop on a token store is a complete program: run as written on 4 ranks it
trains and saves; launched again after its newest checkpoint is lost, it resumes from the previous one
(model, optimizer, the loader's position) and prints exactly the losses of the first launch."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np

from meshkit.data.store import write_store

README = Path(__file__).resolve().parents[2] / "README.md"


def own_loop_code() -> str:
    """The python block after "In a training loop of your own" in the README."""
    text = README.read_text()
    section = text[text.index("In a training loop of your own"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run_in(directory: str, code: str) -> None:
    here = os.getcwd()
    os.chdir(directory)
    try:
        exec(compile(code, "README.md own loop", "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(here)


def test_the_own_loop_runs_as_written_and_resumes(dist, tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 500, n - 1), 0) for n in rng.integers(20, 200, 60)]
    write_store(tmp_path / "runs" / "data" / "mine", docs, eos_id=0, vocab_size=500)
    code = own_loop_code()

    def launch() -> list[list[tuple[str, str]]]:
        outcomes = dist(4).run_raw(_run_in, str(tmp_path), code)
        assert all(o.ok for o in outcomes), "\n".join(f"rank {o.rank}: {o.message}\n{o.traceback}" for o in outcomes)
        return [re.findall(r"step (\d+) loss (\d+\.\d+)", o.output) for o in outcomes]

    first = launch()
    assert [s for s, _ in first[0]] == [str(s) for s in range(1, 9)] and all(r == first[0] for r in first), first
    assert sorted(p.name for p in (tmp_path / "runs" / "own_loop").iterdir()) == ["step-00000004", "step-00000008"]
    shutil.rmtree(tmp_path / "runs" / "own_loop" / "step-00000008")  # as if killed between the two saves
    again = launch()
    assert all(r == first[0][4:] for r in again), (again, first[0])
    assert (tmp_path / "runs" / "own_loop" / "step-00000008").is_dir()
