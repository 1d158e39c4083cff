"""Name a rank that has gone silent, before the collective timeout ends the job without saying who.

When one rank stops (SIGSTOP, a frozen node, swapping, a hung driver), every other rank blocks in its
next collective until the process group's timeout, then fails with a message that names nobody. A
heartbeat is cheaper to wait for: each rank's background thread bumps a counter in the rendezvous
store every `interval_s`, and reads its peers' counters. A peer whose counter has not moved for
`timeout_s` (measured on the reader's own monotonic clock, so clocks of different hosts never meet)
is reported to `on_silent` with its last reported step; the recipe prints the message and ends the
process so the launcher ends, or restarts, the job.

The signal is liveness, not progress: a stopped process's thread stops with it, while a rank that is
alive but waiting in a deadlocked collective keeps beating; the collective timeout covers that
case. Each rank watches every other rank up to `WATCH_ALL` ranks, and only its two ring neighbours
beyond, so the store sees O(world) reads per interval, not O(world^2).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from meshkit._compat import collectives as compat_collectives

__all__ = ["Heartbeat", "Silent", "collective_timeout_s", "start_for_process_group", "stop_all"]

WATCH_ALL = 32


@dataclass(frozen=True)
class Silent:
    """A rank not heard from for `seconds`; `step` is the last step it reported (-1: none)."""

    rank: int
    seconds: float
    step: int

    def message(self, observer: int) -> str:
        """What the observing rank prints."""
        last = f"its last beat was at step {self.step}" if self.step >= 0 else "it never reported a step"
        return (f"meshkit: heartbeat: rank {self.rank} has not been heard from for {self.seconds:.0f} s ({last}); "
                f"it is stopped, frozen or dead. Rank {observer} ends the job so it can be restarted "
                "(torchrun --max-restarts) from the last checkpoint")


class Heartbeat:
    """A background thread that beats for this rank and watches its peers through a c10d store."""

    def __init__(self, store: dist.Store, rank: int, world: int, *, timeout_s: float,
                 on_silent: Callable[[list[Silent]], None], interval_s: float | None = None):
        """`on_silent` runs on the heartbeat thread, once per newly silent set of ranks."""
        if timeout_s <= 0:
            raise ValueError(f"heartbeat timeout_s={timeout_s}: must be > 0")
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s = timeout_s
        self.interval_s = interval_s if interval_s is not None else max(min(timeout_s / 10, 5.0), 0.05)
        self.on_silent = on_silent
        self.step = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"meshkit-heartbeat-{rank}", daemon=True)
        if world <= WATCH_ALL:
            self.watched = [r for r in range(world) if r != rank]
        else:
            self.watched = sorted({(rank - 1) % world, (rank + 1) % world})

    def start(self) -> Heartbeat:
        """Beat once now (so peers see this rank at once) and start the thread."""
        self._beat(0)
        self._thread.start()
        _RUNNING.add(self)
        return self

    def progress(self, step: int) -> None:
        """Record the step this rank reached (named in a silent rank's message)."""
        self.step = step

    def stop(self) -> None:
        """Stop beating and watching (a finished rank must not be reported by slower peers: call it
        after the last collective).

        Waits for the thread to end: it finishes the store call in hand first (bounded by the store's
        timeout). A thread still inside a store call when the interpreter finalizes is killed there
        by CPython, mid C++ frame, and the process aborts ("terminate called without an active
        exception"), so a heartbeat left running is stopped at exit too (`meshkit.mesh`'s exit hook).
        """
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _beat(self, counter: int) -> None:
        self.store.set(str(self.rank), f"{counter} {self.step}")

    def _run(self) -> None:
        start = time.monotonic()
        last_value: dict[int, bytes | None] = dict.fromkeys(self.watched)
        last_change = dict.fromkeys(self.watched, start)
        reported: set[int] = set()
        counter = 0
        while not self._stop.wait(self.interval_s):
            counter += 1
            try:
                self._beat(counter)
                values = {r: self.store.get(str(r)) if self.store.check([str(r)]) else None for r in self.watched}
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return
            now = time.monotonic()
            silent = []
            for r, value in values.items():
                if value != last_value[r]:
                    last_value[r], last_change[r] = value, now
                    reported.discard(r)
                elif now - last_change[r] > self.timeout_s and r not in reported:
                    reported.add(r)
                    silent.append(Silent(r, now - last_change[r], _step_of(value)))
            if silent:
                self.on_silent(silent)


_RUNNING: weakref.WeakSet[Heartbeat] = weakref.WeakSet()


def stop_all() -> None:
    """Stop every heartbeat of this process (the exit hook calls it before the process groups go)."""
    for beat in list(_RUNNING):
        beat.stop()


def _step_of(value: bytes | None) -> int:
    try:
        return int(value.split()[1]) if value else -1
    except (IndexError, ValueError):
        return -1


def collective_timeout_s() -> float | None:
    """The collective timeout the default process group really has (seconds), for the log line that
    tells a user how long a hung collective can block before the heartbeat or the timeout ends it."""
    return compat_collectives.default_group_timeout_s() if dist.is_initialized() else None


def start_for_process_group(timeout_s: float, on_silent: Callable[[list[Silent]], None], *,
                            namespace: str = "", interval_s: float | None = None) -> Heartbeat | None:
    """A started Heartbeat over the default process group's store, or None on one rank / no store.

    `namespace` separates heartbeats that share one store. A group formed by
    `mesh.ensure_process_group` needs none: under torchrun each attempt's store is a namespace of its
    own (`meshkit.attempt_store`), so a dead attempt's counters never look like silent ranks.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    store = compat_collectives.default_store()
    if store is None:
        return None
    scoped = dist.PrefixStore(f"meshkit-heartbeat/{namespace}/", store)
    return Heartbeat(scoped, dist.get_rank(), dist.get_world_size(), timeout_s=timeout_s, on_silent=on_silent,
                     interval_s=interval_s).start()
