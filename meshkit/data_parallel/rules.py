"""The memory options a Plan may take and the combinations that contradict each other.

A leaf (no meshkit imports) so that `plan.py` can check them at construction, on every rank, before
any collective. Each function returns every violation with its fix and never raises.
"""

from __future__ import annotations

from typing import Any

ZERO_STAGES = (1, 2, 3)
GRAD_SYNC = ("every_microbatch", "last_microbatch")
OFFLOAD = ("none", "optimizer", "params")


def memory_problems(plan: Any) -> list[str]:
    """Option values and contradictions of `zero`, `grad_sync` and `offload` (a Plan's own fields only)."""
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
    return problems
