"""FSDP2's private per-unit state: gradient summing, post-backward by hand, what a unit holds now.

Private or version-gated torch APIs (see `meshkit._compat`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import FSDPModule, fully_shard


def fsdp_sum_gradients(module) -> None:
    """Make an FSDP2 unit sum gradients across data ranks instead of averaging them.

    meshkit's loss already carries the global valid-token denominator, so FSDP's own division by the
    data-parallel size would scale gradients twice (torchtitan #757/#2972 are this bug).
    """
    module.set_gradient_divide_factor(1.0)
    # A factor of 1 otherwise becomes NCCL's PREMUL_SUM(1), which gloo lacks; plain SUM is the same sum.
    if hasattr(module, "set_force_sum_reduction_for_comms"):
        module.set_force_sum_reduction_for_comms(True)


def _fsdp_param_groups(state) -> list:
    """An FSDP2 state's parameter groups: newer torch holds a list per state, older releases one (or None)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return groups


def fsdp_post_backward(root) -> None:
    """Run FSDP2's post-backward (reduce-scatter of the accumulated unsharded gradients) by hand.

    Pipeline schedules split a microbatch's backward into B and W, so FSDP's own post-backward hook
    would fire before the weight gradients exist; the runtime turns it off and calls this once after
    the last W, as torch's own pipelining does, through FSDP2's private state.
    """

    state = fully_shard.state(root)
    for each in state._state_ctx.all_states:
        groups = _fsdp_param_groups(each)
        for group in groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def fsdp_unsharded_tensors(root) -> tuple[list, list]:
    """(gathered parameter tensors, unreduced full gradients) FSDP2 holds right now under `root`, as
    local tensors, through its private per-parameter state: the memory estimator's tests and the
    memory benchmark count them, since neither is reachable once a unit is resharded."""

    def local(t):
        return getattr(t, "_local_tensor", t)

    gathered, grads = [], []
    for each in fully_shard.state(root)._state_ctx.all_states:
        groups = _fsdp_param_groups(each)
        for group in groups:
            for param in group.fsdp_params:
                if not hasattr(param, "_unsharded_param"):
                    continue
                unsharded = param._unsharded_param
                if local(unsharded).untyped_storage().size() > 0:
                    gathered.append(local(unsharded))
                grad = param.unsharded_accumulated_grad
                grad = unsharded.grad if grad is None else grad
                if grad is not None:
                    grads.append(local(grad))
    return gathered, grads


def fsdp_after_unit_reduce(module, callback) -> None:
    """Call `callback(sharded_params)` each time the FSDP2 unit `module` has reduced its gradients
    (after its post-backward issued the reduce-scatter, once the result may be read on the current
    stream), by wrapping the unit's private parameter-group `post_backward`: FSDP2 assigns the sharded
    gradients directly, so no tensor hook fires for them. The fused optimizer steps there."""

    state = fully_shard.state(module)
    groups = _fsdp_param_groups(state)
    for group in groups:
        original = group.post_backward

        def post_backward(*args, _group=group, _original=original):
            reduced = _group.reduce_grads
            out = _original(*args)
            if reduced:
                event = getattr(_group, "_post_reduce_event", None)
                if event is not None:
                    _group.device_handle.current_stream().wait_event(event)
                callback([p.sharded_param for p in _group.fsdp_params])
            return out

        group.post_backward = post_backward


def fsdp_unit_policies(module) -> list[tuple[object, list]]:
    """(offload policy, parameters) of every FSDP2 unit under `module`, each unit once, read from FSDP2's
    private parameter groups: an offload policy changes placement, never CPU numerics, so only the
    structure can show that every unit (the MoE experts' included) received the plan's policy."""
    seen, units = set(), []
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = fully_shard.state(sub)
        if id(state) in seen:
            continue
        seen.add(id(state))
        for group in _fsdp_param_groups(state):
            units.append((group.offload_policy, [p.sharded_param for p in group.fsdp_params]))
    return units


def set_custom_comms(module, all_gather: Callable, reduce_scatter: Callable) -> None:
    """Route an FSDP2 unit's all-gather and reduce-scatter through the given functions.

    `all_gather(out, inp, group, async_op) -> Work | None` and `reduce_scatter(out, inp, group, op)`;
    buffers are plain `torch.empty`, as FSDP2's defaults. The base classes are private in 2.11-2.13
    (`_fsdp_api`), `set_custom_all_gather` / `set_custom_reduce_scatter` public."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class _Allocating:
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

    class _AllGather(_Allocating, AllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return all_gather(output_tensor, input_tensor, group, async_op)

    class _ReduceScatter(_Allocating, ReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return reduce_scatter(output_tensor, input_tensor, group, op)

    module.set_custom_all_gather(_AllGather())
    module.set_custom_reduce_scatter(_ReduceScatter())
