"""Host offload (`Plan.offload`) as FSDP2's offload policy.

FSDP2's sharded fp32 parameters are the optimizer's master weights, so offloading the optimizer means
offloading them too: with `offload="optimizer"` or `"params"` the sharded parameters, their
gradients and (because the optimizer is built on them) the optimizer state live in host memory and
the step runs on the CPU; each unit's shard is copied to the device for its all-gather and each
reduced gradient shard copied back. What stays on the device is the gathered compute copy: for the
whole window under ZeRO-1/2 ("optimizer": ZeRO-Offload), only the running unit under ZeRO-3
("params"; `optimizer` under ZeRO-3 is the same placement). "nvme" places as "optimizer" and moves the
optimizer state on into files (`data_parallel.nvme`).
"""

from __future__ import annotations

import warnings

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy


def offload_policy(offload: str, device: torch.device) -> OffloadPolicy:
    """FSDP2's policy for `Plan.offload` on `device` (the mesh's).

    Without an accelerator the parameters already live in host memory: a warning says offloading
    saves nothing, and FSDP2's offload path still runs (unpinned, pinning needs an accelerator) so
    the numerics are those of a GPU run.
    """
    if offload == "none":
        return OffloadPolicy()
    if device.type == "cpu":
        what = "its host placement saves nothing here (the optimizer state still goes to offload_dir)" \
            if offload == "nvme" else "offloading saves nothing here (the offload code path still runs)"
        warnings.warn(f"Plan(offload={offload!r}): this run has no accelerator, its parameters already live in "
                      f"host memory, so {what}", stacklevel=3)
        return CPUOffloadPolicy(pin_memory=False)
    return CPUOffloadPolicy(pin_memory=True)
