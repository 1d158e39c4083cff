"""The optimizer fused into backward (LOMO-style): each parameter steps as soon as its gradient is final,
and the gradient is freed at once, so no gradient buffer of the whole model ever exists.

When is a gradient final? Under FSDP (any zero stage, with tp, cp, pp or ep) when its unit's
reduce-scatter has run: the unit's parameters step right there, inside backward, and their gradient
shards are dropped (at most one unit's shards are alive). Without FSDP and without pipelining, when
autograd has accumulated it (`register_post_accumulate_grad_hook`); a gradient TP left Partial is
summed over tp first. Pipelining without FSDP accumulates every microbatch into the same gradients,
so those parameters step after the schedule, at the end of the call.

Clipping needs the global gradient norm before any parameter moves, which a one-pass fused step
never has. meshkit's fused path does not clip: `clip_grad_norm_` raises under it (LOMO's
alternative, a first backward that only measures the norm, doubles the backward cost). Accumulation
windows are refused for the same reason: a gradient is final only at the window's last call.

Checkpoints: `FusedOptimizer` exposes `param_groups`, `state` and `step()` as a torch optimizer does,
which is all `meshkit.state.checkpoint` reads, so a fused run saves and resumes like any other.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshkit._compat.fsdp import fsdp_after_unit_reduce
from meshkit.data_parallel.rules import replicates_with_ddp

if TYPE_CHECKING:
    from meshkit.parallel_model import ParallelModel

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class _FusedState(Mapping):
    """The per-parameter optimizers' states read as one `optimizer.state` (parameter -> its state dict),
    so that code written for a torch optimizer (meshkit.state.checkpoint) reads and fills them unchanged."""

    def __init__(self, optimizers: dict[nn.Parameter, torch.optim.Optimizer]):
        self._optimizers = optimizers

    def __getitem__(self, p: nn.Parameter) -> dict:
        return self._optimizers[p].state[p]  # created on first use, as torch's defaultdict does

    def get(self, p: nn.Parameter, default: Any = None) -> Any:
        """The state of `p` if its optimizer has made one (never creates it)."""
        opt = self._optimizers.get(p)
        return opt.state[p] if opt is not None and p in opt.state else default

    def __contains__(self, p: object) -> bool:
        opt = self._optimizers.get(p)  # type: ignore[call-overload]
        return opt is not None and p in opt.state

    def __iter__(self) -> Iterator[nn.Parameter]:
        return (p for p, opt in self._optimizers.items() if p in opt.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class FusedOptimizer:
    """One optimizer per parameter, stepped from inside backward; returned by `fuse_optimizer_into_backward`.

    It reads like a torch optimizer where checkpointing needs one: `param_groups` (every per-parameter
    optimizer's group, the real dicts), `state` (parameter -> state) and `step()`, so
    `meshkit.state.checkpoint.save(path, pm, fused)` / `load` keep the per-parameter state under DCP.
    """

    def __init__(self, optimizers: dict[nn.Parameter, torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.steps = 0  # parameter updates made, for tests and logs

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every per-parameter optimizer's parameter groups, in parameter order (editing one edits it)."""
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> _FusedState:
        """Parameter -> its optimizer's state, as `torch.optim.Optimizer.state` reads."""
        return _FusedState(self.optimizers)

    def step(self) -> None:
        """Step every parameter that holds a gradient, outside backward (what `Optimizer.step` does);
        `meshkit.state.checkpoint.load` uses it with zero gradients and lr 0 to create the state it fills."""
        for p, opt in self.optimizers.items():
            if p.grad is not None:
                opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (the fused step leaves none; for code that calls it out of habit)."""
        for p in self.optimizers:
            p.grad = None

    def step_params(self, params: Iterable[nn.Parameter]) -> None:
        """Step each of `params` that has a gradient, then free that gradient."""
        for p in params:
            if p.grad is None or p not in self.optimizers:
                continue
            self.optimizers[p].step()
            p.grad = None
            self.steps += 1

    def _after_accumulate(self, p: nn.Parameter) -> None:
        grad = p.grad
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
            # TP leaves norms' gradients Partial and the embedding's Replicate (tensor_parallel.place_grads_like_params)
            p.grad = grad.redistribute(p.device_mesh, p.placements)
        self.step_params([p])

    def after_call(self) -> None:
        """Step whatever no hook stepped during the call (pipelining without FSDP)."""
        self.step_params(list(self.optimizers))


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def fuse_optimizer_into_backward(pm: ParallelModel, optimizer_factory: OptimizerFactory) -> FusedOptimizer:
    """Build `optimizer_factory([p])` for every parameter of `pm` that trains (a LoRA model's frozen base
    gets none) and step it inside backward.

    After this, `pm.forward_backward` updates the parameters itself: do not call an optimizer's
    `step`, `clip_grad_norm_` raises (no global norm exists before the updates), and every call is a
    whole step (`last_microbatch=False` raises). Refused, with a ValueError before any training: an
    optimizer whose step needs a closure or the whole gradient (LBFGS), and models whose gradients
    meshkit sums after backward (MoE weights under tp, a tied embedding split by pipelining). Call it
    once the weights are materialised (after `init_weights` / loading on a meta-device model): without
    FSDP the hooks sit on the parameter tensors, which materialisation replaces.
    """
    params = [p for p in pm.parameters() if p.requires_grad]
    if not params:
        raise ValueError("fuse_optimizer_into_backward: this rank holds no parameters that train")
    probe = optimizer_factory([nn.Parameter(torch.zeros(1))])
    if not isinstance(probe, torch.optim.Optimizer):
        raise ValueError(f"fuse_optimizer_into_backward: optimizer_factory must return a torch.optim.Optimizer, "
                         f"got {type(probe).__name__}; fix: e.g. lambda ps: torch.optim.AdamW(ps, lr=1e-4)")
    if isinstance(probe, torch.optim.LBFGS) or _needs_closure(probe):
        raise ValueError(f"fuse_optimizer_into_backward: {type(probe).__name__} needs the whole gradient (its step "
                         "re-evaluates the loss through a closure), which a step per parameter inside backward never "
                         "has; fix: use it unfused, or an elementwise optimizer such as SGD or AdamW")
    if pm.plan.offload == "nvme":
        raise ValueError("fuse_optimizer_into_backward: Plan(offload='nvme') streams each unit's optimizer state from "
                         "its file at the step, which a step per parameter inside backward would read once per "
                         "parameter; fix: use the optimizer unfused, or offload='optimizer'")
    if pm.sums_grads_after_backward:
        raise ValueError("fuse_optimizer_into_backward: this model has gradients meshkit sums after backward (MoE "
                         "weights every TP rank holds, or a tied embedding split by pipelining), so they are not "
                         "final inside backward; fix: use the optimizer unfused, or tp=1 / untied embeddings")
    if replicates_with_ddp(pm.plan):
        raise ValueError(f"fuse_optimizer_into_backward: a plan that only replicates "
                         f"(dp_replicate={pm.plan.dp_replicate}, nothing sharded) runs DDP, whose buckets keep every gradient resident, so stepping inside "
                         "backward would free nothing; fix: use the optimizer unfused, or shard (dp_shard=N: FSDP "
                         "frees each unit's gradient shards once stepped)")
    fused = FusedOptimizer({p: optimizer_factory([p]) for p in params})
    units = [m for part in pm.model_parts for m in part.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        fsdp_after_unit_reduce(unit, fused.step_params)
    if not units and pm.plan.pp == 1:
        for p in params:
            p.register_post_accumulate_grad_hook(fused._after_accumulate)
    pm.attach_fused_optimizer(fused)
    return fused
