"""Dispatch modes, fake tensors, storages and private ops: what meshkit's counters, estimators and
kernels see below the module level.

Private or version-gated torch APIs (see `meshkit._compat`).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes


def dispatch_mode_base() -> type:
    """torch's TorchDispatchMode (a private module through 2.13).

    A dispatch mode sees the c10d ops that `torch.distributed.*` calls (FSDP2) and the functional
    collectives DTensor issues, from C++ as well as Python, which no public hook does; meshkit's
    communication counter and activation-memory measurement are built on it.
    """

    return TorchDispatchMode


def outside_dispatch_modes():
    """A context in which no active TorchDispatchMode sees the ops that run (torch's private
    `_disable_current_modes`).

    For work that is not part of the model's computation but may first run inside it, such as a
    one-off kernel probe: selective activation checkpointing caches op outputs by call order, so an
    op the forward runs and its recompute does not would hand every later output of that op to the
    wrong call; FLOP and communication counters would count it too.
    """

    return _disable_current_modes()


def fake_tensor_mode():
    """`FakeTensorMode` (private in 2.11-2.13): shapes and dtypes, no memory, for activation estimates.

    Non-fake inputs are allowed so that a module built on the meta device can be `to_empty`-ed into
    fake CPU tensors (fake CPU, not meta, so SDPA dispatches to the flash kernel it really uses
    instead of the math fallback that would save the s x s scores).
    """

    return FakeTensorMode(allow_non_fake_inputs=True)


def op_schema_arguments(op):
    """An op overload's schema arguments (`OpOverload._schema`): to read flags passed either way."""
    return op._schema.arguments


def sdpa_op(name: str):
    """A private aten attention op by name (`_scaled_dot_product_flash_attention_for_cpu`, its
    `_backward`, and the CUDA flash / efficient / cuDNN variants with theirs).

    Context-parallel attention needs each block's log-sum-exp and a backward that takes the final
    output and LSE; only these private ops expose both.
    """

    return getattr(torch.ops.aten, name).default


def grouped_mm_op():
    """`torch._grouped_mm`, or None where this torch lacks it: the only fused grouped GEMM torch ships."""

    return getattr(torch, "_grouped_mm", None)


def is_compiled(module) -> bool:
    """Whether `module` runs as one compiled graph (`module.compile()` or a `torch.compile` wrapper)."""
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")


def foreach_scale_(tensors: list, factor: float) -> None:
    """Multiply every tensor by `factor` in place, in one foreach kernel launch per device and dtype
    (`torch._foreach_mul_`, private): gradient clipping scales every local gradient at once."""
    if tensors:
        torch._foreach_mul_(tensors, factor)
