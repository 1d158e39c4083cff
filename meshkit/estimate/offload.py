"""What host offload (`Plan.offload`) costs: host memory, the bytes that cross the host link, the CPU step.

Offload trades device memory for three things the estimate must see to rank it against plans that
keep everything on the device (FSDP2's `CPUOffloadPolicy`, as `meshkit.data_parallel.offload` sets it):

- host memory: the sharded fp32 parameters (the master weights), their gradients and the optimizer
  state (`zero.ZeroMemory.host`);
- host -> device bytes: before every all-gather FSDP2 copies the unit's padded fp32 shard to the
  device (then casts it to the compute dtype), so once per unit per window under ZeRO-1/2, per call
  and again for backward's re-gather under ZeRO-3;
- device -> host bytes: after every reduction FSDP2 copies the rank's fp32 gradient shard (unpadded)
  back, once per sync (`grad_sync`);
- the optimizer step on the CPU: AdamW reads parameter, gradient and two moments and writes three of
  them back, 28 bytes per element through host memory, at the GPU's share of the node's DRAM bandwidth.

The estimate counts all of it as exposed: the CPU step runs while the device waits for the next
forward's parameters, and FSDP2 issues each H2D copy in the all-gather's stream right before the
gather it feeds, so it adds to the gather's time instead of hiding behind compute (a D2H copy may
overlap the next unit's backward; counting it exposed keeps the figure an upper bound).

`offload="nvme"` adds the disk (`meshkit.data_parallel.nvme`): the optimizer state is read before each
unit's CPU step and written after it, `Device.nvme_bw` each way. Reads of the next unit overlap the
current unit's step, writes do not: exposed = max(CPU step, reads) + writes. Host memory keeps two
units' state instead of all of it (`zero.ZeroMemory.disk`).

Activation offload (`Plan.activation_offload`, `activation_offload_cost`) copies what each block saves
to the host in forward and back in backward on a side stream: its bytes cross the host link twice and
only what the link cannot move while forward (one way) and backward (the other) compute is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshkit.estimate.comm import fsdp_units
from meshkit.estimate.spec import Device, ModelState, Workload
from meshkit.estimate.zero import ADAM_STATE_BYTES, zero_memory
from meshkit.plan import Plan

MASTER_BYTES = 4          # FSDP2 keeps (and offloads) the sharded parameters and gradients in fp32
ADAMW_HOST_BYTES = 28     # per element: read p, g, exp_avg, exp_avg_sq (16), write p, exp_avg, exp_avg_sq (12)


@dataclass(frozen=True)
class OffloadCost:
    """One rank's offload figures per optimizer step."""

    host_bytes: int      # model state kept in host memory
    h2d_bytes: float     # parameter shards copied to the device, one per all-gather
    d2h_bytes: float     # gradient shards copied to the host, one per reduction
    host_step_bytes: float  # host-memory traffic of the CPU optimizer step
    transfer_time: float    # seconds the copies take over the host link
    step_time: float        # seconds of the CPU optimizer step
    disk_state_bytes: int = 0   # offload="nvme": the optimizer state in this rank's file
    disk_bytes: float = 0.0     # offload="nvme": bytes read and written per step
    disk_time: float = 0.0      # offload="nvme": seconds of file IO the CPU step does not hide

    @property
    def exposed(self) -> float:
        """Seconds the step gets longer by (everything: see the module docstring)."""
        return self.transfer_time + self.step_time + self.disk_time


def offload_cost(config: Any, plan: Plan, workload: Workload, state: ModelState, device: Device) -> OffloadCost | None:
    """The rank holding `state`'s offload figures, or None when the plan keeps its state on the device."""
    if plan.offload == "none":
        return None
    calls = workload.calls(plan)
    gathers = calls if plan.zero == 3 else 1  # ZeRO-1/2 keep the gathered units through the window
    syncs = calls if plan.grad_sync == "every_microbatch" else 1
    h2d = sum(u.count * gathers * (1 + u.regather) * (u.elements // u.group) * MASTER_BYTES
              for u in fsdp_units(config, plan, state))
    d2h = syncs * state.params * MASTER_BYTES
    host_step = ADAMW_HOST_BYTES * state.params
    step_time = host_step / device.host_memory_bw
    memory = zero_memory(plan, state)
    disk = read = 0.0
    if plan.offload == "nvme":  # the whole state read (after the first step) and written back, per step
        read = ADAM_STATE_BYTES * state.params / device.nvme_bw
        disk = max(0.0, read - step_time) + read
    # H2D copies run in forward (and backward's re-gathers), D2H copies after each reduction: counted
    # one after the other, not as the link's two directions in parallel.
    in_file = ADAM_STATE_BYTES * state.params if plan.offload == "nvme" else 0  # the moments; step counters stay
    return OffloadCost(memory.host, h2d, d2h, host_step, (h2d + d2h) / device.host_bw, step_time,
                       in_file, 2.0 * in_file, disk)


@dataclass(frozen=True)
class ActivationOffloadCost:
    """What activation offload costs one rank per step."""

    host_bytes: int     # the most saved activations host memory holds in the step
    link_bytes: float   # bytes over the host link per step, both directions
    exposed: float      # seconds the copies add beyond the compute they overlap


def activation_offload_cost(plan: Plan, workload: Workload, memory: Any, device: Device,
                            compute_time: float) -> ActivationOffloadCost | None:
    """Activation offload's figures for the rank `memory` (a `memory.RankMemory`) describes, or None."""
    if not plan.activation_offload:
        return None
    per_microbatch = sum(u.count * memory.moved.get(u.kind, 0) for u in memory.state.block_units)
    one_way = workload.microbatches * per_microbatch
    # forward is a third of the compute, backward (with its recompute) the rest
    exposed = max(0.0, one_way / device.host_bw - compute_time / 3) + \
        max(0.0, one_way / device.host_bw - 2 * compute_time / 3)
    return ActivationOffloadCost(memory.activation_host_peak, 2.0 * one_way, exposed)
