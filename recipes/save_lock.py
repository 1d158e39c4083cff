"""One run at a time per save directory: a lock file taken at pre-flight by rank 0.

Two runs saving into one `save_dir` both passed the pre-flight, and the second died at its first save
after training (or, worse, retention of one deleted the other's checkpoints). The lock is
`<save_dir>/.meshkit-lock`, created with O_CREAT | O_EXCL, so of two runs starting at once exactly one
creates it. It names its holder: the run id (filled in once the checkpoint policy has chosen it),
host, pid, start time, torchrun job and command line. A second run is refused at pre-flight with
that description.

A lock whose holder is gone is stale and taken over (with a note):
- the holder ran on this host and its process no longer exists (or the pid now belongs to a process
  started later: pid reuse);
- the holder was an earlier attempt of this same torchrun job (a restart: torchrun stops every
  worker of an attempt before it starts the next);
- the holder ran on another host and has not refreshed the lock for `STALE_S`: a holder's thread
  touches the file every `REFRESH_S` while it runs.
Taking over renames the stale file away first (one rename wins), so two runs finding the same stale
lock still end with one holder. A run that ends, however it ends short of SIGKILL, removes its lock.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

LOCK = ".meshkit-lock"
REFRESH_S = 60.0
STALE_S = 600.0

_held: dict[str, SaveDirLock] = {}  # lock path -> the lock this process holds


class SaveDirLock:
    """This process's lock on one save directory (see the module docstring); `acquire` takes it."""

    def __init__(self, path: Path, record: dict[str, Any]):
        self.path, self.record = path, record
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, name="meshkit-save-lock", daemon=True)

    @classmethod
    def acquire(cls, save_dir: str | os.PathLike, env: Mapping[str, str] | None = None) -> tuple[SaveDirLock | None, str]:
        """(the lock, a note to print or "") when this process now holds it; (None, why) when another run does."""
        path = Path(save_dir) / LOCK
        record = _describe(os.environ if env is None else env)
        # The record is written whole before the lock exists (a hard link of it, which fails if the lock
        # exists): a lock created empty and filled after would read as "unreadable" to a run racing it,
        # which would take it over as stale, and both would hold the directory.
        written = path.with_name(f"{LOCK}.{record['token']}.new")
        written.write_text(json.dumps(record, indent=1))
        note = ""
        try:
            for _ in range(3):  # create; or find it stale, rename it away and create again
                try:
                    _create(path, written, record)
                except FileExistsError:
                    holder = _read(path)
                    why_stale = stale_reason(holder, record, _age_s(path))
                    if why_stale is None:
                        return None, _refusal(save_dir, path, holder)
                    if not _take_over(path, holder):
                        continue  # another run took it over first: look again
                    note = f"took over the stale lock {path} ({why_stale}: {_holder(holder)})"
                    continue
                lock = cls(path, record)
                lock._thread.start()
                _held[str(path)] = lock
                return lock, note
            return None, _refusal(save_dir, path, _read(path))
        finally:
            written.unlink(missing_ok=True)

    def set_run_id(self, run_id: str) -> None:
        """Record the run id once the checkpoint policy has chosen it (replaces the file atomically)."""
        self.record = {**self.record, "run_id": run_id}
        tmp = self.path.with_name(f"{LOCK}.{self.record['token']}.tmp")
        tmp.write_text(json.dumps(self.record, indent=1))
        os.replace(tmp, self.path)

    def release(self) -> None:
        """Remove the lock if it is still this process's (a run that took it over stale keeps it)."""
        self._stop.set()
        _held.pop(str(self.path), None)
        if _read(self.path).get("token") == self.record["token"]:
            self.path.unlink(missing_ok=True)

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError:
                return


def _create(path: Path, written: Path, record: dict[str, Any]) -> None:
    """Create the lock `path` holding `record`, or raise FileExistsError: a hard link of the file already
    written, else (a file system without hard links) an exclusive create, then the write."""
    try:
        os.link(written, path)
        return
    except FileExistsError:
        raise
    except OSError:
        pass
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f, indent=1)


def holder_problem(save_dir: str | os.PathLike, env: Mapping[str, str] | None = None) -> str | None:
    """The refusal `acquire` would give (a live run holds the directory), without taking the lock."""
    path = Path(save_dir) / LOCK
    if not path.exists() or str(path) in _held:
        return None
    holder = _read(path)
    if stale_reason(holder, _describe(os.environ if env is None else env), _age_s(path)) is not None:
        return None
    return _refusal(save_dir, path, holder)


def held(save_dir: str | os.PathLike) -> SaveDirLock | None:
    """The lock this process holds on `save_dir`, if any."""
    return _held.get(str(Path(save_dir) / LOCK))


def stale_reason(holder: dict[str, Any], me: dict[str, Any], age_s: float) -> str | None:
    """Why the holder described by `holder` is gone, or None while it may still run."""
    if not holder:
        return "unreadable (a holder killed while writing it)"
    if me.get("job") and holder.get("job") == me["job"]:
        return "an earlier attempt of this torchrun job"
    if holder.get("host") == me["host"]:
        pid = holder.get("pid")
        if not isinstance(pid, int) or not _alive(pid, holder.get("proc_start")):
            return "its process has ended"
        return None
    if age_s > STALE_S:
        return f"not refreshed for {age_s:.0f} s"
    return None


def _describe(env: Mapping[str, str]) -> dict[str, Any]:
    job = None
    if "TORCHELASTIC_RUN_ID" in env:
        run = env["TORCHELASTIC_RUN_ID"]  # "none" under the static rendezvous: the store's address tells jobs apart
        job = run if run != "none" else f"{run}@{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
    return {"token": uuid.uuid4().hex, "run_id": None, "host": socket.gethostname(), "pid": os.getpid(),
            "proc_start": _proc_start(os.getpid()), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "job": job, "command": " ".join(sys.argv)[:300]}


def _refusal(save_dir: str | os.PathLike, path: Path, holder: dict[str, Any]) -> str:
    return (f"[train] save_dir={str(save_dir)!r} is in use by another run ({_holder(holder)}); two runs saving into "
            "one directory overwrite and prune each other's checkpoints; fix: --save-dir NEW, or wait for that run "
            f"to end; if it is dead on another host, delete {path}")

def _holder(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    return (f"run {holder.get('run_id') or '(id not chosen yet)'}, pid {holder.get('pid')} on {holder.get('host')}, "
            f"started {holder.get('started')}, command: {holder.get('command')}")


def _read(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _take_over(path: Path, holder: dict[str, Any]) -> bool:
    """Rename the stale lock away; False when it was no longer the one judged stale (someone was faster)."""
    aside = path.with_name(f"{LOCK}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if _read(aside) != holder:  # a fresh lock of a faster run: put it back (unless yet another exists)
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True


def _proc_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, proc_start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    return proc_start is None or _proc_start(pid) in (None, proc_start)
