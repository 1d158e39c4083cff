"""Activation offload (ZeRO-R's CPU checkpointing): what autograd saves inside each decoder block
lives in host memory between the block's forward and its backward.

`Plan(activation_offload=True)` wraps every held block (after activation checkpointing and compile,
inside its FSDP unit) in `OffloadedBlock`, whose forward runs under
`torch.autograd.graph.saved_tensors_hooks`:

- pack: the storage of a tensor autograd saves is copied to host memory as soon as it is saved (on an
  accelerator: into a pinned buffer, on a side stream, the source kept from reuse by `record_stream`),
  and autograd holds the host copy and the tensor's view of it. A storage is copied once however many
  tensors saved of it (the input q, k and v share; the gate and up halves of a packed output), the
  byte count the estimator's trace makes. Parameters (the gathered weights FSDP frees and re-gathers
  itself) stay where they are.
- unpack: in backward, the first tensor a block needs also starts bringing back every tensor of the
  block that ran before it (one block ahead, on the side stream), so the copy overlaps this block's
  backward; a storage not yet prefetched is copied back on the spot. Each saved tensor comes back as
  the same view (dtype, shape, strides, offset) of its storage, so backward's kernels see the layout
  they would have seen without offload and the results are bit-identical.

Under activation checkpointing what autograd saves per block is what the checkpoint keeps: the block
inputs (the selective mode's kept matmul outputs live in checkpointing's own cache, not in autograd's
saved tensors, and stay on the device). Without it, every saved activation moves. Sharded tensors are
copied shard by shard: a DTensor or a float8 training tensor is taken apart into its plain inner
tensors (`_compat.subclasses`), so a sequence-sharded activation is never gathered for the copy.
Pipeline microbatches each get their own copies (a block's forward per microbatch is a fresh set).
On the CPU the same code runs: the host copy is a real copy, so the tests exercise the path.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
from torch import nn

from meshkit._compat.fake import host_allocations, is_fake_world, view_of_storage
from meshkit._compat.subclasses import flatten, is_wrapper_subclass, ready, storage_key, unflatten


class ActivationOffload:
    """What every offloaded block of one parallelized model shares: the copy stream and the byte counts
    (`offloaded_bytes` copied out and `restored_bytes` brought back since `reset_counts`, `host_bytes`
    held now, `peak_host_bytes` the most held at once), which the tests and the estimator compare."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pin = device.type != "cpu"
        self._module = torch.get_device_module(device.type) if self.pin else None
        self.stream = self._module.Stream(device=device) if self.pin else None
        self.host_bytes = 0
        # A fake world (the dry run) stands for an accelerator: backward reads a device copy of each host
        # copy, as it would there, where a CPU run reads the host copy itself.
        self.simulated = is_fake_world()
        self.reset_counts()

    def reset_counts(self) -> None:
        """Zero the counters of bytes copied out and back; the peak restarts from what is held now."""
        self.offloaded_bytes = 0
        self.restored_bytes = 0
        self.peak_host_bytes = self.host_bytes

    def _held(self, nbytes: int) -> None:
        self.host_bytes += nbytes
        self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)

    def _released(self, nbytes: int) -> None:
        self.host_bytes -= nbytes

    def side_stream(self) -> contextlib.AbstractContextManager:
        """Copies issued under it run on the side stream (on the CPU: where they are issued)."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(self._module.current_stream(self.device))  # the saved tensor is computed
        return self._module.stream(self.stream)

    def copy_out(self, t: torch.Tensor, storages: dict[int, _HostStorage]) -> Any:
        """What brings `t` back: its storage's host copy (made once per storage: `storages` maps a storage
        address to its copy) and its view of it; a wrapper subclass is taken apart into its plain tensors."""
        t = ready(t)
        if is_wrapper_subclass(t):
            inner, meta = flatten(t)
            # inner values that are not tensors (torch 2.13's DTensor names its mesh) are kept as they are
            return _Wrapped({name: self.copy_out(v, storages) if isinstance(v, torch.Tensor) else v
                             for name, v in inner.items()}, meta)
        key = storage_key(t)
        host = storages.get(key)
        if host is None:
            host = storages[key] = _HostStorage(t.untyped_storage(), t.device, self)
        return _View(host, t.dtype, t.size(), t.stride(), t.storage_offset())

    def copy_back(self, copied: Any) -> Any:
        """The tensor `copy_out` took apart, rebuilt on its devices from the host copies."""
        if isinstance(copied, _View):
            return copied.to_device()
        if isinstance(copied, _Wrapped):
            return unflatten({name: self.copy_back(v) for name, v in copied.inner.items()}, copied.meta)
        return copied


class _Wrapped:
    """A wrapper subclass's inner values (host copies for its tensors) and what rebuilds it."""

    __slots__ = ("inner", "meta")

    def __init__(self, inner: dict[str, Any], meta: Any):
        self.inner, self.meta = inner, meta


