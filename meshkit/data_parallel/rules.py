"""The memory options a Plan may take and the combinations that contradict each other.

A leaf (no meshkit imports) so that `plan.py` can check them at construction, on every rank, before
any collective. Each function returns every violation with its fix and never raises.
"""

from __future__ import annotations

from typing import Any

ZERO_STAGES = (1, 2, 3)
GRAD_SYNC = ("every_microbatch", "last_microbatch")
OFFLOAD = ("none", "optimizer", "params", "nvme")


def replicates_with_ddp(plan: Any) -> bool:
    """Whether every rank holds the whole model and nothing else is split or cast: data parallelism over
    `dp_replicate` alone (a resolved plan), fp32 throughout, no offload. Such plans run DDP's bucketed
    all-reduce (`data_parallel.replicate`) instead of FSDP2 units, whose per-unit hooks, copies and
    DTensor optimizer step cost 13% more CPU per step than DDP there and save no memory (nothing is
    sharded); the ZeRO stage then has nothing to shard and does not apply."""
    alone = plan.dp_replicate > 1 and plan.dp_shard * plan.cp == 1 and plan.tp == plan.pp == plan.ep == 1
    return alone and plan.param_dtype == plan.reduce_dtype == "float32" and plan.offload == "none"


def shards_with_fsdp(plan: Any) -> bool:
    """Whether FSDP2 units hold the weights (a resolved plan): shared by several data or context ranks
    (but for `replicates_with_ddp`), cast to another dtype (mixed precision), or kept in host memory."""
    shared = plan.dp_shard * plan.cp * plan.dp_replicate > 1 and not replicates_with_ddp(plan)
    return shared or plan.param_dtype != "float32" or plan.offload != "none"


def memory_problems(plan: Any) -> list[str]:
    """Option values and contradictions of `zero`, `grad_sync`, `offload`, `offload_dir` and
    `activation_offload` (a Plan's own fields only; whether the directory can hold the files is checked by `parallelize`, which knows the shards)."""
    problems = []
    zero = plan.zero
    if not isinstance(zero, int) or isinstance(zero, bool) or zero not in ZERO_STAGES:
        problems.append(f"zero={zero!r}: must be one of {ZERO_STAGES} (1: optimizer state sharded, 2: and "
                        "gradients, 3: and parameters); fix: e.g. zero=2")
    elif zero < 3 and plan.reshard_after_forward is True:
        problems.append(
            f"zero={zero} with reshard_after_forward=True: ZeRO-{zero} keeps parameters replicated through forward "
            f"and backward, and resharding them after forward is ZeRO-3; fix: drop reshard_after_forward (or set it "
            f"false), or set zero=3")
    if plan.grad_sync not in GRAD_SYNC:
        problems.append(f"grad_sync={plan.grad_sync!r}: must be one of {GRAD_SYNC}")
    if plan.offload not in OFFLOAD:
        problems.append(f"offload={plan.offload!r}: must be one of {OFFLOAD}")
    elif plan.offload == "params" and zero in (1, 2):
        problems.append(
            f"offload='params' with zero={zero}: ZeRO-{zero} keeps the gathered parameters on the device through "
            f"forward and backward, so they cannot live on the host; fix: offload='optimizer' (master weights, "
            f"gradients and optimizer state on the host), or zero=3")
    elif plan.offload == "nvme" and not (isinstance(plan.offload_dir, str) and plan.offload_dir.strip()):
        problems.append(
            f"offload='nvme' with offload_dir={plan.offload_dir!r}: the optimizer state lives in one file per rank "
            "under offload_dir; fix: offload_dir='/path/on/nvme' (a directory on a fast local disk)")
    if plan.activation_offload is True and plan.compile is True:
        problems.append(
            "activation_offload=True with compile=True: torch.compile (AOTAutograd) traces the saved-tensor hooks "
            "that copy activations to the host into its graphs, and the compiled blocks then fail inductor's layout "
            "checks under FSDP; fix: compile=False, or activation_offload=False (activation_checkpointing saves "
            "memory under compile)")
    if plan.offload_dir is not None and plan.offload != "nvme":
        problems.append(
            f"offload_dir={plan.offload_dir!r} with offload={plan.offload!r}: only offload='nvme' writes files there; "
            "fix: offload='nvme', or drop offload_dir")
    return problems
