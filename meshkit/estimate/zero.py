"""Model-state memory of one rank under the memory options (ZeRO stage, accumulation policy, host
offload, fused step), exact for what meshkit keeps, with the ZeRO paper's formulas beside it.

meshkit's three stages drive the same FSDP2 units (`meshkit.data_parallel.zero_stages`), so the sharded part is
the same in all of them: fp32 parameter shards (the master weights the optimizer steps), fp32
gradient shards and the optimizer's state, 4 + 4 + 8 bytes per parameter over N = dp_shard x cp
ranks for AdamW. What differs is what is replicated on top:

- gathered compute parameters (param_dtype, FSDP2's padded all-gather buffers): ZeRO-1/2 keep every
  unit's through the accumulation window; ZeRO-3 only the units running (`peak.rank_memory`).
- full, unreduced gradients (reduce_dtype: FSDP2 accumulates unreduced gradients in it): ZeRO-1
  keeps them to the end of each synced call's backward, and every stage keeps them between the
  calls of a window under `grad_sync="last_microbatch"`.

Against the paper (mixed-precision Adam, K = 12: fp32 master 4 + moments 8): ZeRO-3 is exactly
(2 + 2 + 12) Psi / N (FSDP2's fp32 shard is the master, so no bf16 shard exists); ZeRO-2 is
2 Psi + (4 + 12) Psi / N, the paper's form with FSDP2's fp32 gradient shard (4 bytes, not 2); ZeRO-1
is 2 Psi + 4 Psi + 12 Psi / N plus that same 4 Psi / N shard (with fp32 reduction the full gradient
takes 4 bytes, not 2). Padding adds at most one row per tensor to the gathered buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshkit.data_parallel.rules import shards_with_fsdp
from meshkit.estimate.memory import param_specs
from meshkit.estimate.spec import ModelState, dtype_bytes
from meshkit.plan import Plan
from meshkit.tensor_parallel.path import runs_on_local_shards

ADAM_STATE_BYTES = 8  # exp_avg + exp_avg_sq in fp32, per parameter


@dataclass(frozen=True)
class ZeroMemory:
    """Model-state bytes of one rank, by kind, and how many of them live in host memory."""

    zero: int
    master: int         # sharded fp32 parameters: the optimizer's parameters
    grads: int          # sharded fp32 gradients, kept from the sync to the step (0 when fused into backward)
    optimizer: int      # the optimizer's state (AdamW: two fp32 moments and a step counter per tensor)
    gathered: int       # gathered compute parameters kept through the window (ZeRO-1/2)
    full_grads: int     # full unreduced gradients at the end of the window's last backward (ZeRO-1)
    window_grads: int   # full unreduced gradients kept between the calls of a window (last_microbatch)
    host: int           # of master + grads + optimizer, the bytes offload moves to host memory
    full: int = 0       # every unit's full unreduced gradient, as FSDP2 accumulates it (reduce dtype)
    sharded: bool = True  # FSDP2 applies (data ranks, mixed precision or offload)
    disk: int = 0       # of the optimizer state, the bytes offload="nvme" keeps in its file instead

    @property
    def between_calls(self) -> int:
        """Bytes resident between two calls of an accumulation window (after the first step)."""
        synced = self.grads if self.window_grads == 0 else 0
        return self.master + synced + self.optimizer + self.gathered + self.window_grads

    @property
    def at_last_backward(self) -> int:
        """Bytes resident when the window's last backward ends (before ZeRO-1's reduce-scatter), the
        model-state peak of the step; the paper's per-stage figure."""
        return self.master + self.grads + self.optimizer + self.gathered + max(self.full_grads, self.window_grads)

    @property
    def on_device(self) -> int:
        """`at_last_backward` less what offload keeps in host memory or on disk."""
        return self.at_last_backward - self.host - self.disk


def gathered_elements(state: ModelState) -> int:
    """Elements of every FSDP unit of the rank as gathered (padded rows): ZeRO-1/2 keep them all."""
    units = state.unit_elements
    edges = units["embed"] + units["head"]
    return edges + state.block_elements


