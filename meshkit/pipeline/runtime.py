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

from meshkit._compat.fsdp import fsdp_post_backward
from meshkit.data_parallel.fsdp import reshard_fsdp
from meshkit.data_parallel.zero_stages import fsdp_roots
from meshkit.pipeline.actions import ActionKind, Schedule
from meshkit.pipeline.p2p import TensorMeta, Transfer, Transfers, wire_tensor
from meshkit.pipeline.program import COMM, Compute, Post, compile_rank
from meshkit.pipeline.simulate import check
from meshkit.pipeline.weight_grad import PendingWeightGrads, collecting, deferrable_linears

__all__ = ["LossFn", "Shapes", "TensorMeta", "TraceEvent", "run_schedule"]

LossFn = Callable[[Any, int], torch.Tensor]
#: One meta for every boundary, one per boundary (keyed by the sending stage), or a function of
#: (boundary, microbatch) for microbatches of different sizes.
Shapes = TensorMeta | Mapping[int, TensorMeta] | Callable[[int, int], TensorMeta]

K = ActionKind
#: A receive is posted this many compute actions before the compute that consumes it (see `program`).
RECEIVE_LOOKAHEAD = 1
#: On gloo, up to this many steps earlier still, into a step where the rank waits anyway (see `program`).
#: 64 covers a whole step at pp=4, m=8 (a V schedule's rank runs 32-48 computes), so a rank that waits
#: for its first input posts every receive there: on ZB-V's critical path receive posting went from
#: 2.8 to 0.0 ms (16: the previous value), step 0.995x paired. The price is memory: up to 64 boundary
#: buffers (activations or their gradients) allocated ahead of their consumer on each rank.
RECEIVE_WINDOW = 64


class TraceEvent(NamedTuple):
    """One interval of a rank's step, on `time.perf_counter`'s clock (system-wide on Linux, so the
    ranks of one machine share it): `kind` is "call" (the whole `run_schedule`), "compute" (an F, B,
    W or BW, waits included), "stage" (inside a compute: the stage module and the loss, the autograd
    backward, or the deferred weight gradients: the model's own work, as opposed to the runtime's),
    "post" (transfers being started: each one by itself on gloo, one batch on a coalescing backend)
    or "wait" (blocked on a receive inside a compute); `what` is the action, or the tuple of actions
    posted."""

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
    splits = any(a.kind is K.W for a in schedule.ranks[rank])
    fsdp = (contextlib.nullcontext() if schedule.forward_only else
            _fsdp_reduce_once(list(stages.values()), reduce_grads=reduce_grads, reshard=reshard))
    current: Post | Compute | None = None
    with fsdp, (deferrable_linears(stages.values()) if splits else contextlib.nullcontext()):
        try:
            window = 0 if run.p2p.batched else RECEIVE_WINDOW  # NCCL matches in posting order: keep it
            for posts, compute in compile_rank(schedule, rank, RECEIVE_LOOKAHEAD, window):
                if posts:
                    current = posts[0]
                    run.post(posts)
                if compute is not None:
                    current = compute
                    run.compute(compute, splits)
        except Exception as exc:
            if current is not None:
                _note(exc, f"meshkit pipeline rank {rank} failed in {current.action} (position "
                           f"{current.position} of {len(schedule.ranks[rank])} in schedule {schedule.name!r})")
            raise
        run.finish()
    if trace is not None:
        trace.append(TraceEvent("call", schedule.name, entered, time.perf_counter()))
    return [run.losses[mb] for mb in sorted(run.losses)]


