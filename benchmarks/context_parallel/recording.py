"""What one context-parallel rank observes: bytes it sends, the attention kernels it runs, memory.

Collectives are counted by meshkit's own `CommCounter` (every c10d and functional collective, in
the estimator's unit: a collective's full buffer), which sees what autograd issues on its own too
(the backward all-to-all of Ulysses); the bytes that leave a rank follow from that buffer. The
attention kernels that actually run are recorded by a dispatch mode, so the work table checks the
schedule that executes, not the one the planner claims. Private torch APIs are reached only
through meshkit's `_compat` and the op table of `watched_kernels`.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from typing import Any

import torch

from meshkit._compat.dispatch import dispatch_mode_base, op_schema_arguments
from meshkit.comm_counter import CommCounter

Tensor = torch.Tensor
# What a rank sends, as a share of the collective's full buffer (group of n): all of a send, (n-1)/n
# of an all-to-all's input, all-gather's output and reduce-scatter's input; nothing for a receive.
_SENT = {"send": lambda _: (1, 1), "recv": lambda _: (0, 1), "all_to_all": lambda n: (n - 1, n),
         "all_gather": lambda n: (n - 1, n), "reduce_scatter": lambda n: (n - 1, n)}


def watched_kernels() -> dict[Any, str]:
    """The attention kernel overloads recorded; the CPU flash ops are private."""
    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu.default: "fwd_kernel",
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: "bwd_kernel",
        torch.ops.meshkit.attention_block.default: "block_op",
    }


def bound_arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An op call's arguments by schema name: callers pass flags such
    as is_causal positionally or by keyword, and dispatch hands them on as given."""
    schema = op_schema_arguments(func)
    out = {a.name: a.default_value for a in schema if a.has_default_value()}
    out.update(zip((a.name for a in schema), args))
    out.update(kwargs)
    return out


class _Kernels(dispatch_mode_base()):  # type: ignore[misc]
    """Attention-kernel work (q*k score pairs per call, summed over batch and q heads, a causal
    square block counted as its triangle) and the longest [.., S, D] run of any tensor created."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.ops = watched_kernels()
        self.head_dim = head_dim
        self.kernels: dict[str, list[list[int]]] = {"fwd": [], "bwd": []}
        self.max_extent = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        """Run the op, then note the attention kernels' work and the longest K/V run it produced."""
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = self.ops.get(func)
        if kind is not None:
            self._kernel(kind, bound_arguments(func, args, kwargs))
        self._track_extent(out)
        return out

    def _kernel(self, kind: str, a: dict[str, Any]) -> None:
        """Score elements of one attention kernel call (a causal block counts its triangle): the work-balance measure of section 1."""
        if kind == "block_op":  # meshkit::attention_block(q, k, v, causal_kind, ...): Ulysses' differentiable op
            q, k, causal = a["q"], a["k"], a["causal_kind"] == "causal"
        else:
            q, k, causal = a["query"], a["key"], a["is_causal"]
        B, H, Sq, _ = q.shape
        Sk = k.shape[2]
        per_head = Sq * (Sq + 1) // 2 if causal else Sq * Sk
        phase = "bwd" if kind == "bwd_kernel" else "fwd"
        self.kernels[phase].append([per_head, B * H, Sq, Sk, int(bool(causal))])

    def _track_extent(self, out: Any) -> None:
        """The longest K/V run any op produced: what a kind materialises at once, beside its saved bytes."""
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and t.dim() >= 4 and t.shape[-1] == self.head_dim:
                self.max_extent = max(self.max_extent, int(t.shape[-2]))


class Recorder:
    """Bytes each rank sends, collective calls and attention-kernel work, split by phase.

    `with rec:` records into the "fwd" phase; `rec.switch("bwd")` inside it moves on to the backward.
    `group_sizes` maps process-group names to sizes (functional collectives name their group only).
    """

    def __init__(self, group_sizes: dict[str, int], head_dim: int) -> None:
        self.group_sizes = group_sizes
        self.kernel_mode = _Kernels(head_dim)
        self.counters: dict[str, CommCounter] = {}
        self.phase = "fwd"

    def __enter__(self) -> Recorder:
        self.kernel_mode.__enter__()
        self._counter().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._counter().__exit__(*exc)
        self.kernel_mode.__exit__(*exc)

    def switch(self, phase: str) -> None:
        """From now on, record into `phase` (inside the `with`)."""
        self._counter().__exit__(None, None, None)
        self.phase = phase
        self._counter().__enter__()

    def _counter(self) -> CommCounter:
        """The phase's own CommCounter, so forward and backward bytes are reported apart."""
        return self.counters.setdefault(self.phase, CommCounter())

    @property
    def max_extent(self) -> int:
        """The most sequence positions in any [.., S, D] tensor created while recording."""
        return self.kernel_mode.max_extent

    def summary(self) -> dict[str, Any]:
        """Per phase: bytes sent and calls by kind; kernels by phase; collectives not counted as sent."""
        sent: Counter[str] = Counter()
        calls: Counter[str] = Counter()
        other: set[str] = set()
        for phase, counter in self.counters.items():
            for kind, label, nbytes in counter.events:
                if kind not in _SENT:
                    other.add(kind)
                    continue
                calls[f"{phase}:{kind}"] += 1
                n = counter.sizes.get(label) or self.group_sizes.get(label.removeprefix("group:"), 1)
                num, den = _SENT[kind](n)
                sent[phase] += nbytes * num // den
        return {"sent": dict(sent), "calls": dict(calls), "kernels": self.kernel_mode.kernels,
                "other": sorted(other), "max_extent": self.max_extent}


class SavedBytes:
    """Bytes autograd keeps for backward, counted once per storage (views of one buffer share it)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: Tensor) -> Tensor:
        """saved_tensors_hooks pack: note the storage, keep the tensor."""
        s = t.untyped_storage()
        self.storages[s.data_ptr()] = s.nbytes()
        return t

    @staticmethod
    def unpack(t: Tensor) -> Tensor:
        """saved_tensors_hooks unpack: the tensor as it was."""
        return t

    @property
    def total(self) -> int:
        """Bytes over every storage saved."""
        return sum(self.storages.values())


# ------------------------------------------------------------------------------ peak RSS


def _status_kb(field: str) -> int:
    """A field of /proc/self/status in KiB: the kernel's own RSS counters, for a peak torch's CPU allocator does not report."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> int | None:
    """Reset the kernel's high-water mark (clear_refs 5); return current RSS bytes, None if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kb("VmRSS") * 1024
    except (OSError, KeyError):
        return None


def peak_rss_since(base: int | None) -> int | None:
    """The high-water mark's rise above `base` (from `reset_peak_rss`), None where it is unavailable."""
    return None if base is None else _status_kb("VmHWM") * 1024 - base


def return_big_frees_to_os() -> None:
    """Fix glibc's mmap threshold at 128 KiB: big tensors are mmapped and unmapped on free, so RSS peaks
    track tensor lifetimes instead of a heap that only grows (the dynamic threshold would hide them)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        pass
