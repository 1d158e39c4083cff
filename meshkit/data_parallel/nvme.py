"""NVMe offload (ZeRO-Infinity's optimizer tier): `Plan(offload="nvme", offload_dir=DIR)`.

The placement is `offload="optimizer"`'s (FSDP2's `CPUOffloadPolicy`: the sharded fp32 parameters, the
master weights, and their gradient shards in host memory, the optimizer step on the CPU), with one tier
more: the optimizer state lives in one file per rank under `offload_dir`, and host memory holds only the
state of the FSDP units being stepped. The user's torch optimizer is unchanged: built on
`pm.parameters()`, stepped with `opt.step()`. A step pre-hook (`torch.optim`'s global one; it acts only
on optimizers holding this model's parameters) runs the step unit by unit:

    read unit k's state from the file (already under way: started while unit k-1 stepped)
    start reading unit k+1's state;  step unit k (the optimizer, its param groups cut to unit k)
    start writing unit k's state back;  free it once written

so reads and writes overlap the CPU steps and host memory holds about two units' state whatever the
model size. The optimizer's real `step` then finds no gradient left and does nothing. Each state
tensor keeps its identity: between steps its storage is resized to zero and refilled from the file on
demand (`optimizer.state` becomes `PagedState`, which pages a parameter's state in when read), so
`meshkit.state.checkpoint` saves and loads it as any optimizer state: the files are a cache, never the
checkpoint, and a checkpoint resumes under any other plan. Exact against `offload="optimizer"`: the
same elementwise updates on the same values, a unit at a time.

Why only the optimizer state: the fp32 shards are FSDP2's all-gather source in every forward and
backward, and the gradient shards feed `clip_grad_norm_` and accumulation windows, so both stay in host
memory (8 bytes per parameter over the shard degree); Adam's state is the other 8, the part that grows
past a host.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim.optimizer import register_optimizer_step_pre_hook

from meshkit._compat.fake import is_fake_world
from meshkit.local_tensor import local_tensor
from meshkit.step.consensus import raise_if_any

STATE_BYTES_PER_PARAM = 8  # what the directory is checked and reserved for: two fp32 moments (Adam)
_STORES: weakref.WeakSet = weakref.WeakSet()
_HOOK: list = []  # the one global step pre-hook, registered with the first store


def dir_problem(offload_dir: str, need_bytes: int | None = None) -> str | None:
    """Why `offload_dir` cannot hold this rank's file (missing, not a directory, not writable, too
    small for `need_bytes`), with the fix, or None."""
    where = f"offload_dir={offload_dir!r}"
    if not os.path.exists(offload_dir):
        return f"{where}: does not exist; fix: create it (mkdir -p) on a fast local disk, or pass another"
    if not os.path.isdir(offload_dir):
        return f"{where}: is not a directory; fix: pass a directory (one file per rank is written inside it)"
    try:
        with tempfile.TemporaryFile(dir=offload_dir):
            pass
    except OSError as e:
        return f"{where}: cannot write there ({e.strerror}); fix: a directory this process may write to"
    if need_bytes is not None:
        free = os.statvfs(offload_dir).f_bavail * os.statvfs(offload_dir).f_frsize
        if free < need_bytes:
            return (f"{where}: this rank's optimizer state needs {need_bytes:,} bytes and the disk has {free:,} free; "
                    f"fix: free space, another directory, or more data-parallel ranks to shard the state over")
    return None


class PagedState(collections.defaultdict):
    """`optimizer.state` for a model under NVMe offload: reading a parameter's state brings it back
    from the file first (what `meshkit.state.checkpoint` and `Optimizer.state_dict` read stays true)."""

    def __init__(self, store: NVMeStore, entries: dict):
        super().__init__(dict, entries)
        self._store = store

    def __getitem__(self, param):
        self._store.page_in([param])
        return super().__getitem__(param)

    def get(self, param, default=None):
        """The state of `param` (paged in), or `default` if it has none."""
        if param not in self:
            return default
        return self[param]

    def items(self):
        """Every entry, paged in."""
        self._store.page_in(list(self.keys()))
        return super().items()

    def values(self):
        """Every state dict, paged in."""
        self._store.page_in(list(self.keys()))
        return super().values()


class NVMeStore:
    """One rank's file of optimizer state and the FSDP units whose state it holds."""

    def __init__(self, units: list[list[nn.Parameter]], path: str, reserve_bytes: int):
        self.units = units
        self.path = path
        self.unit_of = {id(p): k for k, unit in enumerate(units) for p in unit}
        self.params = {id(p): p for unit in units for p in unit}
        self.regions: dict[tuple[int, str], int] = {}  # (id(param), key) -> byte offset in the file
        self.size = 0
        self.resident: set[int] = set()  # ids of parameters whose state is in memory now
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        weakref.finalize(self, _close_and_remove, self.fd, path)
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshkit-nvme")
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self.inside_step = False
        self.bytes_read = 0
        self.bytes_written = 0
        self.peak_resident_bytes = 0
        self.reserved = 0
        # The dry run's fake world: the state's storages grow and shrink as they would (its memory is
        # measured), but there are no values to move and no file to fill.
        self.simulated = is_fake_world()
        self._reserve(reserve_bytes)

    # ----------------------------------------------------------------- files
    def _paged(self, optimizer, param) -> dict[str, torch.Tensor]:
        state = dict.get(optimizer.state, param, {})
        return {k: local_tensor(v) for k, v in state.items() if isinstance(v, torch.Tensor) and v.numel() > 1}

    def _read(self, items: list[tuple[int, str, torch.Tensor]]) -> None:
        for pid, key, t in items:
            t.untyped_storage().resize_(t.numel() * t.element_size())
            if self.simulated:
                continue
            view = _bytes_of(t)
            got = os.preadv(self.fd, [view], self.regions[(pid, key)])
            if got != len(view):
                raise OSError(f"{self.path}: short read ({got} of {len(view)} bytes)")
            self.bytes_read += got

    def _write(self, items: list[tuple[int, str, torch.Tensor]]) -> None:
        if self.simulated:
            return
        for pid, key, t in items:
            data = _bytes_of(t)
            written = os.pwrite(self.fd, data, self.regions[(pid, key)])
            if written != len(data):
                raise OSError(f"{self.path}: short write ({written} of {len(data)} bytes)")
            self.bytes_written += written

    def _items(self, params: list[nn.Parameter], evicted_only: bool) -> list[tuple[int, str, torch.Tensor]]:
        out = []
        for optimizer in list(self.optimizers):
            for p in params:
                if evicted_only and id(p) in self.resident:
                    continue
                for key, t in self._paged(optimizer, p).items():
                    if (id(p), key) in self.regions:
                        out.append((id(p), key, t))
        return out

    def _allocate(self, items: list[tuple[int, str, torch.Tensor]]) -> None:
        for pid, key, t in items:
            if (pid, key) not in self.regions:
                self.regions[(pid, key)] = self.size
                self.size += t.numel() * t.element_size()
        self._reserve(self.size)

    def page_in(self, params: list) -> None:
        """Bring the state of `params` back into memory (synchronously) if it was written out."""
        wanted = [p for p in params if id(p) in self.unit_of and id(p) not in self.resident]
        if wanted:
            self._read(self._items(wanted, evicted_only=True))
            self.resident.update(id(p) for p in wanted)

    def _evict(self, params: list[nn.Parameter], items: list[tuple[int, str, torch.Tensor]]) -> None:
        for _, _, t in items:
            t.untyped_storage().resize_(0)
        self.resident.difference_update(id(p) for p in params)

    # ------------------------------------------------------------------ step
    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Step `optimizer` unit by unit, streaming each unit's state in and out (see the module docstring)."""
        if not isinstance(optimizer.state, PagedState):
            optimizer.state = PagedState(self, dict(optimizer.state))
        self.optimizers.add(optimizer)
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        units = [[p for p in unit if id(p) in held] for unit in self.units]
        units = [u for u in units if u]
        originals = [g["params"] for g in optimizer.param_groups]
        reading: Future | None = self._start_read(units[0]) if units else None
        writing: tuple[Future, list, list] | None = None
        try:
            for k, unit in enumerate(units):
                reading.result()
                self.resident.update(id(p) for p in unit)
                if writing is not None:
                    self._finish_write(writing)
                    writing = None
                reading = self._start_read(units[k + 1]) if k + 1 < len(units) else None
                self._step_unit(optimizer, originals, unit)
                items = self._items(unit, evicted_only=False) + self._new_items(optimizer, unit)
                self._allocate(items)
                self.peak_resident_bytes = max(self.peak_resident_bytes, self._resident_bytes(optimizer))
                writing = (self.io.submit(self._write, items), unit, items)
        finally:
            for group, params in zip(optimizer.param_groups, originals):
                group["params"] = params
            if writing is not None:
                self._finish_write(writing)
            if reading is not None:
                reading.result()

    def _start_read(self, unit: list[nn.Parameter]) -> Future:
        return self.io.submit(self._read, self._items(unit, evicted_only=True))

    def _finish_write(self, writing: tuple[Future, list, list]) -> None:
        future, unit, items = writing
        future.result()
        self._evict(unit, items)

    def _new_items(self, optimizer, unit) -> list[tuple[int, str, torch.Tensor]]:
        return [(id(p), key, t) for p in unit for key, t in self._paged(optimizer, p).items()
                if (id(p), key) not in self.regions]

    def _resident_bytes(self, optimizer) -> int:
        return sum(t.untyped_storage().nbytes() for pid in self.resident
                   for t in self._paged(optimizer, self.params[pid]).values())

    def _reserve(self, size: int) -> None:
        """Grow the file to `size` bytes with its blocks allocated, so a full disk fails here, not mid-write."""
        if size <= self.reserved or self.simulated:
            return
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as e:
            raise ValueError(
                f"offload_dir={os.path.dirname(self.path)!r}: cannot reserve {size:,} bytes for this rank's optimizer "
                f"state ({e.strerror}); fix: free space, another directory, or more data-parallel ranks to shard the "
                "state over") from None
        self.reserved = size

    def _step_unit(self, optimizer, originals: list[list], unit: list[nn.Parameter]) -> None:
        mine = {id(p) for p in unit}
        for group, params in zip(optimizer.param_groups, originals):
            group["params"] = [p for p in params if id(p) in mine]
        self.inside_step = True
        try:
            optimizer.step()
        finally:
            self.inside_step = False
        for p in unit:
            p.grad = None  # stepped: the optimizer's own step, after this hook, skips it


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's values, for os.preadv / os.pwrite. Not through
    numpy: exporting a tensor to numpy marks its storage non-resizable for good, and paging out resizes it."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"NVMe offload pages contiguous host tensors only, got {t.device} {tuple(t.stride())}")
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def _close_and_remove(fd: int, path: str) -> None:
    os.close(fd)
    if os.path.exists(path):
        os.remove(path)


