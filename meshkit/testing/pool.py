"""A pool of gloo worker processes that stays up for a whole pytest session.

Starting a torch process costs seconds on a 2-core machine, so one pool per world size runs every
multi-rank test: the test's module-level function is pickled by reference, run on every rank, and the
return values (or each rank's exception and traceback) come back to the test process.

Recovery is by restart, never by repair. After any failure (an exception, a dead worker, a rank that
does not answer) the ranks may disagree about which collectives ran, and DTensor's sharding cache
keeps meshes that point at process groups by name, so neither re-using nor re-creating the process
group in place is safe. Workers are forked from a fork server that has already imported torch, so a
restart costs well under a second and the heavy imports happen once per session.

Workers are also recycled when they grow past a thread, file or memory budget: every `init_device_mesh`
leaves its gloo groups (with their threads and sockets) alive until the process ends, and hundreds of
tests would otherwise exhaust the machine.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, BinaryIO

from meshkit._compat import float8 as quiet_torchao
from meshkit.testing import worker as worker_module
from meshkit.testing.worker import WorkerSpec, worker_main

__all__ = ["Outcome", "RankFailure", "RankTimeout", "WorkerPool"]

#: `Outcome.exc_type` of a rank that did not answer in time, and of a worker process that died.
NO_ANSWER = "RankTimeout"
DIED = "WorkerDied"

# Per-worker budgets past which the pool is restarted before the next run (see module docstring). The
# thread budget is low on purpose: every gloo group keeps transport threads that wake while idle, so
# idle 8-rank pools of ~300 threads per rank kept two cores busy between tests; a restart costs ~1 s.
MAX_WORKER_THREADS = 96
MAX_WORKER_FDS = 2048
MAX_WORKER_RSS = 2 << 30

_OUTPUT_TAIL = 4000  # characters of a dead or hung rank's output quoted in the error message
_STACK_DUMP_WAIT = 0.5  # seconds for faulthandler to write the stacks of hung ranks


@dataclass(frozen=True)
class Outcome:
    """What one rank did with one task.

    `value` is the return value when `ok`, else the rank's exception object when it survived
    pickling (so tests can use `isinstance`), else None. `exc_type` is the exception's class name, or
    `NO_ANSWER` / `DIED` for ranks that never replied. `output` is what the rank printed during the
    task (for a hung rank it ends with faulthandler's dump of its stack).
    """

    rank: int
    ok: bool
    value: Any = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    output: str = ""
    finished_at: float = field(default=0.0, repr=False, compare=False)


class RankFailure(RuntimeError):
    """A run in which some rank raised, died or did not answer; the message carries every traceback."""

    def __init__(self, message: str, outcomes: Sequence[Outcome]):
        super().__init__(message)
        self.outcomes = list(outcomes)
        failed = [o for o in outcomes if not o.ok]
        #: Failed ranks, earliest failure first (the later ones are usually its consequence).
        self.ranks = [o.rank for o in sorted(failed, key=lambda o: o.finished_at)]

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.outcomes)


class RankTimeout(RankFailure):
    """A run in which no rank failed, but some did not answer within the timeout."""


@dataclass
class _Worker:
    rank: int
    proc: BaseProcess
    conn: Connection
    log: BinaryIO


_LIVE: set[WorkerPool] = set()


@atexit.register
def _close_all() -> None:
    for pool in list(_LIVE):
        pool.close()


class WorkerPool:
    """`world_size` gloo ranks that run one function at a time, started on first use.

    Not thread-safe: one `run` at a time. `run` and `run_raw` take `timeout` themselves, so the
    function cannot receive a keyword argument of that name.
    """

    def __init__(
        self,
        world_size: int,
        timeout: float = 120.0,
        *,
        grace: float = 5.0,
        start_timeout: float = 180.0,
        preload: Sequence[str] = ("torch", "torch.distributed"),
        start_method: str = "forkserver",
    ):
        """`grace`: how long the other ranks get to answer once one rank failed (they are usually
        blocked in a collective with it). `preload`: modules the fork server imports once for all
        workers; only the first pool of the process decides, and the fork server ignores only
        ImportError, so list stable third-party modules, not code under development."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self.grace = grace
        self.start_timeout = start_timeout
        self.preload = tuple(preload)
        self.start_method = start_method
        self._workers: list[_Worker] = []
        self._store: Any = None
        self._logdir: str | None = None
        self._task_id = 0
        self._recycle = False

    def __repr__(self) -> str:
        return f"WorkerPool(world_size={self.world_size}, running={bool(self._workers)})"

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """Worker process ids by rank; empty while the pool is down. Tests use it to see restarts."""
        return [w.proc.pid for w in self._workers]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """`fn(*args, **kwargs)` on every rank; the return values by rank, or RankFailure/RankTimeout."""
        outcomes = self.run_raw(fn, *args, timeout=timeout, **kwargs)
        failed = [o for o in outcomes if not o.ok]
        if not failed:
            return [o.value for o in outcomes]
        message = _report(outcomes, _name(fn), self.world_size)
        if all(o.exc_type == NO_ANSWER for o in failed):
            raise RankTimeout(message, outcomes)
        raise RankFailure(message, outcomes)

    def run_raw(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Outcome]:
        """Like `run`, but every rank's Outcome, whatever happened; raises only for the pool itself.

        Any failed outcome restarts the pool, so the next run starts from clean processes.
        """
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise TypeError(
                f"cannot send {_name(fn)} and its arguments to the workers ({exc}); the function must be "
                f"defined at module level and the arguments must pickle"
            ) from exc
        self._ensure_started()
        self._task_id += 1
        try:
            outcomes = self._execute(payload, self.timeout if timeout is None else timeout)
        except BaseException:
            self._kill()
            raise
        if self._recycle or not all(o.ok for o in outcomes):
            self._kill()
        return outcomes

    def close(self) -> None:
        """Kill and reap every worker. The pool restarts if used again."""
        self._kill()
        _LIVE.discard(self)

    # -- parent side ---------------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._workers and all(w.proc.is_alive() for w in self._workers):
            return
        self._kill()
        _LIVE.add(self)
        try:
            self._start()
        except BaseException:
            self._kill()
            raise

    def _start(self) -> None:
        import torch.distributed as dist

        ctx = mp.get_context(self.start_method)
        if self.start_method == "forkserver":
            # The worker module too: it imports the whole meshkit package, which the test process has
            # just imported without error, so the fork server cannot trip over it. The torchao log filter
            # first, before a preloaded transformers modeling module imports torchao (`_compat.float8`).
            ctx.set_forkserver_preload([quiet_torchao.__name__, *self.preload, worker_module.__name__])
        # The test process hosts the rendezvous store on a port the kernel picked, so concurrent
        # sessions on one machine never race for a port.
        self._store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True,
                                    wait_for_workers=False, timeout=timedelta(seconds=self.start_timeout))
        self._logdir = tempfile.mkdtemp(prefix=f"meshkit-pool{self.world_size}-")
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        for rank in range(self.world_size):
            log_path = os.path.join(self._logdir, f"rank{rank}.log")
            open(log_path, "wb").close()
            spec = WorkerSpec(rank, self.world_size, self._store.port, log_path, os.getpid(), env,
                               self.start_timeout)
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(spec, child_conn), name=f"meshkit-rank{rank}")
            proc.start()
            child_conn.close()
            self._workers.append(_Worker(rank, proc, parent_conn, open(log_path, "rb")))  # noqa: SIM115
        self._recycle = False
        deadline = time.monotonic() + self.start_timeout
        pending = {w.rank: w for w in self._workers}
        while pending:
            left = deadline - time.monotonic()
            ready = wait([w.conn for w in pending.values()] + [w.proc.sentinel for w in pending.values()],
                         max(left, 0))
            if not ready:
                break
            for rank, w in list(pending.items()):
                if w.conn in ready or w.proc.sentinel in ready:
                    try:
                        status, detail = w.conn.recv()
                    except (EOFError, OSError):
                        status, detail = "failed", f"process exited with {_exit_text(w.proc)}"
                    if status != "ready":
                        raise RuntimeError(f"rank {rank} of a {self.world_size}-rank pool failed to start: "
                                           f"{detail}\n{_tail(self._read_output(w))}")
                    del pending[rank]
        if pending:
            raise RuntimeError(f"ranks {sorted(pending)} of a {self.world_size}-rank pool did not start within "
                               f"{self.start_timeout:g} s")
        # Every rank holds its log open now; unlinking it leaves nothing behind even if pytest is killed.
        shutil.rmtree(self._logdir, ignore_errors=True)
        self._logdir = None

    def _execute(self, payload: bytes, timeout: float) -> list[Outcome]:
        start = time.monotonic()
        deadline, grace_end = start + timeout, float("inf")
        outcomes: dict[int, Outcome] = {}
        for w in self._workers:
            try:
                w.conn.send((self._task_id, payload))
            except OSError:
                outcomes[w.rank] = self._death(w)
                grace_end = start + self.grace
        pending = {w.rank: w for w in self._workers if w.rank not in outcomes}
        while pending and time.monotonic() < min(deadline, grace_end):
            waitables = [w.conn for w in pending.values()] + [w.proc.sentinel for w in pending.values()]
            ready = wait(waitables, max(min(deadline, grace_end) - time.monotonic(), 0))
            for rank, w in list(pending.items()):
                if w.conn in ready or w.proc.sentinel in ready:
                    outcome = self._receive(w)
                    outcomes[rank] = outcome
                    del pending[rank]
                    if not outcome.ok:
                        grace_end = min(grace_end, time.monotonic() + self.grace)
        if pending:
            self._dump_stacks(pending.values())
            if grace_end < deadline:
                first = min((o for o in outcomes.values() if not o.ok), key=lambda o: o.finished_at)
                why = (f"no answer {self.grace:g} s after rank {first.rank} failed "
                       f"(probably blocked in a collective with it)")
            else:
                why = f"no answer within the {timeout:g} s timeout"
            for rank in pending:
                outcomes[rank] = Outcome(rank, False, exc_type=NO_ANSWER, message=why, finished_at=time.time())
        result = []
        for w in self._workers:
            output = self._read_output(w)
            if output:
                sys.stderr.write("".join(f"[rank {w.rank}] {line}\n" for line in output.splitlines()))
            result.append(replace(outcomes[w.rank], output=output))
        return result

    def _receive(self, w: _Worker) -> Outcome:
        try:
            task_id, kind, data, resources = w.conn.recv()
        except (EOFError, OSError):
            return self._death(w)
        if task_id != self._task_id:
            raise RuntimeError(f"rank {w.rank} answered task {task_id} during task {self._task_id}")
        if any(used > limit for used, limit in zip(resources, (MAX_WORKER_THREADS, MAX_WORKER_FDS, MAX_WORKER_RSS))):
            self._recycle = True
        now = time.time()
        if kind == "ok":
            try:
                return Outcome(w.rank, True, pickle.loads(data), finished_at=now)
            except Exception as exc:
                return Outcome(w.rank, False, exc_type=type(exc).__name__, finished_at=now,
                               message=f"the return value could not be unpickled in the test process: {exc}")
        try:
            exc_obj = pickle.loads(data["pickled"]) if data["pickled"] is not None else None
        except Exception:
            exc_obj = None
        return Outcome(w.rank, False, exc_obj, data["exc_type"], data["message"], data["traceback"],
                       finished_at=data["at"])

    def _death(self, w: _Worker) -> Outcome:
        w.proc.join(1.0)
        return Outcome(w.rank, False, exc_type=DIED, finished_at=time.time(),
                       message=f"worker process died ({_exit_text(w.proc)})")

    def _dump_stacks(self, workers: Iterable[_Worker]) -> None:
        """Ask hung ranks for their Python stacks (faulthandler on SIGUSR1) before they are killed."""
        if not hasattr(signal, "SIGUSR1"):
            return
        for w in workers:
            try:
                os.kill(w.proc.pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(_STACK_DUMP_WAIT)

    def _read_output(self, w: _Worker) -> str:
        return w.log.read().decode("utf-8", errors="replace")

    def _kill(self) -> None:
        workers, self._workers = self._workers, []
        for w in workers:
            if w.proc.is_alive():
                w.proc.kill()
        for w in workers:
            w.proc.join(10.0)
            w.conn.close()
            w.log.close()
            if w.proc.exitcode is not None:
                w.proc.close()
        self._store = None
        if self._logdir is not None:
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = None


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _exit_text(proc: BaseProcess) -> str:
    code = proc.exitcode
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _tail(text: str) -> str:
    return text if len(text) <= _OUTPUT_TAIL else "...\n" + text[-_OUTPUT_TAIL:]


def _report(outcomes: Sequence[Outcome], fn_name: str, world_size: int) -> str:
    """One readable message: earliest failure first, ranks with identical failures grouped."""
    failed = sorted((o for o in outcomes if not o.ok), key=lambda o: o.finished_at)
    first = failed[0]
    headline = (first.message.splitlines() or [""])[0]
    lines = [f"{fn_name}: rank {first.rank} of {world_size}: {first.exc_type}: {headline}"]
    later = [o.rank for o in failed[1:]]
    if later:
        lines[0] += f" (then ranks {', '.join(map(str, later))} failed too)"
    # With 16 ranks most failures repeat; ranks whose failures differ only in numbers (ranks, ports,
    # shapes) share one section showing the earliest of them. Every rank's own text is in `outcomes`.
    groups: dict[tuple[str, str, str], list[Outcome]] = {}
    for o in failed:
        key = (o.exc_type, o.message, o.traceback if o.exc_type not in (NO_ANSWER, DIED) else o.output)
        groups.setdefault(tuple(re.sub(r"\d+", "#", part) for part in key), []).append(o)
    for group in groups.values():
        o = group[0]
        ranks = ", ".join(str(g.rank) for g in group)
        shown = f" (rank {o.rank} shown, the others differ only in numbers)" if len(group) > 1 else ""
        lines.append(f"\n=== rank{'s' if len(group) > 1 else ''} {ranks}{shown}: {o.exc_type}: {o.message}")
        if o.traceback:
            lines.append(o.traceback.rstrip())
        if o.exc_type in (NO_ANSWER, DIED) and o.output:
            lines.append(f"--- output of rank {o.rank}:\n{_tail(o.output).rstrip()}")
    return "\n".join(lines)
