"""One rank's memory at its peak: the moment the most bytes are alive, and what they are.

Model state and activations come from `memory`; here they meet the transient buffers of the moment
the peak happens (docs/estimate.md, "Peak"), checked against the dry run (`meshkit.dryrun`), which
measures the real step's live bytes by part: the loss's backward starting (last stage), a block's
backward (the head's buffers freed), or the optimizer's step. Gradients start each step from nothing;
FSDP keeps gathered what the plan keeps gathered, and carries what a window or pipeline accumulates.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from meshkit.data_parallel.rules import replicates_with_ddp, shards_with_fsdp
from meshkit.estimate import activations as acts
from meshkit.estimate import moe
from meshkit.estimate.inflight import (
    Held,
    StageBytes,
    _compute_actions,
    deferred_bytes,
    head_deferred_bytes,
    largest_weight,
    replay,
    weight_bytes,
)
from meshkit.estimate.memory import (
    block_activations,
    chunk_of_stage,
    edge_ranks,
    model_state,
    param_specs,
    recompute_working_set,
    stage_kinds,
    stage_ranks,
)
from meshkit.estimate.spec import ModelState, Workload, dtype_bytes
from meshkit.estimate.zero import ZeroMemory, gathered_bytes, gathered_elements, zero_memory
from meshkit.models import roles
from meshkit.pipeline.split import stages_of_rank
from meshkit.plan import Plan


@dataclass(frozen=True)
class RankMemory:
    """The memory of one pipeline rank at its peak (end of its last held forward)."""

    pp_rank: int
    state: ModelState
    per_kind: dict[str, dict[str, int]]  # one block of each kind the rank holds, one microbatch, by part
    held: dict[str, int]       # block-microbatches of each kind alive at the peak
    in_flight: int             # (stage, microbatch) pairs alive at the peak
    shared: int                # rotary cos/sin per in-flight pair
    head: dict[str, int]       # final norm, LM head and loss (last stage only)
    transient: int             # at the peak: loss backward buffers, or one block's recompute + gradients
    fsdp_buffers: int          # at the peak: gathered units, unreduced gradients in flight or carried
    offloaded: int = 0         # model state that Plan.offload keeps in host memory (or on disk)
    moment: str = "loss"       # where the peak is: "loss" (its backward starts), "block" (a block's
    #                            backward, the head's buffers gone) or "optimizer" (the step)
    grads_held: int = 0        # sharded gradients alive at the peak (earlier calls' of the step)
    head_freed: int = 0        # head activations already freed at the peak ("block" on the last stage)
    pipeline: Held | None = None  # pp > 1: the schedule's largest moment (`inflight.replay`)
    # Plan.activation_offload: per block of each kind, one microbatch, the bytes autograd saves, which
    # live in host memory from the block's forward to its backward; `activation_host` of them at the peak
    moved: dict[str, int] = dataclasses.field(default_factory=dict)
    activation_host: int = 0
    activation_host_peak: int = 0  # the most of them host memory holds in the step (the last forward's end)

    @property
    def held_blocks(self) -> int:
        """Block-microbatches alive at the peak, every kind."""
        return sum(self.held.values())

    @property
    def per_block(self) -> dict[str, int]:
        """One block, one microbatch, by part: the kind held most (the only kind of a uniform stack)."""
        if not self.per_kind:
            return {}
        return self.per_kind[max(self.per_kind, key=lambda k: (self.held.get(k, 0), k))]

    @property
    def activations(self) -> int:
        """Activation bytes held on the device at the peak (all in-flight microbatches). Under activation
        offload the moved bytes are in host memory, but in a block's backward for two blocks' worth: the
        block running, brought back, and the one before it, being brought back. As the loss's backward
        starts no block is back yet and every copy out is done (the dry run measured none there; on an
        accelerator the last block's copies may still be in flight, its sources held by the allocator
        until the side stream is done: at most one block more)."""
        restored = 2 * max(self.moved.values(), default=0) if self.moment != "loss" else 0
        offloaded = restored - self.activation_host
        if self.pipeline is not None:
            return self.pipeline.activations + offloaded
        blocks = sum(n * sum(self.per_kind[k].values()) for k, n in self.held.items())
        return blocks + self.in_flight * self.shared + sum(self.head.values()) + offloaded

    @property
    def state_at_peak(self) -> int:
        """Model state on the device at the peak: parameter shards, optimizer state and the gradient shards
        alive then (none under offload, which keeps them in host memory)."""
        if self.offloaded:
            return 0
        if self.moment == "optimizer":
            return self.state.persistent
        return self.state.param_bytes + self.state.optimizer_bytes + self.grads_held

    @property
    def peak(self) -> int:
        """Peak device bytes at `moment`: model state, activations and transient buffers alive then."""
        if self.moment == "optimizer":
            return self.state_at_peak + self.transient
        return self.state_at_peak + self.activations - self.head_freed + self.transient + self.fsdp_buffers


def allgather_kv_bytes(config: Any, plan: Plan, workload: Workload) -> int:
    """What the all-gather CP kind holds per block beyond the ring: the other ranks' K/V, gathered in
    forward and kept for backward ((ring - 1) local [K; V] shards, K/V heads as Ulysses replicates them)."""
    _, kv, d = roles.kernel_dims(config)
    uly = plan.ulysses_degree
    kv_tp = kv // plan.tp
    rep = uly // math.gcd(kv_tp, uly) if kv_tp % uly else 1
    kv_local = workload.mbs * (workload.seq // plan.cp) * kv_tp * rep * d
    return (plan.cp // uly - 1) * 2 * kv_local * dtype_bytes(plan.param_dtype)


def rank_memory(config: Any, plan: Plan, workload: Workload, pp_rank: int, in_flight: int = 1, *,
                tp_rank: int = 0, fsdp_rank: int = 0, cp_rank: int | None = None) -> RankMemory:
    """The peak of pipeline rank `pp_rank`, holding `in_flight` (stage, microbatch) pairs' activations
    at once (the pipeline simulator's peak for that rank; 1 without pipelining); its shards are those
    of `tp_rank` and `fsdp_rank` (uneven splits differ by a row per tensor); `cp_rank` (default: the
    last, the most) sets how many ring steps' outputs selective AC keeps."""
    plan = plan.resolve_cp(config)  # "auto" / unset keep-K/V: the kind parallelize runs
    state = model_state(config, plan, pp_rank=pp_rank, tp_rank=tp_rank, fsdp_rank=fsdp_rank)
    seq, ac, sp = workload.seq // plan.cp, plan.activation_checkpointing, plan.sequence_parallel
    kw = dict(batch=workload.mbs, seq=seq, tp=plan.tp, dtype=plan.param_dtype)
    last = pp_rank in edge_ranks(plan)[1]
    head = acts.head_activations(config, sequence_parallel=sp, loss_parallel=plan.loss_parallel, **kw) if last else {}
    stages = stage_kinds(config, plan)[pp_rank]
    on_rank = sorted({k for stage in stages for k in stage})
    per_kind = {k: _cp_adjusted(block_activations(config, sequence_parallel=sp, ac=ac, kind=k, **kw),
                                config, plan, workload, cp_rank) for k in on_rank}
    recompute = max((recompute_working_set(config, sequence_parallel=sp, ac=ac, kind=k, **kw)
                     for k in on_rank), default=0)
    # In-flight pairs may be of any of the rank's stages: the one holding the most bytes sets the peak.
    heaviest = max(stages, key=lambda st: sum(n * sum(per_kind[k].values()) for k, n in st.items()))
    held = {k: in_flight * n for k, n in heaviest.items()}
    memory = RankMemory(pp_rank, state, per_kind, held, in_flight, acts.shared_activations(config, **kw), head,
                        0, 0)
    options = zero_memory(plan, state, config)
    held_grads, carried = _gradients_held(plan, workload, state, options)
    kept, moving = _fsdp_gathered(config, plan, state)
    moments = [dataclasses.replace(memory, moment="block", transient=recompute, fsdp_buffers=moving + carried,
                                   grads_held=held_grads, head_freed=sum(head.values()))]
    loss = acts.loss_transient(config, loss_parallel=plan.loss_parallel, **kw) if last else 0
    if plan.pp > 1:  # the schedule's largest moment, by replaying the rank's actions with their bytes
        # a window's earlier calls left their unreduced gradients; this call's appear with its first backward
        early = carried if workload.calls(plan) > 1 and plan.grad_sync == "last_microbatch" else 0
        stage_bytes = _stage_bytes(config, plan, workload, pp_rank, per_kind, memory.shared, head, loss, recompute,
                                   state, carried - early)
        pipe = replay(plan, pp_rank, stage_bytes)
        moments = [dataclasses.replace(memory, moment="loss" if pipe.loss else "block", pipeline=pipe,
                                       in_flight=pipe.pairs, transient=pipe.transient + pipe.deferred_grads,
                                       fsdp_buffers=(kept if pipe.loss else moving) + early + pipe.carried,
                                       grads_held=held_grads)]
    elif last:
        moments.append(dataclasses.replace(memory, moment="loss", transient=loss, fsdp_buffers=kept + carried,
                                           grads_held=held_grads))
    if options.full_grads and plan.pp == 1:  # ZeRO-1: a call's backward ends with every unit's unreduced
        # gradient beside the gathered parameters, its activations gone (a window's own accumulation, if any)
        moments.append(dataclasses.replace(memory, moment="block", held={}, in_flight=0, head={}, fsdp_buffers=kept
                                           + max(options.full_grads, carried), grads_held=held_grads))
    if not options.host:  # AdamW's step (foreach): a square root of the second moments beside the state
        moments.append(dataclasses.replace(memory, moment="optimizer", transient=state.param_bytes))
    if plan.activation_offload:  # what autograd saves: every activation, or under AC the block inputs
        moved = {k: sum((per_kind[k] if ac == "none" else block_activations(
            config, sequence_parallel=sp, ac="full", kind=k, **kw)).values()) for k in on_rank}
        moments = [dataclasses.replace(m, moved=moved, activation_host=m.in_flight * sum(
            n * moved[k] for k, n in heaviest.items())) for m in moments]
        if plan.pp == 1 and options.sharded and state.blocks > 1:
            moments.append(_late_offloaded_block(config, plan, memory, state, moved, recompute,
                                                 moving + carried, held_grads))
        most = max(m.activation_host for m in moments)  # as the last forward ends, every block's copies
        moments = [dataclasses.replace(m, activation_host_peak=most) for m in moments]
    best = max(moments, key=lambda m: m.peak)
    return dataclasses.replace(best, offloaded=options.host)


def _late_offloaded_block(config: Any, plan: Plan, memory: RankMemory, state: ModelState, moved: dict[str, int],
                          recompute: int, fsdp_buffers: int, held_grads: int) -> RankMemory:
    """Under activation offload, the backward of the stack's second block: the device holds two blocks'
    activations at every block's backward (the one running and the one before it, brought back), so
    the moment with the most is the last with two, once every later unit's gradient shard exists (the
    dry run measured it on a small model, 12% above the first block's backward, the estimate's moment
    before). The embedding's shard comes last (with tied embeddings, the head's too: one unit)."""
    kinds = moe.block_kinds(config)[:2]
    held = {k: kinds.count(k) for k in set(kinds)}
    units, edges = _grad_elements(state)
    tied = getattr(config, "tie_word_embeddings", False)
    total = sum(u.count * units[u.kind] for u in state.block_units) + edges["embed"] + (0 if tied else edges["head"])
    pending = sum(units.get(k, 0) for k in kinds) + edges["embed"]
    reduced = state.grad_bytes * (total - pending) // total if total else 0
    return dataclasses.replace(memory, moment="block", held=held, in_flight=1, transient=recompute,
                               fsdp_buffers=fsdp_buffers, grads_held=held_grads + reduced,
                               head_freed=sum(memory.head.values()), moved=moved,
                               activation_host=sum(n * moved[k] for k, n in held.items()))


def _stage_bytes(config: Any, plan: Plan, workload: Workload, pp_rank: int, per_kind: dict[str, dict[str, int]],
                 shared: int, head: dict[str, int], loss: int, recompute: int, state: ModelState,
                 carried: int) -> dict[int, StageBytes]:
    """Each of the rank's stages, one microbatch: its activations, what a B/W schedule defers to W
    (`inflight.deferred_bytes`), its backward's transient, and its share of the `carried` unreduced
    gradients (by its units' elements with gradients)."""
    placement = stage_ranks(plan)
    # The stages running the last chunk end in the head and the loss: under DualPipe two of them, one per
    # direction (pp rank pp-1's and, its mirror, rank 0's), not only the last stage id (found by the dry run).
    chunks = chunk_of_stage(plan)
    split = any(kind == "W" for kind, _ in _compute_actions(plan.pp_schedule, plan.pp, plan.microbatches,
                                                             plan.pp_stages_per_rank, pp_rank))
    specs = param_specs(config)[0] if split else ()
    deferred = {k: deferred_bytes(config, plan, workload, specs, k) for k in per_kind} if split else {}
    weights = {k: largest_weight(plan, specs, k) for k in per_kind} if split else {}
    fsdp = shards_with_fsdp(plan)
    stage_weights = {k: weight_bytes(plan, specs, k) for k in per_kind} if split and fsdp else {}
    # A stage's output ([mbs, s/cp, h], this rank's s/tp under SP) stays in the runtime's outputs until
    # the microbatch's backward is called on it; no block saves it (measured by the dry run: one
    # residual-stream tensor per in-flight microbatch on every stage but the last).
    sp = plan.tp if (plan.tp > 1 and plan.sequence_parallel) else 1
    output = workload.mbs * (workload.seq // plan.cp) // sp * config.hidden_size * dtype_bytes(plan.param_dtype)
    out = {}
    stages = list(zip(stages_of_rank(pp_rank, placement), stage_kinds(config, plan)[pp_rank]))
    shares = _gradient_shares(state, [(kinds, chunks[stage] == 0, chunks[stage] == max(chunks))
                                      for stage, kinds in stages], carried)
    red = dtype_bytes(plan.reduce_dtype) / dtype_bytes(plan.param_dtype)
    for (stage, kinds), accumulated in zip(stages, shares):
        last = chunks[stage] == max(chunks)
        activations = sum(n * sum(per_kind[k].values()) for k, n in kinds.items()) + shared + \
            (sum(head.values()) if last else output)
        transient = loss if last else recompute
        if not split:
            out[stage] = StageBytes(activations, transient=transient, last=last, end_transient=recompute,
                                    accumulated=accumulated)
            continue
        inputs = sum(n * deferred[k][0] for k, n in kinds.items())
        grads = sum(n * deferred[k][1] for k, n in kinds.items())
        weight = max((weights[k] for k in kinds), default=0)
        # B holds a block's output gradients for W as it goes: the first block's are on top at once
        transient += max((deferred[k][1] for k in kinds), default=0)
        held = sum(n * stage_weights.get(k, 0) for k, n in kinds.items())
        if last:
            head_in, head_grad, head_weight = head_deferred_bytes(config, plan, workload)
            inputs, grads, weight = inputs + head_in, grads + head_grad, max(weight, head_weight)
            held += head_weight if fsdp else 0
        out[stage] = StageBytes(activations, inputs, grads, transient, last, weight, held, recompute,
                                accumulated, min(int(held * red), accumulated))
    return out


def _grad_elements(state: ModelState) -> tuple[dict[str, int], dict[str, int]]:
    """(one block's gathered elements with gradients by kind, experts included; the same of the
    embedding and head units)."""
    return {u.kind: u.block_grad + u.expert_grad for u in state.block_units}, state.grad_unit_elements


def _gradient_shares(state: ModelState, stages: list[tuple[dict[str, int], bool, bool]], carried: int) -> list[int]:
    """`carried` split over a rank's stages ((blocks by kind, runs the first chunk, runs the last chunk)
    each) by the gathered elements with gradients of their FSDP units; the remainder of the integer
    division goes to the first."""
    units, edges = _grad_elements(state)
    weights = [sum(n * units.get(k, 0) for k, n in kinds.items()) + (edges["embed"] if first else 0)
               + (edges["head"] if last else 0) for kinds, first, last in stages]
    total = sum(weights)
    if not total:
        return [carried] + [0] * (len(stages) - 1)
    shares = [carried * w // total for w in weights]
    shares[0] += carried - sum(shares)
    return shares


def _gradients_held(plan: Plan, workload: Workload, state: ModelState, options: ZeroMemory) -> tuple[int, int]:
    """(sharded gradient bytes, unreduced gradient bytes) alive while a step's last backward runs.

    A step's gradients start from nothing (the recipes' `zero_grad(set_to_none=True)`). Earlier calls
    of the step leave their sharded gradients when each call reduces (ZeRO-2/3 syncing every call),
    or their unreduced ones when the window reduces once (ZeRO-1, `grad_sync="last_microbatch"`);
    a pipeline call accumulates every unit's unreduced gradient over its microbatches, reducing after
    the last (the dry run measured it: under TP's styles the embedding's is vocabulary-wide, `zero.zero_memory`).
    Without FSDP, gradients are the parameters' own and accumulate over calls and microbatches alike.
    """
    calls = workload.calls(plan)
    if replicates_with_ddp(plan):  # DDP's buckets hold every gradient from the first forward on, and
        # backward accumulates in them (`data_parallel.replicate` points gradients back at their views)
        return state.grad_bytes, 0
    if not options.sharded:
        return (state.grad_bytes if calls > 1 or plan.pp > 1 else 0), 0
    per_call = plan.grad_sync == "every_microbatch"  # ZeRO-1 too: a reduce-scatter after each call's backward
    carried = options.full if plan.pp > 1 or (calls > 1 and not per_call) else 0
    return (state.grad_bytes if calls > 1 and per_call else 0), carried


def _fsdp_gathered(config: Any, plan: Plan, state: ModelState) -> tuple[int, int]:
    """(bytes FSDP keeps gathered when the last forward ends, bytes gathered or in flight while a block's
    backward runs), compute-dtype parameters and that block's unreduced gradient.

    ZeRO-3 without pipelining reshards every unit after its forward but the stage's last block and
    the [norm, lm_head] unit after it (`data_parallel.fsdp`; with tied embeddings, which live in the
    root unit FSDP reshards, the last block alone), and in backward gathers a block while prefetching the next, beside the block's gradient in
    the compute dtype and its reduce-scatter input in the reduce dtype. ZeRO-1/2 and pipelining keep
    every unit gathered.
    """
    if not zero_memory(plan, state).sharded:
        return 0, 0
    act, red = dtype_bytes(plan.param_dtype), dtype_bytes(plan.reduce_dtype)
    units = state.unit_elements
    block = max((u.block + u.expert for u in state.block_units), default=0)
    if plan.pp > 1 or not plan.fsdp_reshard:  # float8 projection weights are gathered in one byte each
        everything = gathered_bytes(plan, gathered_elements(state), state.float8_elements)
        return everything, everything + block * act
    tied = getattr(config, "tie_word_embeddings", False)
    head_last = units["head"] and not tied
    tail = state.block_units[-1] if state.block_units else None
    last = (units["head"] if head_last or tail is None else 0) + (tail.block if tail is not None else 0)
    last_float8 = tail.float8 if tail is not None else 0
    unit = max(units.values())
    unit_float8 = max((u.float8 for u in state.block_units if u.block == unit), default=0)
    return gathered_bytes(plan, last, last_float8), 2 * gathered_bytes(plan, unit, unit_float8) + unit * (act + red)


def ring_outputs_kept(plan: Plan, cp_rank: int | None) -> tuple[int, int]:
    """(numerator, denominator) of the local (out, lse) a ring rank computes over its steps, each kept
    by selective AC: under causal attention the contiguous layout's rank r computes r + 1 blocks (later
    ones are masked whole and skipped); the zig-zag rank r its diagonal, r whole blocks and, from later
    ranks, its second half's queries only (half an output each). USP's ring runs over cp / ulysses ranks
    (cp rank = ring rank x ulysses + ulysses rank). Default: the ring's last rank, which computes every
    block whole. Measured by the dry run (rank 0 of a ring of 4 keeps 1, of a zig-zag 2.5, not 4)."""
    ring = plan.cp // plan.ulysses_degree
    r = ring - 1 if cp_rank is None else cp_rank // plan.ulysses_degree
    if plan.cp_layout == "contiguous":
        return r + 1, 1
    return 2 + 2 * r + (ring - 1 - r), 2


def _cp_adjusted(per_block: dict[str, int], config: Any, plan: Plan, workload: Workload,
                 cp_rank: int | None = None) -> dict[str, int]:
    """One block's bytes with what the plan's CP kind keeps beyond the traced SDPA call."""
    kind = getattr(plan, "cp_attention", "zigzag")
    ac = plan.activation_checkpointing
    if ac == "selective" and plan.cp > 1 and kind in ("ring", "zigzag", "usp"):
        # meshkit's policy saves every kernel output, so each ring step's partial (out, lse) is kept
        num, den = ring_outputs_kept(plan, cp_rank)
        per_block["attention"] = per_block.get("attention", 0) * num // den
    elif ac == "selective" and plan.cp > 1 and kind == "allgather":
        # two kernel calls per local query chunk (key prefix, causal diagonal), each output kept
        per_block["attention"] = per_block.get("attention", 0) * 2
    if ac == "none" and plan.cp > 1 and (kind == "allgather" or getattr(plan, "cp_keep_kv", False)):
        # the other ranks' K/V held from forward to backward (the ring with cp_keep_kv keeps what it received)
        per_block["attention"] = per_block.get("attention", 0) + allgather_kv_bytes(config, plan, workload)
    if ac == "none" and plan.cp > 1:
        # The CP kernels return [B, H, S, D] laid out as such, so HF's transpose to o_proj's [B, S, H*D]
        # input copies it and o_proj keeps the copy beside the kernel's own output (SDPA's output is
        # laid out [B, S, H, D] already, so there the two share storage); measured by the dry run.
        heads, _, d_v = roles.score_value_dims(config)
        tokens = workload.mbs * (workload.seq // plan.cp)
        per_block["attention"] = per_block.get("attention", 0) + \
            tokens * (heads // plan.tp) * d_v * dtype_bytes(plan.param_dtype)
    return per_block