def gathered_bytes(plan: Plan, elements: int, float8_elements: int) -> int:
    """Bytes of gathered parameters: param_dtype, except the float8 projection weights FSDP gathers in
    one byte each (`float8="tensorwise"`)."""
    act = dtype_bytes(plan.param_dtype)
    return elements * act - (float8_elements * (act - 1) if plan.float8 == "tensorwise" else 0)


def largest_unit_state(state: ModelState, fsdp: int) -> int:
    """Optimizer-state bytes (AdamW: two fp32 moments) of the rank's largest FSDP unit's shard: what
    offload="nvme" streams through host memory at a time (two units: the one stepping, the next read)."""
    return ADAM_STATE_BYTES * -(-max(state.unit_elements.values()) // max(fsdp, 1))


def zero_memory(plan: Plan, state: ModelState, config: Any = None, *, fused: bool = False) -> ZeroMemory:
    """What one rank holding `state` (from `memory.model_state`) keeps under the plan's memory options.

    `fused`: the optimizer steps inside backward (`meshkit.fuse_optimizer_into_backward`), freeing
    each gradient shard once used, so no gradient shard survives to a step. `config` (the model's)
    adds the vocab-parallel embedding's gradient under TP where the ParallelStyles run it: backward
    hands it over as a Partial DTensor of the whole vocabulary, which FSDP2 replicates before
    accumulating it, so the rank holding the embedding keeps vocab x hidden elements of it, not vocab /
    tp x hidden. On local shards (`tensor_parallel.local.ends_are_plain`) it is the shard's.
    """
    sharded = shards_with_fsdp(plan)
    red = dtype_bytes(plan.reduce_dtype)
    gathered = gathered_bytes(plan, gathered_elements(state), state.float8_elements) \
        if sharded and plan.zero < 3 else 0
    full = state.held_trainable * red if sharded else 0  # frozen weights (LoRA's base) have no gradient
    if sharded and config is not None and plan.tp > 1 and state.grad_unit_elements["embed"] > 0 and not \
            (runs_on_local_shards(plan) and param_specs(config)[0][0].plain_ends):  # [0][0]: the embedding
        full += config.vocab_size * config.hidden_size * (plan.tp - 1) // plan.tp * red
    grads = 0 if fused else state.grad_bytes
    host = state.param_bytes + grads + state.optimizer_bytes if plan.offload != "none" else 0
    disk = 0
    if plan.offload == "nvme":  # the optimizer state in the file; two units' of it in host memory at a time
        streamed = min(2 * largest_unit_state(state, plan.dp_shard * plan.cp), state.optimizer_bytes)
        disk = state.optimizer_bytes - streamed
        host -= disk
    return ZeroMemory(plan.zero, state.param_bytes, grads, state.optimizer_bytes, gathered,
                      full if plan.zero == 1 else 0, full if plan.grad_sync == "last_microbatch" else 0, host,
                      full, sharded, disk)


def paper_model_states(zero: int, psi: float, n: int, *, param_bytes: int = 2, grad_bytes: int = 2,
                       k: int = 12) -> float:
    """The ZeRO paper's model-state bytes per rank: stage 0 (DDP) (b_p + b_g + K) Psi, ZeRO-1
    (b_p + b_g) Psi + K Psi / N, ZeRO-2 b_p Psi + (b_g + K) Psi / N, ZeRO-3 (b_p + b_g + K) Psi / N."""
    replicated = {0: param_bytes + grad_bytes + k, 1: param_bytes + grad_bytes, 2: param_bytes, 3: 0}[zero]
    return replicated * psi + (param_bytes + grad_bytes + k - replicated) * psi / n


def meshkit_formula(zero: int, psi: float, n: int, *, param_bytes: int, reduce_bytes: int) -> float:
    """meshkit's model states in the paper's terms (no padding): the paper's figure with FSDP2's fp32
    gradient shard (4 bytes) in place of the paper's sharded gradient, and the full gradient of ZeRO-1
    in the reduce dtype."""
    sharded = (4 + 4 + ADAM_STATE_BYTES) * psi / n
    return sharded + {1: (param_bytes + reduce_bytes) * psi, 2: param_bytes * psi, 3: 0.0}[zero]
