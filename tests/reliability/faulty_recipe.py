"""`recipes/train_llama.py` with one fault injected, for the fault tests (this script is their only user).

The fault is chosen by `MESHKIT_TEST_FAULT` (read here, never by meshkit or the recipe):

- `pause-save:<step>:<marker>`: rank 0's DCP writer stops inside the save of step `<step>`, after
  every rank's shards are written and before the coordinator writes `.metadata` (so the checkpoint
  is half written); it creates `<marker>` and sleeps until it is killed.
- `hang:<rank>:<method>:<call>:<marker>`: rank `<rank>` stops before its `<call>`-th call (1 is the
  first) of `ParallelModel.<method>` (`forward_backward`, `clip_grad_norm_`) and sleeps, alive: its
  heartbeat thread keeps beating while the other ranks wait for it in their next collective.

- `none`: no fault (the test injects its own, e.g. a signal).

Then the recipe's `main` runs with the command line as given.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

import meshkit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))
train_llama = importlib.import_module("train_llama")


def _stall(marker: str) -> None:
    Path(marker).write_text(str(os.getpid()))
    while True:
        time.sleep(1)


def _pause_save(step: int, marker: str) -> None:
    finish = FileSystemWriter.finish

    def paused(self, metadata, results):
        if f"step-{step:08d}" in str(self.path):
            _stall(marker)
        return finish(self, metadata, results)

    FileSystemWriter.finish = paused


def _hang(rank: int, method: str, call: int, marker: str) -> None:
    original = getattr(meshkit.ParallelModel, method)
    calls = [0]

    def hanging(self, *args, **kwargs):
        calls[0] += 1
        if dist.get_rank() == rank and calls[0] == call:
            _stall(marker)
        return original(self, *args, **kwargs)

    setattr(meshkit.ParallelModel, method, hanging)


def main() -> int:
    kind, _, rest = os.environ["MESHKIT_TEST_FAULT"].partition(":")
    if kind == "pause-save":
        step, marker = rest.split(":", 1)
        _pause_save(int(step), marker)
    elif kind == "hang":
        rank, method, call, marker = rest.split(":", 3)
        _hang(int(rank), method, int(call), marker)
    elif kind != "none":
        raise SystemExit(f"MESHKIT_TEST_FAULT={kind!r}: unknown fault")
    return train_llama.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