class _HostStorage:
    """The host copy of one storage autograd saved (all of it: the views saved of it share the copy, and
    come back as the same views of one device storage, with their strides, so backward's kernels see
    exactly the layout they would have seen without offload), and, once brought back, its device copy."""

    __slots__ = ("host", "device", "offload", "back", "__weakref__")

    def __init__(self, storage: torch.UntypedStorage, device: torch.device, offload: ActivationOffload):
        on_device = device.type != "cpu"
        nbytes = storage.nbytes()
        with host_allocations():
            self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=offload.pin and on_device)
        source = view_of_storage(storage, torch.uint8, device, like=self.host)
        self.host.copy_(source, non_blocking=offload.pin and on_device)
        if offload.stream is not None and on_device:
            source.record_stream(offload.stream)  # the allocator keeps it until the side stream has copied it
        self.device, self.offload, self.back = device, offload, None
        offload.offloaded_bytes += nbytes
        offload._held(nbytes)
        weakref.finalize(self, offload._released, nbytes)

    def prefetch(self) -> None:
        """Start the copy back to the device (issued on whatever stream is current)."""
        if self.back is None:
            if self.device.type != "cpu":
                self.back = self.host.to(self.device, non_blocking=self.offload.pin)
            else:  # on the CPU the host copy is what backward reads, unless a fake world stands for a device
                self.back = self.host.clone() if self.offload.simulated else self.host
            self.offload.restored_bytes += self.host.numel()

    def to_device(self) -> torch.Tensor:
        if self.back is None:
            self.prefetch()
        elif self.offload.stream is not None and self.device.type != "cpu":
            current = self.offload._module.current_stream(self.device)
            current.wait_stream(self.offload.stream)
            self.back.record_stream(current)
        return self.back


class _View:
    """A saved plain tensor as a view (dtype, shape, strides, offset) of a storage's host copy."""

    __slots__ = ("storage", "dtype", "size", "stride", "offset")

    def __init__(self, storage: _HostStorage, dtype: torch.dtype, size, stride, offset: int):
        self.storage, self.dtype, self.size, self.stride, self.offset = storage, dtype, size, stride, offset

    def to_device(self) -> torch.Tensor:
        back = self.storage.to_device()
        return view_of_storage(back.untyped_storage(), self.dtype, back.device, like=back,
                               view=(self.offset, self.size, self.stride))


class _Packed:
    """What autograd holds for a saved tensor: its host copies (a type of its own, so unpack tells it
    from a parameter packed as itself)."""

    __slots__ = ("copied",)

    def __init__(self, copied: Any):
        self.copied = copied


class _BlockStore:
    """The host copies one forward of one block made, and the store of the block that ran before it
    (which this block's backward prefetches)."""

    def __init__(self, offload: ActivationOffload, block: nn.Module, previous: _BlockStore | None):
        self.offload, self.block = offload, block
        self.previous = weakref.ref(previous) if previous is not None else None
        self.storages: dict[int, _HostStorage] = {}  # storage address -> its host copy
        self.sources: list[torch.Tensor] = []  # held while forward runs, so no storage address is reused
        self.started = False

    def _is_parameter(self, t: torch.Tensor) -> bool:
        key = storage_key(t)
        return any(storage_key(p) == key for p in self.block.parameters())

    @torch.no_grad()
    def pack(self, t: torch.Tensor) -> Any:
        if self._is_parameter(t):
            return t
        with self.offload.side_stream():
            packed = _Packed(self.offload.copy_out(t.detach(), self.storages))
        self.sources.append(t)
        return packed

    @torch.no_grad()
    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        if not self.started:
            self.started = True
            previous = self.previous() if self.previous is not None else None
            if previous is not None:
                previous.prefetch()
        return self.offload.copy_back(packed.copied)

    def prefetch(self) -> None:
        """Start bringing back every copy of this block, on the side stream."""
        with torch.no_grad(), self.offload.side_stream():
            for host in self.storages.values():
                host.prefetch()


class OffloadedBlock(nn.Module):
    """A decoder block whose saved activations live in host memory from its forward to its backward.

    A wrapper (like `CheckpointedBlock`) so FSDP's unit hooks stay outside the region whose saved
    tensors are copied: the gathered weights are parameters, never copied.
    """

    def __init__(self, block: nn.Module, offload: ActivationOffload, previous: OffloadedBlock | None = None):
        super().__init__()
        self.block = block
        self.offload = offload
        # weak references, not attributes holding modules: a module attribute would register a submodule
        self._previous = weakref.ref(previous) if previous is not None else None
        self._last_store = None

    def forward(self, *args, **kwargs):
        """Run the wrapped block with its saved tensors copied to host memory (under grad mode only)."""
        if not torch.is_grad_enabled():
            return self.block(*args, **kwargs)
        before = self._previous() if self._previous is not None else None
        last = before._last_store() if before is not None and before._last_store is not None else None
        store = _BlockStore(self.offload, self.block, last)
        try:
            with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack):
                out = self.block(*args, **kwargs)
        finally:
            store.sources.clear()
        self._last_store = weakref.ref(store)
        return out


def apply_activation_offload(blocks: list[nn.Module], held: list[int], device: torch.device) -> ActivationOffload:
    """Wrap the held blocks in place in `OffloadedBlock`s sharing one `ActivationOffload`; consecutive
    held blocks are linked so backward prefetches the earlier one. Returns the shared object."""
    offload = ActivationOffload(device)
    previous_index, previous = None, None
    for i in held:
        linked = previous if previous_index == i - 1 else None
        blocks[i] = OffloadedBlock(blocks[i], offload, linked)
        previous_index, previous = i, blocks[i]
    return offload
