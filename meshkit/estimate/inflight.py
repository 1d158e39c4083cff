"""What a pipeline rank holds while its schedule runs: its actions replayed with each one's bytes.

The simulator's in-flight count (F to its W or BW) treats every microbatch alike; the bytes do not:
a rank's stages hold different blocks (the last one the head and the loss), and a schedule that
splits the backward (ZB-H1/H2, ZB-V, DualPipeV) keeps, between a microbatch's B and its W, only what
the weight gradients need: each deferred linear's input and its output gradient
(`meshkit.pipeline.weight_grad`), not the whole block's activations. Replaying the rank's actions
in order with those bytes gives the largest total and what it is made of; each backward adds its
transient on top (the loss's on the last stage, a block's recompute elsewhere). The dry run measured
the difference: a last stage under ZB-H2 held four times the loss transient in deferred head gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from meshkit.estimate.spec import ParamSpec, Workload, dtype_bytes
from meshkit.pipeline.actions import COMPUTE_KINDS
from meshkit.pipeline.costs import given
from meshkit.pipeline.schedules import build_schedule
from meshkit.plan import Plan


@dataclass(frozen=True)
class StageBytes:
    """One stage-microbatch pair: activations from its forward to its backward, and what a B/W schedule
    keeps from its B to its W (layer inputs, already activations, and output gradients, new)."""

    activations: int
    deferred_inputs: int = 0
    deferred_grads: int = 0
    transient: int = 0   # on top while its backward runs (loss backward or a block's recompute)
    last: bool = False   # the stage holding the loss
    weight_transient: int = 0  # on top while its W runs: the largest weight gradient it computes
    # What W leaves in the unsharded weights' `.grad` (compute dtype) under FSDP: its post-backward, which
    # folds them into the reduce-dtype accumulation, ran in B, so they wait for the next B (dry run)
    weight_grads: int = 0
    end_transient: int = 0  # on top as its backward ends (its first block's recompute)
    accumulated: int = 0    # the stage's unreduced gradients FSDP accumulates over the call (reduce dtype)
    accumulated_w: int = 0  # of them, the deferred linears' (made at the B after their W)


@dataclass(frozen=True)
class Held:
    """The rank's largest moment: activations alive then (deferred layer inputs included), deferred output
    gradients, the backward's transient, and whether the loss's backward was starting."""

    activations: int
    deferred_grads: int
    transient: int
    loss: bool
    pairs: int  # stage-microbatch pairs whose activations were alive (forward done, backward not)
    carried: int = 0  # the call's unreduced gradients, once the rank's first backward made them

    @property
    def total(self) -> int:
        """Bytes of the moment."""
        return self.activations + self.deferred_grads + self.transient + self.carried


@functools.lru_cache(maxsize=256)
def _compute_actions(schedule: str, pp: int, m: int, v: int, rank: int, costs: tuple[float, ...] = (),
                     memory_limit: int | None = None) -> tuple[tuple[str, int], ...]:
    # zb_auto is built as the runtime builds it: at the plan's `pp_costs` and `pp_memory_limit` (without
    # them the runtime times its first call and rebuilds from the measured costs, which no estimate knows)
    built = build_schedule(schedule, pp, m, v, costs=given(costs) if costs else None, memory_limit=memory_limit)
    return tuple((a.kind.value, a.stage) for a in built.ranks[rank] if a.kind in COMPUTE_KINDS)


def replay(plan: Plan, pp_rank: int, stages: dict[int, StageBytes]) -> Held:
    """Replay `pp_rank`'s compute actions under the plan's schedule with `stages`' bytes (by global
    stage); return the largest moment (after a forward, as a backward starts with its transient, as a
    B/W-split backward's B part ends, or as the rank's first backward ends).

    A stage's unreduced gradients (`accumulated`) appear with its own first backward, not the rank's
    (under GPipe the peak is that backward's end, one microbatch's activations freed). Under a B/W
    split FSDP's post-backward runs inside B, before the deferred linears have gradients: those land
    in `.grad` in the compute dtype (`weight_grads`) from W, or from a BW's own deferred products
    right after its B, and the stage's next B or BW folds them into the reduce-dtype accumulation
    (`accumulated_w`, made then) and frees them. The dry run measured it: a DualPipe rank's second
    stage holds both of its stages' `.grad`s and accumulations at its peak, which the replay, adding
    every stage's accumulation at the rank's first backward, placed at a moment without them (0.944).
    """
    actions = _compute_actions(plan.pp_schedule, plan.pp, plan.microbatches, plan.pp_stages_per_rank, pp_rank,
                               plan.pp_costs, plan.pp_memory_limit)
    split = any(kind == "W" for kind, _ in actions)
    act = grads = pairs = late = 0
    begun: set[int] = set()    # stages whose first backward has run: their accumulation exists
    holding: set[int] = set()  # stages whose deferred linears' gradients sit in `.grad` (compute dtype)
    folded: set[int] = set()   # stages whose deferred linears' accumulation exists
    backward = False
    best = Held(0, 0, 0, False, 0)

    def moment(transient: int = 0, loss: bool = False) -> None:
        nonlocal best
        best = max(best, Held(act, grads, transient, loss, pairs, late), key=lambda h: h.total)

    for kind, s in actions:
        b = stages[s]
        if kind in ("B", "BW"):
            moment(b.transient, b.last)
        elif kind == "W":
            moment(b.weight_transient)
        if kind == "F":
            act, pairs = act + b.activations, pairs + 1
        elif kind in ("B", "BW"):
            act, pairs = act - b.activations, pairs - 1
            if split:  # the B part: each deferred linear's input and output gradient kept for W
                act, grads = act + b.deferred_inputs, grads + b.deferred_grads
            if s not in begun:  # the post-backward makes the accumulation of what B computed
                begun.add(s)
                late += b.accumulated - (b.accumulated_w if split else 0)
            if s in holding:  # ... and folds the compute-dtype `.grad`s a W left
                holding.discard(s)
                grads -= b.weight_grads
                if s not in folded:
                    folded.add(s)
                    late += b.accumulated_w
            if not backward:
                backward = True
                moment(b.end_transient)
        if (kind == "BW" and split) or kind == "W":  # the W part: the deferred products into `.grad`
            moment()
            act, grads = act - b.deferred_inputs, grads - b.deferred_grads
            if s not in holding:
                holding.add(s)
                grads += b.weight_grads
        moment()
    return best


def largest_weight(plan: Plan, specs: Iterable[ParamSpec], kind: str) -> int:
    """Bytes of the largest weight gradient a W computes for one block of `kind` (compute dtype, TP shard)."""
    sizes = [spec.shape[0] * spec.shape[1] // (plan.tp if spec.tp_dim is not None else 1) for spec in specs
             if spec.unit == "block" and spec.kind == kind and len(spec.shape) == 2]
    return max(sizes, default=0) * dtype_bytes(plan.param_dtype)


def weight_bytes(plan: Plan, specs: Iterable[ParamSpec], kind: str) -> int:
    """Bytes of every weight gradient a W computes for one block of `kind` (compute dtype, TP shard)."""
    return sum(spec.shape[0] * spec.shape[1] // (plan.tp if spec.tp_dim is not None else 1) for spec in specs
               if spec.unit == "block" and spec.kind == kind and len(spec.shape) == 2) * dtype_bytes(plan.param_dtype)


def deferred_bytes(config: Any, plan: Plan, workload: Workload, specs: Iterable[ParamSpec], kind: str) -> tuple[int, int]:
    """(layer inputs, output gradients) one block of `kind` keeps from its B to its W, on one rank.

    Every eager linear's weight gradient is deferred: a column-parallel one's input is the whole
    (gathered) sequence shard and its output gradient its share of the features; a row-parallel one's
    input is its share and its output gradient the whole width, before the reduce-scatter. Column-
    parallel (and replicated) linears of one sub-module reading the hidden state share one input
    (q/k/v, gate/up). Experts run as grouped GEMMs, whose gradients come in B.
    """
    tokens = workload.mbs * (workload.seq // plan.cp)
    h, act, tp = config.hidden_size, dtype_bytes(plan.param_dtype), plan.tp
    inputs = grads = 0
    reading_hidden: set[str] = set()  # sub-modules whose linears' shared hidden-state input is counted
    for spec in specs:  # a block's two-dimensional parameters are its linears' weights
        if spec.unit != "block" or spec.kind != kind or len(spec.shape) != 2:
            continue
        out, inp = spec.shape
        if spec.tp_dim == 1:  # row-parallel
            inputs, grads = inputs + tokens * inp // tp, grads + tokens * out
            continue
        grads += tokens * (out // tp if spec.tp_dim == 0 else out)
        group = spec.owner.split(".")[0]
        if inp != h:
            inputs += tokens * inp
        elif group not in reading_hidden:
            reading_hidden.add(group)
            inputs += tokens * inp
    return inputs * act, grads * act


def head_deferred_bytes(config: Any, plan: Plan, workload: Workload) -> tuple[int, int, int]:
    """(input, output gradient, weight gradient) of the LM head under a B/W split: the gathered final
    hidden state and the gradient of this rank's share of the logits, kept from B to W, and the weight
    gradient W computes, all in the compute dtype."""
    tokens = workload.mbs * (workload.seq // plan.cp)
    act, rows = dtype_bytes(plan.param_dtype), config.vocab_size // plan.tp
    return tokens * config.hidden_size * act, tokens * rows * act, rows * config.hidden_size * act