def _step_pre_hook(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for store in list(_STORES):
        if store.inside_step:
            return
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if held & store.unit_of.keys():
            store.step(optimizer)


def unit_parameters(parts: list[nn.Module]) -> list[list[nn.Parameter]]:
    """Each FSDP unit's own parameters (a unit's, not its nested units'), in module order."""
    units = []
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                nested = {id(p) for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule)
                          for p in sub.parameters()}
                own = [p for p in module.parameters() if id(p) not in nested]
                if own:
                    units.append(own)
    return units


def apply_nvme_offload(parts: list[nn.Module], offload_dir: str, device: torch.device) -> NVMeStore:
    """Open this rank's state file under `offload_dir` for the FSDP units of `parts`, reserving room for an
    Adam-like state; later steps of any optimizer holding these parameters stream their state through it.
    A directory that cannot hold some rank's file is a ValueError on every rank (one small all-reduce)."""
    units = unit_parameters(parts)
    need = STATE_BYTES_PER_PARAM * sum(local_tensor(p).numel() for unit in units for p in unit)
    rank = dist.get_rank() if dist.is_initialized() else 0
    path = os.path.join(offload_dir, f"meshkit-optimizer-state-rank{rank:05d}.bin")
    problem, store = dir_problem(offload_dir, None if is_fake_world() else need), None
    if problem is None:
        try:
            store = NVMeStore(units, path, need)
        except ValueError as e:
            problem = str(e)
    raise_if_any(problem, device=device)
    _STORES.add(store)
    for part in parts:
        part._meshkit_nvme_store = store  # the model keeps its store alive; the registry holds it weakly
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_step_pre_hook))
        _return_freed_state_to_the_os()
    return store


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _return_freed_state_to_the_os() -> None:
    """Make glibc give a unit's state back to the OS when its storage is resized to zero. Its mmap
    threshold otherwise grows to the largest block freed (up to 32 MiB), after which state buffers come
    from the heap and stay resident: measured on a 32M-parameter model, host memory kept nearly all of
    AdamW's moments (RssAnon 973 vs 1027 MiB under host offload). A fixed 1 MiB threshold, which also
    stops the growth, maps each larger buffer on its own (peak growth 203 vs 406 MiB)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    libc.mallopt(_M_MMAP_THRESHOLD, 1 << 20)
