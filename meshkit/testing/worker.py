"""One rank of a `WorkerPool`: join the gloo world once, then run the tasks the pool sends until it goes.

The worker side of `pool.py`: a task is a pickled (function, args, kwargs); the reply is the return
value or the exception with its traceback, plus the worker's resource use, which tells the pool when
to recycle it. Settings a task changes process-wide are put back before the next task.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import select
import signal
import sys
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any


@dataclass
class WorkerSpec:
    """What a rank needs to start: its place in the world, the rendezvous port, where its output goes."""

    rank: int
    world_size: int
    port: int
    log_path: str
    parent_pid: int
    env: dict[str, str]
    start_timeout: float


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """One rank: join the gloo world once, then run tasks until the parent goes away."""
    fd = os.open(spec.log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line-buffered, so a rank that hangs or crashes has already written what it printed.
    sys.stdout = open(1, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    faulthandler.enable(all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(target=_exit_with_parent, args=(spec.parent_pid,), daemon=True).start()
    os.environ.clear()
    os.environ.update(spec.env)
    os.environ.update(RANK=str(spec.rank), WORLD_SIZE=str(spec.world_size), LOCAL_RANK=str(spec.rank),
                      LOCAL_WORLD_SIZE=str(spec.world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(spec.port))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", spec.port, spec.world_size, is_master=False,
                              timeout=timedelta(seconds=spec.start_timeout))
        dist.init_process_group("gloo", store=store, rank=spec.rank, world_size=spec.world_size)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", None))
    _serve(conn)


def _serve(conn: Connection) -> None:
    import torch.distributed as dist

    state = _ProcessState()
    while True:
        try:
            task_id, payload = conn.recv()
        except (EOFError, OSError):
            return
        try:
            with warnings.catch_warnings():
                fn, args, kwargs = pickle.loads(payload)
                value = fn(*args, **kwargs)
            reply: tuple[str, Any] = ("ok", pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        except BaseException as exc:
            reply = ("raised", _describe(exc))
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send((task_id, *reply, _resources()))
        if reply[0] == "raised" and dist.is_initialized():
            # Closing this rank's sockets makes peers blocked in a collective with it fail at once
            # instead of at the gloo timeout; the parent restarts the pool after a failure anyway.
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        state.restore()


def _describe(exc: BaseException) -> dict[str, Any]:
    try:
        pickled: bytes | None = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pickled = None
    tb = exc.__traceback__
    if tb is not None and tb.tb_next is not None:
        tb = tb.tb_next  # start at the test's function, not at the harness frame that called it
    return {"exc_type": type(exc).__name__, "message": str(exc), "at": time.time(), "pickled": pickled,
            "traceback": "".join(traceback.format_exception(type(exc), exc, tb))}


class _ProcessState:
    """Process-wide settings a test may change and the next test would silently inherit.

    Each setter runs only when the setting changed: some are slow the first time (enabling
    deterministic algorithms imports torch._inductor, seconds per rank).
    """

    def __init__(self) -> None:
        import torch

        self.env = dict(os.environ)
        self.cwd = os.getcwd()
        self.dtype = torch.get_default_dtype()
        self.device = torch.get_default_device()
        self.deterministic = torch.are_deterministic_algorithms_enabled()

    def restore(self) -> None:
        import torch

        if os.environ != self.env:
            os.environ.clear()
            os.environ.update(self.env)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        if torch.get_default_device() != self.device:
            torch.set_default_device(None)  # workers start without a default-device override
        if torch.are_deterministic_algorithms_enabled() != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)


def _resources() -> tuple[int, int, int]:
    """Threads, open files and resident bytes of this worker (zeros where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), rss
    except OSError:
        return 0, 0, 0


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when the test process dies, even mid-task, so a killed pytest leaves no ranks behind."""
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(parent_pid)
        except OSError:
            os._exit(1)
        select.select([pidfd], [], [])
        os._exit(1)
    while True:  # pragma: no cover - kernels without pidfd
        time.sleep(1.0)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(1)
