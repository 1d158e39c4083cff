"""Communication of one training step under a plan: every collective, its link and what overlap hides.

Counted in `comm_counter.CommCounter`'s unit (a collective's full logical buffer per call) so tests can
compare the two byte for byte on a CPU mesh; `Collective.wire` converts to what a rank sends under
ring algorithms. docs/estimate.md derives each entry.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from meshkit.data_parallel.fsdp import BUCKET_BYTES, bucket_runs, buckets_units
from meshkit.data_parallel.replicate import BUCKET_MB
from meshkit.data_parallel.rules import replicates_with_ddp, shards_with_fsdp
from meshkit.estimate import moe
from meshkit.estimate.memory import float8_weights_per_block, stage_ranks
from meshkit.estimate.spec import Device, ModelState, Workload, dtype_bytes
from meshkit.estimate.zero import gathered_bytes
from meshkit.mesh import AXES
from meshkit.models import roles
from meshkit.pipeline.schedules import pipelines
from meshkit.plan import Plan


@dataclass(frozen=True)
class Collective:
    """One kind of collective on one axis, per step, on one rank.

    `buffer` is the collective's full logical buffer per call (all-gather output, reduce-scatter
    input, all-reduce tensor, all-to-all input, P2P message), the unit `comm_counter.CommCounter`
    counts; `wire` is what one rank sends under ring algorithms.
    """

    axis: str
    kind: str
    what: str
    calls: int
    buffer: float
    group: int
    bandwidth: float
    link: str
    exposed: float = 0.0

    @property
    def wire(self) -> float:
        """Bytes this rank sends over the link for all calls of this collective."""
        n = self.group
        factor = {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_reduce": 2 * (n - 1) / n,
                  "all_to_all": (n - 1) / n}.get(self.kind, 1.0)
        return self.calls * self.buffer * factor

    def time(self, latency: float = 0.0) -> float:
        """Seconds the calls take: wire bytes over the link bandwidth plus a latency per call."""
        return self.wire / self.bandwidth + self.calls * latency


def axis_link(plan: Plan, axis: str, device: Device) -> tuple[str, float]:
    """(link name, bandwidth) of an axis's groups: NVLink when a group's ranks share a node.

    Ranks are laid out by the mesh order, tp innermost, so a group of axis a spans the product of
    a's size and every axis inside it; the flattened FSDP axis spans dp_shard's extent, and so does
    the expert-FSDP axis (the outer factor of dp_shard x cp once ep is taken out).
    """
    if axis == "ep":  # ep neighbouring ranks of the flattened dp_shard x cp axis
        span = plan.ep * plan.tp
    else:
        peers = "pp" if plan.pp > 1 else ("cp" if plan.cp > 1 else "tp")  # pp_cp_tp: its outermost axis above 1
        outer = {"dp_shard_cp": "dp_shard", "ep_fsdp": "dp_shard", "dp_cp_tp": "dp_replicate",
                 "pp_cp_tp": peers, "pp_ends": "pp", "pp_mirror": "pp"}.get(axis, axis)
        span = math.prod(getattr(plan, a) for a in AXES[AXES.index(outer):])
    if span <= device.gpus_per_node:
        return "nvlink", device.nvlink_bw
    return "ib", device.ib_bw


@dataclass(frozen=True)
class FsdpUnit:
    """FSDP2 units of one kind on one rank: what its all-gathers and reduce-scatters move, and what
    host offload copies across the host link around them."""

    name: str       # "embed", "block", "head" or "expert"
    count: int      # units of this kind on the rank
    elements: int   # one unit as gathered (TP-local, padded rows)
    group: int      # ranks its parameters are sharded over
    axis: str       # the mesh axis of that group: "dp_shard_cp", or "ep_fsdp" for experts
    regather: bool  # freed after forward and gathered again for backward (ZeRO-3 resharding)
    grad_elements: int = -1  # of `elements`, those with gradients (frozen LoRA bases have none); -1: all
    float8: int = 0  # of `elements`, the projection weights gathered in float8 (float8="tensorwise")

    def __post_init__(self) -> None:
        if self.grad_elements < 0:
            object.__setattr__(self, "grad_elements", self.elements)


def fsdp_units(config: Any, plan: Plan, state: ModelState) -> list[FsdpUnit]:
    """The FSDP2 units the rank holding `state` gathers, in the order comm reports them.

    A tied weight lives in FSDP's root unit with the final norm (FSDP2 never reshards the root), so
    without pipelining it counts as part of the head unit. The embedding unit is gathered first and
    never again (its backward reads only the token ids); the head unit is the last and is never
    resharded after forward (the tied root is), nor is each stage's last block (`data_parallel.fsdp`:
    backward needs it next), counted against the kind of the model's last block. Under a V the first
    and last stage share pp rank 0: a tied embedding is two units there (the embedding, and the head's
    copy, which its backward does read).
    """
    units, grads = state.unit_elements, state.grad_unit_elements
    fsdp, reshard = plan.dp_shard * plan.cp, plan.fsdp_reshard
    tied = getattr(config, "tie_word_embeddings", False)
    root = units["embed"] and tied and plan.pp == 1  # the tied weight lives in the stage's root unit
    if root:
        units = {**units, "embed": 0, "head": units["embed"] + units["head"]}
        grads = {**grads, "embed": 0, "head": grads["embed"] + grads["head"]}
    ends = stage_ranks(plan)
    copies = 2 if tied and plan.pp > 1 and ends[0] == ends[-1] else 1
    # A stack mixing dense and MoE blocks has a unit of each kind ("dense block", "MoE block"). Each
    # stage's last block is never resharded after forward (`data_parallel.fsdp`: backward needs it
    # next, after [norm, lm_head] or the tied root, which is resharded, found by the dry run).
    mixed, last_kind = len(set(moe.block_kinds(config))) > 1, moe.block_kinds(config)[-1]
    stages = plan.pp_stages_per_rank if plan.pp > 1 else 1
    blocks = []
    for b in state.block_units:
        kept = min(stages, b.count) if reshard and b.kind == last_kind else 0
        name = _BLOCK_NAMES[b.kind] if mixed else "block"
        blocks += [FsdpUnit(name, n, b.block, fsdp, "dp_shard_cp", again, b.block_grad, b.float8)
                   for n, again in ((b.count - kept, reshard), (kept, False)) if n]
    out = [*blocks, FsdpUnit("embed", int(bool(units["embed"])), units["embed"], fsdp, "dp_shard_cp", False,
                             grads["embed"])]
    if copies == 2:
        out.append(FsdpUnit("embed", int(bool(units["embed"])), units["embed"], fsdp, "dp_shard_cp", reshard,
                            grads["embed"]))
    out.append(FsdpUnit("head", int(bool(units["head"])), units["head"], fsdp, "dp_shard_cp",
                        bool(root) and reshard, grads["head"]))
    out += [FsdpUnit("expert", b.count, b.expert, fsdp // plan.ep, "ep_fsdp", reshard, b.expert_grad)
            for b in state.block_units if b.kind == "moe"]
    out = [u for u in out if u.count]
    return _in_buckets(config, plan, out, grouped=not root) if buckets_units(plan) else out


def _in_buckets(config: Any, plan: Plan, units: list[FsdpUnit], grouped: bool) -> list[FsdpUnit]:
    """`units` as the code groups them under ZeRO-1/2 (`data_parallel.fsdp.units_in_buckets`): the
    embedding, each block in layer order and the head, consecutive ones merged up to `BUCKET_BYTES` of
    gathered parameters, each group one unit ("blocks" when it holds a block). The code weighs a unit
    by its unpadded elements, this by its padded rows (at most a row per tensor more). A tied root (the
    "head" unit when not `grouped`) and the experts stay apart, as in the code."""
    dense = {u.name: u for u in units if u.axis == "dp_shard_cp"}
    order = [dense["embed"]] if "embed" in dense else []
    mixed = len(set(moe.block_kinds(config))) > 1
    for kind in moe.block_kinds(config):
        unit = dense.get(_BLOCK_NAMES[kind] if mixed else "block")
        order += [unit] if unit is not None else []
    tail = [dense["head"]] if "head" in dense else []
    order += tail if grouped else []
    act = dtype_bytes(plan.param_dtype)
    groups = [[order[i] for i in run] for run in bucket_runs([u.elements * act for u in order], BUCKET_BYTES)]
    if all(len(g) == 1 for g in groups):  # nothing small enough to share a bucket
        return units
    merged: dict[tuple, FsdpUnit] = {}  # equal groups counted as one kind, in order
    for g in groups:
        unit = g[0] if len(g) == 1 else FsdpUnit(
            "blocks", 1, sum(u.elements for u in g), g[0].group, g[0].axis, False,
            sum(u.grad_elements for u in g), sum(u.float8 for u in g))
        key = (unit.name, unit.elements, unit.grad_elements, unit.float8)
        merged[key] = dataclasses.replace(unit, count=merged[key].count + 1 if key in merged else 1)
    return [*merged.values(), *([] if grouped else tail), *(u for u in units if u.axis != "dp_shard_cp")]


_BLOCK_NAMES = {"dense": "dense block", "moe": "MoE block"}


def _is_block(unit_name: str) -> bool:
    return unit_name.endswith(("block", "blocks"))


def communication(config: Any, plan: Plan, workload: Workload, device: Device, state: ModelState,
                  t_block_fwd: float, t_block_rec: float, *, pp_rank: int | None = None) -> list[Collective]:
    """Every collective the rank holding `state` issues per step, with the time overlap cannot hide.

    TP/SP and Ulysses collectives sit between matmuls (nothing to hide behind in meshkit), so all
    their time is exposed; FSDP's all-gather of the next block hides behind the current block's
    forward and its reduce-scatter behind the next backward; ring attention sends the next K/V
    block while the current one is computed, the all-gather kind its one gather per layer while the
    causal diagonals are. Recompute re-issues what it re-runs: the SP
    all-gathers under selective AC (their outputs are not saved), plus the attention-side
    reduce-scatter under full AC (non-reentrant checkpoint stops once the last saved tensor is back,
    before the MLP's reduce-scatter). Pipeline messages are the busiest pipeline rank's, or `pp_rank`'s.
    """
    plan = plan.resolve_cp(config)  # "auto" / unset keep-K/V: the kind parallelize runs
    heads, kv, d = roles.kernel_dims(config)  # what CP moves (MLA: padded to one head dim)
    h, act = config.hidden_size, dtype_bytes(plan.param_dtype)
    m, mbs, seq = workload.microbatches, workload.mbs, workload.seq // plan.cp
    ac, blocks, out = plan.activation_checkpointing, state.blocks, []
    lat = device.latency_s

    def add(axis: str, kind: str, what: str, calls: int, buffer: float, group: int, hidden_by: float | None) -> None:
        if calls <= 0 or group <= 1 or buffer <= 0:
            return
        link, bw = axis_link(plan, axis, device)
        c = Collective(axis, kind, what, calls, buffer, group, bw, link)
        per_call = c.time(lat) / calls
        exposed = c.time(lat) if hidden_by is None else calls * max(0.0, per_call - hidden_by)
        out.append(dataclasses.replace(c, exposed=exposed))

    experts = moe.model_experts(config)
    kind_blocks = {b.kind: b.count for b in state.block_units}
    moe_blocks, dense_blocks = kind_blocks.get("moe", 0), kind_blocks.get("dense", 0)
    fsdp_applied = shards_with_fsdp(plan)
    # Sums meshkit issues on gradient shards (MoE weights over tp, tied copies over pp) run per call,
    # on what FSDP reduced: once per window when gradients sync only on the window's last call.
    shard_sums = 1 if fsdp_applied and plan.grad_sync == "last_microbatch" else workload.calls(plan)
    if plan.tp > 1:
        t, bsh = plan.tp, mbs * seq * h * act
        first, last_stage = state.unit_elements["embed"] > 0, state.unit_elements["head"] > 0
        edges = int(first) + int(last_stage)  # embedding output and LM-head input cross the SP boundary
        if plan.sequence_parallel:
            # A dense block gathers before attention and MLP; an MoE block's MLP half routes the rank's
            # own sequence shard, so only attention gathers: its recompute re-runs that gather (any AC)
            # and attention's reduce-scatter (full AC; selective keeps its output). A mixed stack sums both.
            rec_ag, rec_rs = {"none": (0, 0), "selective": (2, 0), "full": (2, 1)}[ac]
            moe_rec_ag, moe_rec_rs = {"none": (0, 0), "selective": (1, 0), "full": (1, 1)}[ac]
            what = {(True, False): ("attention/MLP inputs", "o/down outputs", "conjugates"),
                    (False, True): ("attention inputs", "o outputs", "conjugate")}.get(
                (dense_blocks > 0, moe_blocks > 0), ("attention (+MLP in dense blocks) inputs",
                                                     "o (+down in dense blocks) outputs", "conjugates"))
            free = state.grad_free_edges  # a LoRA model's backward stops before the first adapter
            add("tp", "all_gather", f"SP: {what[0]} (fwd), RS {what[2]} (bwd), recompute",
                m * (dense_blocks * (4 + rec_ag) + moe_blocks * (2 + moe_rec_ag) + edges - free), bsh, t, None)
            add("tp", "reduce_scatter", f"SP: {what[1]} (fwd), AG {what[2]} (bwd), recompute",
                m * (dense_blocks * (4 + rec_rs) + moe_blocks * (2 + moe_rec_rs) + edges - free), bsh, t, None)
        if plan.sequence_parallel:
            # replicated norm weights see a sequence shard: their Partial gradients are summed over tp where
            # the gradient is: per call in the compute dtype, or in the reduce dtype where FSDP keeps the
            # unsharded gradient in it (a pipeline call's microbatches, ZeRO-1's full gradients, a window
            # syncing on its last call, which sums once); measured by the dry run; LoRA's frozen norms: none
            calls = workload.calls(plan)
            window = fsdp_applied and plan.grad_sync == "last_microbatch" and plan.zero != 1 and calls > 1
            in_reduce = fsdp_applied and (plan.pp > 1 or plan.zero == 1 or window)
            add("tp", "all_reduce", "SP norm-weight gradients", 0 if state.frozen_norms else
                (1 if window else calls) * (2 * blocks + int(last_stage)),
                h * (dtype_bytes(plan.reduce_dtype) if in_reduce else act), t, None)
        else:
            # Backward all-reduces the summed input gradient of q/k/v once and of gate/up once (they
            # share one Replicate DTensor input); recompute re-runs o's all-reduce.
            add("tp", "all_reduce", "TP: o/down outputs (fwd), attention/MLP input grads (bwd), recompute",
                m * (blocks * (4 + (ac != "none")) + edges - state.grad_free_edges), bsh, t, None)
        if state.adapter_partial_tensors:  # LoRA halves every tp rank holds whole: their shares summed, in the
            # compute dtype (the Partial gradient is redistributed before FSDP casts it to the reduce dtype)
            add("tp", "all_reduce", "LoRA A (column bases) / B (row bases) gradients",
                workload.calls(plan) * state.adapter_partial_tensors,
                state.adapter_partial_elements * act / state.adapter_partial_tensors, t, None)
        if state.tp_partial_tensors:  # whole weights each tp rank used only its rows or heads of
            add("tp", "all_reduce", "whole weights with partial gradients (replicated K/V, packed projections, "
                "MLA latents)",
                workload.calls(plan) * state.tp_partial_tensors,
                state.tp_partial_elements * 4 / state.tp_partial_tensors, t, None)
        if state.tp_summed_tensors:  # TP ranks fed different tokens through the same MoE weights
            add("tp", "all_reduce", "MoE router/expert gradient shards (each rank routed its own tokens)",
                shard_sums * state.tp_summed_tensors, state.tp_summed_elements * 4 / state.tp_summed_tensors,
                t, None)
        if last_stage:
            if plan.loss_parallel:
                add("tp", "all_reduce", "vocab-parallel loss: max, sum-exp, target logit", 3 * m, mbs * seq * 4, t, None)
            else:
                add("tp", "all_gather", "logits to the full vocabulary", m, mbs * seq * config.vocab_size * act, t, None)

    fsdp, rep = plan.dp_shard * plan.cp, plan.dp_replicate
    if replicates_with_ddp(plan):  # `data_parallel.replicate`: every fp32 gradient summed in DDP's buckets,
        # once per window whatever grad_sync says (nothing sharded: an earlier reduction frees nothing)
        grads = state.held_trainable * 4
        buckets = max(1, math.ceil(grads / (BUCKET_MB * 2**20)))
        add("dp_replicate", "all_reduce", f"DDP: gradients in {BUCKET_MB:g} MB buckets", buckets,
            grads / buckets, rep, 2 * t_block_fwd + t_block_rec)
    elif fsdp > 1 or rep > 1:
        calls = workload.calls(plan)  # forward_backward calls (PP keeps units gathered across its microbatches)
        gathers = calls if plan.zero == 3 else 1  # ZeRO-1/2 keep the gathered units through the window
        syncs = calls if plan.grad_sync == "every_microbatch" else 1
        dense = [u for u in fsdp_units(config, plan, state) if u.axis == "dp_shard_cp"]
        t_bwd = 2 * t_block_fwd + t_block_rec
        red = dtype_bytes(plan.reduce_dtype)
        hides = {"embed": None, "head": t_block_fwd}
        for u in dense if fsdp > 1 else []:
            gathered = gathered_bytes(plan, u.elements, u.float8)  # float8 projection weights in one byte each
            add("dp_shard_cp", "all_gather", f"FSDP: {u.name} parameters (fwd)", gathers * u.count,
                gathered, fsdp, t_block_fwd if _is_block(u.name) else hides[u.name])
            if u.regather:
                add("dp_shard_cp", "all_gather", f"FSDP: {u.name} parameters again (bwd)", gathers * u.count,
                    gathered, fsdp, t_bwd / 2)
            add("dp_shard_cp", "reduce_scatter", f"FSDP: {u.name} gradients ({plan.reduce_dtype})", syncs * u.count,
                u.grad_elements * red, fsdp, t_bwd / 2 if _is_block(u.name) else None)
        if rep > 1:  # one all-reduce of each unit's gradient shard across the replicas
            count = sum(u.count for u in dense if u.grad_elements)
            total = sum(u.grad_elements * u.count for u in dense)
            add("dp_replicate", "all_reduce", "HSDP: gradient shards", syncs * count, total * red / fsdp / count,
                rep, t_bwd)
        if experts is not None:  # experts are their own unit, sharded over the fsdp/ep ranks holding them
            shards, unit = fsdp // plan.ep, state.unit_elements["expert"]
            add("ep_fsdp", "all_gather", "FSDP: expert parameters (fwd)", gathers * moe_blocks, unit * act, shards,
                t_block_fwd)
            if plan.fsdp_reshard:
                add("ep_fsdp", "all_gather", "FSDP: expert parameters again (bwd)", gathers * moe_blocks, unit * act,
                    shards, t_bwd / 2)
            add("ep_fsdp", "reduce_scatter", f"FSDP: expert gradients ({plan.reduce_dtype})", syncs * moe_blocks,
                unit * red, shards, t_bwd / 2)
            add("dp_replicate", "all_reduce", "HSDP: expert gradient shards", syncs * moe_blocks,
                unit * red / shards, rep, t_bwd)

    if plan.float8 == "tensorwise" and fsdp_applied:  # the weights' scales for the float8 all-gathers: the
        # stacked amaxes (fp32, one per converted weight) of each stage, reduced before its every forward
        per_block = float8_weights_per_block(config, plan.tp)
        weights = sum(b.count * per_block.get(b.kind, 0) for b in state.block_units)
        # over every axis the weights are sharded on: FSDP's, and under TP FSDP's with tp in one group
        # (checked by the dry run without HSDP)
        axis = "dp_shard_cp" if plan.tp == 1 else "dp_cp_tp"
        add(axis, "all_reduce", "float8: weight amaxes before each forward", m, 4 * weights,
            plan.dp_shard * plan.cp * plan.tp, None)

    if plan.cp > 1:
        kind = getattr(plan, "cp_attention", "zigzag")
        uly = getattr(plan, "ulysses_degree", plan.cp if kind == "ulysses" else 1)
        ring = plan.cp // uly
        q_loc, kv_loc = mbs * seq * (heads // plan.tp) * d, mbs * seq * (kv // plan.tp) * d
        rec = int(ac != "none")  # recompute re-runs the attention Function and its exchanges
        if uly > 1:
            kv_rep = uly // math.gcd(kv // plan.tp, uly) if (kv // plan.tp) % uly else 1
            packed = (q_loc + 2 * kv_loc * kv_rep) * act
            add("cp", "all_to_all", f"Ulysses over {uly}: q/k/v in, output back (fwd, bwd, recompute)",
                m * blocks * (2 + 2 + 2 * rec), (packed + q_loc * act) / 2, uly, None)
            kv_loc *= kv_rep  # after Ulysses a ring rank holds uly x the tokens of kv*kv_rep/uly heads
        red = dtype_bytes(plan.reduce_dtype)  # dK/dV travel in the reduce dtype (accumulated in fp32)
        # attention work per ring step: causal, so half the square the FLOP convention counts
        step = 2 * mbs * seq * seq * uly * (heads // plan.tp) * d / (device.peak_flops * workload.mfu)
        if ring > 1 and kind == "allgather":
            # one gather of [K; V] per layer (again in recompute), kept for backward, hidden behind the
            # two causal diagonal chunks (half a ring step's work); one reduce-scatter of [dK; dV] that
            # nothing hides
            add("cp", "all_gather", "all-gather K/V (fwd, recompute)", m * blocks * (1 + rec),
                ring * 2 * kv_loc * act, ring, step / 2)
            add("cp", "reduce_scatter", f"all-gather: dK/dV in {plan.reduce_dtype} (bwd)", m * blocks,
                ring * 2 * kv_loc * red, ring, None)
        elif ring > 1 and getattr(plan, "cp_keep_kv", False):
            # K/V kept from forward: none sent in backward; each block's dK/dV straight to its owner
            add("cp", "p2p", "ring, K/V kept: K/V blocks (fwd, recompute)", m * blocks * (ring - 1) * (1 + rec),
                2 * kv_loc * act, ring, step)
            add("cp", "p2p", f"ring, K/V kept: dK/dV in {plan.reduce_dtype} (bwd)", m * blocks * (ring - 1),
                2 * kv_loc * red, ring, step)
        elif ring > 1:
            add("cp", "p2p", "ring: K/V blocks (fwd, recompute, bwd)", m * blocks * (ring - 1) * (2 + rec),
                2 * kv_loc * act, ring, step)
            add("cp", "p2p", f"ring: dK/dV in {plan.reduce_dtype} (bwd)", m * blocks * ring, 2 * kv_loc * red,
                ring, step)

    if experts is not None:
        opts = moe.layer_options(config)
        tokens = mbs * seq // (plan.tp if plan.sequence_parallel else 1)  # each TP rank routes its shard
        if plan.ep > 1:
            add("ep", "all_to_all", "MoE: tokens per expert (fwd, int64)", m * moe_blocks, experts.num_experts * 8,
                plan.ep, None)
            # dispatch and combine, forward and backward, and again in recompute (routing is replayed, not
            # re-planned). Under uniform routing every rank sends and receives T*K rows each way.
            add("ep", "all_to_all", "MoE: token rows to experts and back (fwd, bwd, recompute)",
                m * moe_blocks * (4 + 2 * int(ac != "none")), tokens * experts.top_k * h * act, plan.ep, None)
        if opts["aux_loss_coef"] or opts["z_loss_coef"] or opts["keep_router_stats"]:
            add("dp_cp_tp", "all_reduce", "MoE: router load counts for the balancing loss", m * moe_blocks,
                (experts.num_experts + 1) * 4, plan.dp * plan.cp * plan.tp, None)

    if plan.pp * plan.cp * plan.tp > 1:  # step/batch's input checks: peers sharing a batch compare it
        add("pp_cp_tp", "all_reduce", "input checks: the batch's signature (6 int64)", workload.calls(plan), 48,
            plan.pp * plan.cp * plan.tp, None)

    if plan.pp > 1:
        # Messages the busiest rank sends: each of its stages sends its output forward (but the last
        # stage) and its input gradient backward (but the first stage), once per microbatch.
        # Under DualPipe each of a rank's two stages carries one direction's half of the microbatches; a
        # boundary between two stages of one rank (the V's turn) sends nothing.
        owner, chains = stage_ranks(plan), pipelines(plan.pp_schedule)
        stages, per_chain = len(owner), len(owner) // chains
        sends = max(sum((s % per_chain < per_chain - 1 and owner[s + 1] != r) + (s % per_chain > 0 and owner[s - 1] != r)
                        for s in range(stages) if owner[s] == r)
                    for r in (range(plan.pp) if pp_rank is None else [pp_rank]))
        boundary = mbs * seq * h * act // (plan.tp if plan.sequence_parallel and plan.tp > 1 else 1)
        add("pp", "p2p", "activations (fwd) and their gradients (bwd) between stages", sends * m // chains, boundary,
            2, 0.0)
        if out and out[-1].axis == "pp":  # sends are asynchronous: only the fill and drain wait on them
            c = out[-1]
            out[-1] = dataclasses.replace(c, exposed=2 * (plan.pp - 1) * c.time(lat) / c.calls)
        if state.tied_copy_elements:  # first and last stage sum their tied-embedding copies' gradients
            # a group of two: pp ranks 0 and pp-1 alone (the whole pp axis only when pp = 2)
            add("pp_ends", "all_reduce", "tied embedding: gradients of the first and last stage's copies",
                shard_sums, state.tied_copy_elements * (state.param_bytes // max(state.params, 1)), 2, None)
        if chains == 2:  # DualPipe: pp ranks r and pp-1-r hold the same layers; one flat fp32 all-reduce
            add("pp_mirror", "all_reduce", "DualPipe: every gradient, summed over the mirror pair's two copies", shard_sums,
                (state.trained_params + state.trained_tensors) * 4, 2, None)  # + one presence flag per tensor
    return out
