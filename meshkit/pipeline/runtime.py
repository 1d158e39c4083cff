"""Run one rank's part of a meshkit `Schedule`: forwards, backwards and transfers, in list order.

Why meshkit's own executor: torch's `_PipelineScheduleRuntime` is private, its action format changed
meaning between releases, its shape inference runs a hidden forward/backward that clears `.grad`,
and its backward split re-walks the autograd graph (a second recompute per checkpointed block, no
compiled stages). Executing meshkit's checked action lists directly keeps one format end to end.

Semantics the callers rely on:
- The loss is the caller's: `loss_fn(output, microbatch)` returns that microbatch's loss already
  divided by the global denominator, so the runtime never scales anything. Gradients accumulate
  into `.grad` across microbatches and across calls (gradient accumulation); nothing is zeroed.
- No shape inference: receive buffers come from the static `shapes` the caller declares, and every
  send is checked against them, so a wrong declaration fails on the sender with the numbers.
- B/W split (ZB schedules): `meshkit.pipeline.weight_grad` defers eager linear weight gradients
  from B to W; see its docstring for why and what it costs.
- FSDP2: gradients are reduce-scattered once per call, after the last W. During the schedule the
  FSDP modules neither sync nor reshard after backward (their hooks run in B, before W has added
  the weight gradients); the post-backward reduction then runs by hand, as torch's pipelining does.
- Run it inside the caller's `loss_parallel()` (or other) context: backward happens inside the call.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshkit._compat import fsdp_post_backward
from meshkit.data_parallel import reshard_fsdp
from meshkit.pipeline.actions import Action, ActionKind, Schedule
from meshkit.pipeline.p2p import TensorMeta, Transfer, Transfers, wire_tensor
from meshkit.pipeline.simulate import check
from meshkit.pipeline.weight_grad import PendingWeightGrads, collecting, deferrable_linears
from meshkit.zero.stages import fsdp_roots

__all__ = ["LossFn", "Shapes", "TensorMeta", "TraceEvent", "run_schedule"]

LossFn = Callable[[Any, int], torch.Tensor]
#: One meta for every boundary, one per boundary (keyed by the sending stage), or a function of
#: (boundary, microbatch) for microbatches of different sizes.
Shapes = TensorMeta | Mapping[int, TensorMeta] | Callable[[int, int], TensorMeta]

K = ActionKind
_COMM = frozenset({K.SEND_F, K.RECV_F, K.SEND_B, K.RECV_B})
#: A receive is posted this many compute actions before the compute that consumes it (see `_steps`).
RECEIVE_LOOKAHEAD = 1


class TraceEvent(NamedTuple):
    """One interval of a rank's step, on `time.perf_counter`'s clock (system-wide on Linux, so the
    ranks of one machine share it): `kind` is "call" (the whole `run_schedule`), "compute" (an F, B,
    W or BW, waits included), "stage" (inside a compute: the stage module and the loss, the autograd
    backward, or the deferred weight gradients: the model's own work, as opposed to the runtime's),
    "post" (a batch of sends and receives being started) or "wait" (blocked on a receive inside a
    compute); `what` is the action, or the tuple of actions posted."""

    kind: str
    what: object
    start: float
    end: float


def run_schedule(
    schedule: Schedule,
    stages: Mapping[int, nn.Module],
    *,
    pp_group: dist.ProcessGroup,
    microbatch_inputs: Sequence[Any] | None = None,
    loss_fn: LossFn | None = None,
    shapes: Shapes | None = None,
    stage_kwargs: Sequence[Mapping[str, Any]] | None = None,
    device: torch.device | str | None = None,
    reduce_grads: bool = True,
    reshard: bool = True,
    trace: list[TraceEvent] | None = None,
) -> list[torch.Tensor]:
    """Run this rank's actions of `schedule`; return the detached per-microbatch losses (last stage only).

    A `forward_only` schedule (`schedules.forward_only`) evaluates: run it under `torch.no_grad()`;
    nothing is kept for backward and FSDP's gradient hooks are left alone.

    `stages` maps each global stage index this rank computes to its module, called as
    `module(inputs, **stage_kwargs[microbatch])`. The first stage's inputs are
    `microbatch_inputs[microbatch]`; later stages get the previous stage's output, received as a
    plain tensor described by `shapes` (a DTensor output travels as its local shard and its
    gradient is rebuilt with the output's placements). The last stage's output goes to
    `loss_fn(output, microbatch)`, whose result is backpropagated as is.

    `trace`, if given, receives this rank's measured timeline as `TraceEvent`s (what a profiler
    would show, at ~1 us per event): where a step's time goes beyond the stages' own compute, which
    is what `benchmarks/pipeline/critical_path.py` reconstructs into the critical path across ranks.
    """
    entered = time.perf_counter()
    rank = dist.get_rank(pp_group)
    _validate(schedule, rank, dist.get_world_size(pp_group), stages, microbatch_inputs, loss_fn,
              shapes, stage_kwargs)
    run = _RankRun(schedule, rank, stages, pp_group, microbatch_inputs, loss_fn, shapes, stage_kwargs, device,
                   trace)
    actions = schedule.ranks[rank]
    splits = any(a.kind is K.W for a in actions)
    fsdp = (contextlib.nullcontext() if schedule.forward_only else
            _fsdp_reduce_once(list(stages.values()), reduce_grads=reduce_grads, reshard=reshard))
    with fsdp, (
        deferrable_linears(stages.values()) if splits else contextlib.nullcontext()
    ):
        for transfers, compute in _steps(schedule, rank, RECEIVE_LOOKAHEAD):
            action, position = transfers[0] if transfers else compute
            try:
                if transfers:
                    start = time.perf_counter() if trace is not None else 0.0
                    run.post([a for a, _ in transfers])
                    if trace is not None:
                        trace.append(TraceEvent("post", tuple(a for a, _ in transfers), start, time.perf_counter()))
                if compute is not None:
                    action, position = compute
                    start = time.perf_counter() if trace is not None else 0.0
                    run.compute(action, deferred=splits)
                    if trace is not None:
                        trace.append(TraceEvent("compute", action, start, time.perf_counter()))
            except Exception as exc:
                _note(exc, f"meshkit pipeline rank {rank} failed in {action} (position {position} "
                           f"of {len(actions)} in schedule {schedule.name!r})")
                raise
        run.finish()
    if trace is not None:
        trace.append(TraceEvent("call", schedule.name, entered, time.perf_counter()))
    return [run.losses[mb] for mb in sorted(run.losses)]


class _RankRun:
    """The state of one rank during one schedule: what each (stage, microbatch) still holds."""

    def __init__(self, schedule, rank, stages, group, microbatch_inputs, loss_fn, shapes, stage_kwargs, device,
                 trace=None):
        self.owner = schedule.stage_to_rank()
        self.keep = not schedule.forward_only  # what backward needs; evaluation drops each tensor once used
        self.last = schedule.num_stages - 1
        self.m = schedule.num_microbatches
        self.rank, self.stages = rank, stages
        self.inputs, self.loss_fn = microbatch_inputs, loss_fn
        self.shapes, self.stage_kwargs = shapes, stage_kwargs
        self.device = torch.device(device) if device is not None else _device_of(stages.values())
        self.p2p = Transfers(group)
        self.stage_inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # the loss on the last stage
        self.input_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.pending: dict[tuple[int, int], PendingWeightGrads] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.trace = trace

    def post(self, actions: Sequence[Action]) -> None:
        """Start these sends and receives as one batch (receives are waited on by their consumer)."""
        self.p2p.post([self._transfer(a) for a in actions])

    def compute(self, action: Action, deferred: bool) -> None:
        """Run one F, B, BW or W."""
        if action.kind is K.F:
            self._forward(action.stage, action.microbatch)
        elif action.kind in (K.B, K.BW):
            self._backward(action.stage, action.microbatch, weights_now=action.kind is K.BW, deferred=deferred)
        else:
            start = time.perf_counter() if self.trace is not None else 0.0
            self.pending.pop((action.stage, action.microbatch)).run()
            if self.trace is not None:
                self.trace.append(TraceEvent("stage", action, start, time.perf_counter()))

    # ------------------------------------------------------------------ compute
    def _forward(self, s: int, mb: int) -> None:
        if s == 0:
            x = self.inputs[mb]
        else:
            if self.owner[s - 1] == self.rank:  # same tensor the wire would carry, without the wire
                x = wire_tensor(self.outputs[(s - 1, mb)] if self.keep else self.outputs.pop((s - 1, mb)))
            else:
                x = self._take(K.RECV_F, s, mb)
            if self.keep:
                x.requires_grad_(x.is_floating_point())
                self.stage_inputs[(s, mb)] = x
        kwargs = self.stage_kwargs[mb] if self.stage_kwargs is not None else {}
        start = time.perf_counter() if self.trace is not None else 0.0
        out = self.stages[s](x, **kwargs)
        if s == self.last:
            out = self.loss_fn(out, mb)
            self.losses[mb] = out.detach()
        if self.trace is not None:
            self.trace.append(TraceEvent("stage", Action(K.F, s, mb), start, time.perf_counter()))
        if s < self.last or self.keep:
            self.outputs[(s, mb)] = out

    def _backward(self, s: int, mb: int, weights_now: bool, deferred: bool) -> None:
        out = self.outputs.pop((s, mb))
        grad = None
        if s < self.last:
            grad = (self.input_grads.pop((s + 1, mb)) if self.owner[s + 1] == self.rank
                    else self._take(K.RECV_B, s, mb))
            if isinstance(out, DTensor) and not isinstance(grad, DTensor):
                grad = DTensor.from_local(grad, out.device_mesh, out.placements, run_check=False,
                                          shape=out.shape, stride=out.stride())
        pending = PendingWeightGrads()
        start = time.perf_counter() if self.trace is not None else 0.0
        with collecting(pending) if deferred else contextlib.nullcontext():
            torch.autograd.backward(out, grad)
        if weights_now:
            pending.run()
        else:
            self.pending[(s, mb)] = pending
        if self.trace is not None:
            kind = K.BW if weights_now else K.B
            self.trace.append(TraceEvent("stage", Action(kind, s, mb), start, time.perf_counter()))
        if s > 0:
            x = self.stage_inputs.pop((s, mb))
            self.input_grads[(s, mb)] = x.grad if x.grad is not None else torch.zeros_like(x)

    # ------------------------------------------------------------- transfers
    def _take(self, kind: ActionKind, s: int, mb: int) -> torch.Tensor:
        if self.trace is None:
            return self.p2p.take((kind, s, mb))
        start = time.perf_counter()
        tensor = self.p2p.take((kind, s, mb))
        self.trace.append(TraceEvent("wait", Action(kind, s, mb), start, time.perf_counter()))
        return tensor

    def _transfer(self, action: Action) -> tuple[object, Transfer]:
        s, mb = action.stage, action.microbatch
        if action.kind is K.SEND_F:
            out = self.outputs[(s, mb)] if self.keep else self.outputs.pop((s, mb))
            tensor = self._checked(wire_tensor(out), s, mb, "output")
            return action, Transfer(True, self.owner[s + 1], _tag(s, mb, self.m, False), tensor)
        if action.kind is K.SEND_B:
            tensor = self._checked(wire_tensor(self.input_grads.pop((s, mb))), s - 1, mb, "input gradient")
            return action, Transfer(True, self.owner[s - 1], _tag(s - 1, mb, self.m, True), tensor)
        boundary, peer, backward = (s - 1, self.owner[s - 1], False) if action.kind is K.RECV_F else (
            s, self.owner[s + 1], True)
        meta = _meta(self.shapes, boundary, mb)
        buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        return (action.kind, s, mb), Transfer(False, peer, _tag(boundary, mb, self.m, backward), buffer)

    def _checked(self, tensor: torch.Tensor, boundary: int, mb: int, what: str) -> torch.Tensor:
        meta = _meta(self.shapes, boundary, mb)
        if tensor.shape != meta.shape or tensor.dtype != meta.dtype:  # torch.Size equals the tuple
            raise ValueError(
                f"stage {boundary if what == 'output' else boundary + 1} {what} for microbatch {mb} is "
                f"{tuple(tensor.shape)} {tensor.dtype}, but shapes declares {meta.shape} {meta.dtype} for the "
                f"boundary after stage {boundary}; fix the shapes passed to run_schedule (the receiver "
                f"allocates its buffer from them)"
            )
        return tensor

    def finish(self) -> None:
        self.p2p.finish()
        left = {name: sorted(d) for name, d in (("outputs", self.outputs), ("input grads", self.input_grads),
                                                ("weight grads", self.pending)) if d}
        if left:
            raise RuntimeError(f"schedule ended with work left on rank {self.rank}: {left}")


_Step = tuple[tuple[tuple[Action, int], ...], tuple[Action, int] | None]


@functools.lru_cache(maxsize=64)
def _steps(schedule: Schedule, rank: int, lookahead: int) -> tuple[_Step, ...]:
    """This rank's actions as steps: (transfers to post as one batch, then one compute), with positions.

    Sends stay where the schedule puts them (right after their producer). Each receive is posted
    `lookahead` computes before the compute that consumes it, which still waits for it: gloo moves
    a message only once both ends have posted it (the receiver tells the sender it is ready), so a
    receive posted just before its consumer costs a round trip between the two ranks' transport
    threads on the critical path, while one posted a compute earlier is usually complete when
    waited on. Waits stay where they were, so the deadlock-freedom `check` proves still holds (see
    `p2p`). The last step (compute None) posts the sends after the last compute.
    """
    actions = schedule.ranks[rank]
    computes = [(a, i) for i, a in enumerate(actions) if a.kind not in _COMM]
    posts: list[list[tuple[Action, int]]] = [[] for _ in range(len(computes) + 1)]
    next_compute = 0
    for i, a in enumerate(actions):
        if a.kind not in _COMM:
            next_compute += 1
        elif a.kind in (K.RECV_F, K.RECV_B):
            posts[max(next_compute - lookahead, 0)].append((a, i))
        else:
            posts[next_compute].append((a, i))
    steps = [(tuple(posts[j]), computes[j] if j < len(computes) else None) for j in range(len(computes) + 1)]
    return tuple(step for step in steps if step[0] or step[1] is not None)


def _tag(boundary: int, mb: int, num_microbatches: int, backward: bool) -> int:
    """Unique per message of a step, so gloo matches receives by identity, not by posting order."""
    return 2 * (boundary * num_microbatches + mb) + int(backward)


def _meta(shapes: Shapes | None, boundary: int, mb: int) -> TensorMeta:
    if isinstance(shapes, TensorMeta):
        return shapes
    if isinstance(shapes, Mapping):
        return shapes[boundary]
    return shapes(boundary, mb)


def _device_of(stages) -> torch.device:
    for stage in stages:
        for p in stage.parameters():
            return p.device
    return torch.device("cpu")


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(text)


@functools.lru_cache(maxsize=16)
def _checked_schedule(schedule: Schedule) -> None:
    check(schedule)


def _validate(schedule, rank, world, stages, microbatch_inputs, loss_fn, shapes, stage_kwargs) -> None:
    """Local checks before the first transfer: each names the argument and the fix."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"run_schedule: schedule must be a meshkit Schedule, got {type(schedule).__name__}")
    if rank < 0:
        raise ValueError("run_schedule: this process is not a member of pp_group")
    if schedule.num_ranks != world:
        raise ValueError(f"run_schedule: schedule {schedule.name!r} has {schedule.num_ranks} ranks but pp_group "
                         f"has {world}; build the schedule with pp={world}")
    _checked_schedule(schedule)
    owner = schedule.stage_to_rank()
    mine = {s for s, r in enumerate(owner) if r == rank}
    if set(stages) != mine:
        raise ValueError(f"run_schedule: pp rank {rank} was given stages {sorted(stages)}, but schedule "
                         f"{schedule.name!r} runs stages {sorted(mine)} there; pass exactly those")
    m = schedule.num_microbatches
    if 0 in mine and (microbatch_inputs is None or len(microbatch_inputs) != m):
        got = None if microbatch_inputs is None else len(microbatch_inputs)
        raise ValueError(f"run_schedule: microbatch_inputs has {got} entries; the first stage needs one per "
                         f"microbatch ({m})")
    if schedule.num_stages - 1 in mine and loss_fn is None:
        raise ValueError("run_schedule: the last stage lives on this rank, so loss_fn is required")
    if stage_kwargs is not None and len(stage_kwargs) != m:
        raise ValueError(f"run_schedule: stage_kwargs has {len(stage_kwargs)} entries; pass one mapping per "
                         f"microbatch ({m}) or None")
    for a in (a for a in schedule.ranks[rank] if a.kind in _COMM):
        boundary = a.stage - 1 if a.kind in (K.RECV_F, K.SEND_B) else a.stage
        try:
            meta = _meta(shapes, boundary, a.microbatch)
        except (KeyError, TypeError):
            meta = None
        if not isinstance(meta, TensorMeta):
            raise ValueError(f"run_schedule: shapes gives no TensorMeta for the boundary after stage {boundary} "
                             f"(microbatch {a.microbatch}), which {a} transfers; declare every boundary")


# ---------------------------------------------------------------------------------------------- FSDP2


@contextlib.contextmanager
def _fsdp_reduce_once(stages: list[nn.Module], *, reduce_grads: bool, reshard: bool) -> Iterator[None]:
    """Accumulate unsharded gradients over the schedule's microbatches and reduce them once at its
    end (`reduce_grads`; off: a later call of the accumulation window reduces them), resharding the
    gathered parameters afterwards if `reshard` (off: ZeRO-1/2 keep them for the window's next call)."""
    roots = fsdp_roots(stages)
    for root in roots:
        root.set_requires_gradient_sync(False)
        root.set_reshard_after_backward(False)
        root.set_is_last_backward(False)
    yield  # on an exception the ranks disagree anyway; the flags stay off rather than reduce garbage
    for root in roots:
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(reshard)
        if reduce_grads:
            root.set_requires_gradient_sync(True)
            fsdp_post_backward(root)
        elif reshard:
            reshard_fsdp(root)
        root.set_requires_gradient_sync(True)
        root.set_reshard_after_backward(True)