class _RankRun:
    """The state of one rank during one schedule: what each (stage, microbatch) still holds."""

    def __init__(self, schedule, rank, stages, group, microbatch_inputs, loss_fn, shapes, stage_kwargs, device,
                 trace=None):
        self.keep = not schedule.forward_only  # what backward needs; evaluation drops each tensor once used
        self.schedule = schedule
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

    def post(self, posts: Sequence[Post]) -> None:
        """Start these sends and receives (receives are waited on by their consumer).

        On gloo each transfer goes out on its own, in order, the moment it is built (a send is not held
        back while the receives after it are prepared); a coalescing backend gets them as one batch.
        """
        if self.trace is None and not self.p2p.batched:
            for p in posts:
                self.p2p.post_one(self._transfer(p))
            return
        if self.p2p.batched:
            start = time.perf_counter()
            self.p2p.post([self._transfer(p) for p in posts])
            if self.trace is not None:
                self.trace.append(TraceEvent("post", tuple(p.action for p in posts), start, time.perf_counter()))
            return
        for p in posts:
            start = time.perf_counter()
            self.p2p.post_one(self._transfer(p))
            self.trace.append(TraceEvent("post", (p.action,), start, time.perf_counter()))

    def compute(self, c: Compute, deferred: bool) -> None:
        """Run one F, B, BW or W."""
        start = time.perf_counter() if self.trace is not None else 0.0
        if c.kind is K.F:
            self._forward(c)
        elif c.kind is K.W:
            self.pending.pop((c.stage, c.microbatch)).run()
            if self.trace is not None:
                self.trace.append(TraceEvent("stage", c.action, start, time.perf_counter()))
        else:
            self._backward(c, deferred)
        if self.trace is not None:
            self.trace.append(TraceEvent("compute", c.action, start, time.perf_counter()))

    # ------------------------------------------------------------------ compute
    def _forward(self, c: Compute) -> None:
        s, mb = c.stage, c.microbatch
        up, last = self.schedule.upstream(s), self.schedule.downstream(s) is None
        if up is None:
            x = self.inputs[mb]
        else:
            if c.received is None:  # same tensor the wire would carry, without the wire
                x = wire_tensor(self.outputs[(up, mb)] if self.keep else self.outputs.pop((up, mb)))
            else:
                x = self._take(c)
            if self.keep:
                x.requires_grad_(x.is_floating_point())
                self.stage_inputs[(s, mb)] = x
        kwargs = self.stage_kwargs[mb] if self.stage_kwargs is not None else {}
        start = time.perf_counter() if self.trace is not None else 0.0
        out = self.stages[s](x, **kwargs)
        if last:
            out = self.loss_fn(out, mb)
            self.losses[mb] = out.detach()
        if self.trace is not None:
            self.trace.append(TraceEvent("stage", c.action, start, time.perf_counter()))
        if not last or self.keep:
            self.outputs[(s, mb)] = out

    def _backward(self, c: Compute, deferred: bool) -> None:
        s, mb = c.stage, c.microbatch
        out = self.outputs.pop((s, mb))
        grad, down = None, self.schedule.downstream(s)
        if down is not None:
            grad = self.input_grads.pop((down, mb)) if c.received is None else self._take(c)
            if isinstance(out, DTensor) and not isinstance(grad, DTensor):
                grad = DTensor.from_local(grad, out.device_mesh, out.placements, run_check=False,
                                          shape=out.shape, stride=out.stride())
        start = time.perf_counter() if self.trace is not None else 0.0
        if deferred:
            pending = PendingWeightGrads()
            with collecting(pending):
                torch.autograd.backward(out, grad)
            if c.kind is K.BW:
                pending.run()
            else:
                self.pending[(s, mb)] = pending
        else:  # no W on this rank: nothing is deferred, BW is one plain backward
            torch.autograd.backward(out, grad)
        if self.trace is not None:
            self.trace.append(TraceEvent("stage", c.action, start, time.perf_counter()))
        if self.schedule.upstream(s) is not None:
            x = self.stage_inputs.pop((s, mb))
            self.input_grads[(s, mb)] = x.grad if x.grad is not None else torch.zeros_like(x)

    # ------------------------------------------------------------- transfers
    def _take(self, c: Compute) -> torch.Tensor:
        if self.trace is None:
            return self.p2p.take(c.received)
        start = time.perf_counter()
        tensor = self.p2p.take(c.received)
        self.trace.append(TraceEvent("wait", c.receive, start, time.perf_counter()))
        return tensor

    def _transfer(self, p: Post) -> Transfer:
        s, mb = p.stage, p.microbatch
        if not p.send:
            meta = _meta(self.shapes, p.boundary, mb)
            return Transfer(False, p.peer, p.tag, torch.empty(meta.shape, dtype=meta.dtype, device=self.device))
        if p.forward:
            out = self.outputs[(s, mb)] if self.keep else self.outputs.pop((s, mb))
            return Transfer(True, p.peer, p.tag, self._checked(wire_tensor(out), p.boundary, mb, "output"))
        grad = self.input_grads.pop((s, mb))
        return Transfer(True, p.peer, p.tag, self._checked(wire_tensor(grad), p.boundary, mb, "input gradient"))

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
    firsts = [s for s in mine if schedule.upstream(s) is None]
    if firsts and (microbatch_inputs is None or len(microbatch_inputs) != m):
        got = None if microbatch_inputs is None else len(microbatch_inputs)
        raise ValueError(f"run_schedule: microbatch_inputs has {got} entries; a first stage (stage {firsts[0]} "
                         f"here) needs one per microbatch of the schedule ({m}), indexed by microbatch")
    if any(schedule.downstream(s) is None for s in mine) and loss_fn is None:
        raise ValueError("run_schedule: a last stage lives on this rank, so loss_fn is required")
    if stage_kwargs is not None and len(stage_kwargs) != m:
        raise ValueError(f"run_schedule: stage_kwargs has {len(stage_kwargs)} entries; pass one mapping per "
                         f"microbatch ({m}) or None")
    if isinstance(shapes, TensorMeta):  # one meta for every boundary
        return
    for a in (a for a in schedule.ranks[rank] if a.kind in COMM):
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


