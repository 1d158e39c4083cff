"""Starting a benchmark's gloo ranks: one forked process per rank, results back through a JSON file.

Forking (not spawning) shares the parent's already-imported torch and transformers, so a world of
ranks starts in about a second; each entry point is `entry(rank, world, port, spec, path)` and rank 0
writes its JSON result to `path`.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch


def free_port() -> int:
    """A TCP port nothing listens on now, for this world's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(entry: Callable, world: int, spec: dict) -> Any:
    """Fork `world` ranks running `entry` and return what rank 0 wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        torch.multiprocessing.start_processes(entry, args=(world, free_port(), spec, path), nprocs=world,
                                              start_method="fork")
        with open(path) as f:
            return json.load(f)


def emit(lines: list[str], out: str | None) -> None:
    """Print the report and, with `--out`, write the same markdown to that file."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
