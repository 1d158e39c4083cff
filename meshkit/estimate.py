"""What a plan costs before any GPU is touched: memory per rank, FLOPs, bytes per axis, step time.

The Ultrascale Playbook's accounting, specialised to what meshkit actually runs:

- Model state: FSDP2 keeps the *sharded* parameters in their original fp32 (they are the master
  weights), sharded fp32 gradients (meshkit reduces in fp32) and AdamW's two fp32 moments: 16 bytes
  per parameter divided by the FSDP degree (dp_shard * cp). The bf16 parameter and gradient copies
  the Playbook counts as persistent (2 + 2 bytes) exist here only per FSDP unit, while it runs.
  The Playbook's DDP/ZeRO-1/2/3 figures are printed beside it for comparison.
- Activations: measured from the real HF block under FakeTensorMode (`estimate_activations`) and
  scaled by the plan: TP/SP local shapes, s/cp tokens, in-flight microbatches from meshkit's
  pipeline simulator.
- FLOPs: `meshkit.metrics.flops_per_token` (the MFU convention), cross-checked on one real-shaped
  fake block with `torch.utils.flop_counter.FlopCounterMode`.
- Communication: every collective the plan issues per step, its link (NVLink inside a node, the
  GPU's NIC across nodes, from the mesh order pp > dp_replicate > dp_shard > cp > tp), and how much
  of it the compute it overlaps with can hide.

Step time = compute at an assumed efficiency (with the pipeline bubble from the simulator) + the
communication that does not hide. docs/estimate.md has the derivations and the conventions.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from meshkit import estimate_activations as acts
from meshkit import metrics
from meshkit.plan import Plan

GiB = 1024**3

# ------------------------------------------------------------------------------------ presets

# Real Llama 3 shapes, written out: this machine has no hub access.
_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192}
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
               hidden_act="silu", tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
               rope_scaling=_ROPE)
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                        rope_scaling=dict(_ROPE, factor=32.0)),
    "llama3.2-3b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                        rope_scaling=dict(_ROPE, factor=32.0)),
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8),
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8),
    "llama3-405b": dict(_LLAMA3, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                        num_attention_heads=128, num_key_value_heads=8),
}


@dataclass(frozen=True)
class Device:
    """What the estimate needs of an accelerator. Bandwidths: per GPU, one direction, bytes/s."""

    name: str
    peak_flops: float        # dense bf16 FLOP/s
    memory_bytes: float      # what the allocator can hand out
    nvlink_bw: float         # inside a node
    ib_bw: float             # across nodes: the GPU's own NIC
    gpus_per_node: int = 8
    latency_s: float = 10e-6  # per collective call


# H100/H200 SXM: NVLink 4 moves 900 GB/s both ways (450 each way); one 400 Gb/s NDR NIC per GPU.
DEVICES = {
    "h100": Device("h100", metrics.PEAK_FLOPS["h100"]["bfloat16"], 79.6 * GiB, 450e9, 50e9),
    "h200": Device("h200", metrics.PEAK_FLOPS["h200"]["bfloat16"], 139.8 * GiB, 450e9, 50e9),
}


def load_config(spec: str) -> Any:
    """A preset name, a config.json, or a local model directory -> a transformers config."""
    import transformers

    if spec.lower() in MODEL_PRESETS:
        return transformers.LlamaConfig(**MODEL_PRESETS[spec.lower()])
    path = Path(spec)
    if path.is_dir():
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    if path.is_file():
        data = json.loads(path.read_text())
        return transformers.AutoConfig.for_model(data.pop("model_type", "llama"), **data)
    raise ValueError(f"--model {spec!r}: not a preset ({', '.join(MODEL_PRESETS)}), a config.json or a directory "
                     "holding one (the hub is not consulted)")


@dataclass(frozen=True)
class Workload:
    """A step beyond the Plan: sequence length, microbatch size and count, assumed kernel efficiency.

    `microbatches` counts every microbatch of a step on one data-parallel rank: under pipeline
    parallelism a multiple of the plan's `pp_microbatches` (one pipeline call each), otherwise the
    gradient-accumulation calls of `forward_backward`.
    """

    seq: int
    mbs: int = 1                 # sequences per microbatch per data-parallel rank
    microbatches: int = 1
    mfu: float = 0.45            # fraction of peak the kernels reach (recompute included)

    def global_tokens(self, plan: Plan) -> int:
        """Tokens one optimizer step consumes under `plan` (dp x microbatches x mbs x seq)."""
        return plan.dp * self.mbs * self.microbatches * self.seq

    def calls(self, plan: Plan) -> int:
        """`forward_backward` calls per step: FSDP gathers and reduces once per call."""
        return self.microbatches // plan.microbatches if plan.pp > 1 else self.microbatches


def stage_blocks(config: Any, plan: Plan) -> list[list[int]]:
    """Blocks of each of a rank's stages, per pipeline rank, from meshkit's own split (the embedding
    and the head count as a layer each, so the first and last stages get fewer blocks)."""
    from meshkit.pipeline.stage import split_layers, stages_of_rank

    v = plan.pp_virtual_stages if plan.pp > 1 else 1
    ranges = split_layers(config.num_hidden_layers, plan.pp * v, list(plan.pp_split) or None)
    return [[len(ranges[s]) for s in stages_of_rank(r, plan.pp, v)] for r in range(plan.pp)]


# -------------------------------------------------------------------------------- model state


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor, the dim TP splits (None: replicated over tp) and its FSDP unit."""

    shape: tuple[int, ...]
    tp_dim: int | None
    unit: str  # "embed", "block", "head"


@functools.lru_cache(maxsize=16)
def _param_specs(config_json: str) -> tuple[tuple[ParamSpec, ...], int, bool]:
    """Shapes from a one-block model on the meta device and meshkit's role table, so biases (Qwen2)
    and per-head norms (Qwen3) are covered without a formula per model family."""
    import torch
    import transformers

    from meshkit.models import llama

    cfg = transformers.AutoConfig.for_model(**json.loads(config_json))
    layers, cfg.num_hidden_layers = cfg.num_hidden_layers, 1
    with torch.device("meta"):
        parts = llama.parts(transformers.AutoModelForCausalLM.from_config(cfg))
    roles = llama.block_roles(parts.blocks[0])
    specs = [ParamSpec(tuple(parts.embed.weight.shape), 0, "embed")]
    for name, p in parts.blocks[0].named_parameters():
        owner, leaf = name.rsplit(".", 1)
        tp_dim = {"colwise": 0, "rowwise": 1 if leaf == "weight" else None}.get(roles.get(owner, ""))
        specs.append(ParamSpec(tuple(p.shape), tp_dim, "block"))
    specs.append(ParamSpec(tuple(parts.norm.weight.shape), None, "head"))
    if not parts.tied:
        specs.append(ParamSpec(tuple(parts.lm_head.weight.shape), 0, "head"))
    return tuple(specs), layers, parts.tied


def _chunk(n: int, parts: int, index: int) -> int:
    """Rows of chunk `index` when torch.chunk splits n rows into `parts` (DTensor and FSDP2 both do)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def local_numel(spec: ParamSpec, tp: int, tp_rank: int, fsdp: int, fsdp_rank: int) -> int:
    """Elements of one parameter on one rank: TP's chunk, then FSDP's chunk of dim 0 of that."""
    shape = list(spec.shape)
    if spec.tp_dim is not None:
        shape[spec.tp_dim] = _chunk(shape[spec.tp_dim], tp, tp_rank)
    shape[0] = _chunk(shape[0], fsdp, fsdp_rank)
    return math.prod(shape)


@dataclass(frozen=True)
class ModelState:
    """Model state of one rank."""

    params: int            # elements held (sharded)
    param_bytes: int       # sharded fp32 parameters, which are the master weights
    grad_bytes: int        # sharded gradients, in the parameters' dtype
    optimizer_bytes: int   # AdamW exp_avg + exp_avg_sq, plus its 4-byte `step` tensor per parameter
    unit_elements: dict[str, int]  # one FSDP unit of each kind as gathered (TP-local, padded rows)
    blocks: int            # decoder blocks on this pipeline rank
    zero: dict[str, float]  # Playbook bytes per rank: DDP and ZeRO-1/2/3, 2+2+12 bytes per parameter

    @property
    def persistent(self) -> int:
        """Bytes that live across steps: parameter shards, gradients, optimizer states."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def model_state(config: Any, plan: Plan, *, pp_rank: int = 0, tp_rank: int = 0, fsdp_rank: int = 0,
                param_bytes: int = 4) -> ModelState:
    """Exact for the visible local shards (`p.to_local()`), which tests check on a CPU mesh; FSDP2
    pads each shard's allocation to equal rows, at most one row per tensor more."""
    specs, layers, tied = _param_specs(acts._config_key(config))
    fsdp = plan.dp_shard * plan.cp
    blocks = sum(stage_blocks(config, plan)[pp_rank])
    count_of = {"block": blocks, "embed": int(pp_rank == 0 or (tied and pp_rank == plan.pp - 1)),
                "head": int(pp_rank == plan.pp - 1)}
    numel = tensors = psi = 0
    units = {"embed": 0, "block": 0, "head": 0}
    for spec in specs:
        count = count_of[spec.unit]
        numel += count * local_numel(spec, plan.tp, tp_rank, fsdp, fsdp_rank)
        tensors += count
        tp_local = local_numel(spec, plan.tp, tp_rank, 1, 0)
        psi += count * tp_local
        rows = _chunk(spec.shape[0], plan.tp, tp_rank) if spec.tp_dim == 0 else spec.shape[0]
        gathered = -(-rows // fsdp) * fsdp * (tp_local // max(rows, 1))  # FSDP2 pads shards to equal rows
        units[spec.unit] += gathered if count else 0
    zero = {"DDP": 16.0 * psi, "ZeRO-1": 4.0 * psi + 12.0 * psi / fsdp, "ZeRO-2": 2.0 * psi + 14.0 * psi / fsdp,
            "ZeRO-3": 16.0 * psi / fsdp}
    return ModelState(numel, numel * param_bytes, numel * param_bytes, 2 * numel * param_bytes + 4 * tensors,
                      units, blocks, zero)


# ------------------------------------------------------------------------------ communication


@dataclass(frozen=True)
class Collective:
    """One kind of collective on one axis, per step, on one rank.

    `buffer` is the collective's full logical buffer per call (all-gather output, reduce-scatter
    input, all-reduce tensor, all-to-all input, P2P message), the unit `metrics.CommCounter`
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


_MESH = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def axis_link(plan: Plan, axis: str, device: Device) -> tuple[str, float]:
    """(link name, bandwidth) of an axis's groups: NVLink when a group's ranks share a node.

    Ranks are laid out by the mesh order, tp innermost, so a group of axis a spans the product of
    a's size and every axis inside it; the flattened FSDP axis spans dp_shard's extent.
    """
    outer = {"dp_shard_cp": "dp_shard", "ep": "cp"}.get(axis, axis)
    span = math.prod(getattr(plan, a) for a in _MESH[_MESH.index(outer):])
    if span <= device.gpus_per_node:
        return "nvlink", device.nvlink_bw
    return "ib", device.ib_bw


def _dtype_bytes(name: str) -> int:
    return acts.DTYPES[name].itemsize


def communication(config: Any, plan: Plan, workload: Workload, device: Device, state: ModelState,
                  t_block_fwd: float, t_block_rec: float) -> list[Collective]:
    """Every collective the rank holding `state` issues per step, with the time overlap cannot hide.

    TP/SP and Ulysses collectives sit between matmuls (nothing to hide behind in meshkit), so all
    their time is exposed; FSDP's all-gather of the next block hides behind the current block's
    forward and its reduce-scatter behind the next backward; ring attention sends the next K/V
    block while the current one is computed. Recompute re-issues what it re-runs: the SP
    all-gathers under selective AC (their outputs are not saved), plus the attention-side
    reduce-scatter under full AC (non-reentrant checkpoint stops once the last saved tensor is back,
    before the MLP's reduce-scatter).
    """
    heads, kv, d = acts._attn_dims(config)
    h, act = config.hidden_size, _dtype_bytes(plan.param_dtype)
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

    if plan.tp > 1:
        t, bsh = plan.tp, mbs * seq * h * act
        first, last_stage = state.unit_elements["embed"] > 0, state.unit_elements["head"] > 0
        edges = int(first) + int(last_stage)  # embedding output and LM-head input cross the SP boundary
        if plan.sequence_parallel:
            rec_ag, rec_rs = {"none": (0, 0), "selective": (2, 0), "full": (2, 1)}[ac]
            add("tp", "all_gather", "SP: attention/MLP inputs (fwd), RS conjugates (bwd), recompute",
                m * (blocks * (4 + rec_ag) + edges), bsh, t, None)
            add("tp", "reduce_scatter", "SP: o/down outputs (fwd), AG conjugates (bwd), recompute",
                m * (blocks * (4 + rec_rs) + edges), bsh, t, None)
            # replicated norm weights see a sequence shard: their gradients are reduced once per call
            add("tp", "all_reduce", "SP norm-weight gradients", workload.calls(plan) * (2 * blocks + int(last_stage)),
                h * 4, t, None)
        else:
            # Backward all-reduces the input gradient of each colwise linear separately (q, k, v, gate,
            # up: DTensor reduces each module's Partial gradient); recompute re-runs o's all-reduce.
            add("tp", "all_reduce", "TP: o/down outputs (fwd), q/k/v/gate/up input grads (bwd), recompute",
                m * (blocks * (7 + (ac != "none")) + edges), bsh, t, None)
        if last_stage:
            if plan.loss_parallel:
                add("tp", "all_reduce", "vocab-parallel loss: max, sum-exp, target logit", 3 * m, mbs * seq * 4, t, None)
            else:
                add("tp", "all_gather", "logits to the full vocabulary", m, mbs * seq * config.vocab_size * act, t, None)

    fsdp, rep = plan.dp_shard * plan.cp, plan.dp_replicate
    if fsdp > 1 or rep > 1:
        syncs = workload.calls(plan)  # once per forward_backward call (PP keeps units gathered across its microbatches)
        reshard = plan.reshard_after_forward if plan.reshard_after_forward is not None else plan.pp == 1
        units = state.unit_elements
        t_bwd = 2 * t_block_fwd + t_block_rec
        red = _dtype_bytes(plan.reduce_dtype)
        tied_root = units["embed"] and getattr(config, "tie_word_embeddings", False)
        if tied_root:  # a tied weight lives in FSDP's root unit with the final norm; FSDP2 never reshards the root
            units = {"embed": 0, "block": units["block"], "head": units["embed"] + units["head"]}
        # (unit, count, hides behind, re-gathered in backward): the embedding unit is gathered first with
        # nothing to hide behind; the head unit is the last and is never resharded after forward.
        plan_units = [("block", blocks, t_block_fwd, reshard), ("embed", int(bool(units["embed"])), None, reshard),
                      ("head", int(bool(units["head"])), t_block_fwd, False)]
        for name, count, hide, regather in plan_units:
            if not count or fsdp == 1:
                continue
            add("dp_shard_cp", "all_gather", f"FSDP: {name} parameters (fwd)", syncs * count, units[name] * act,
                fsdp, hide)
            if regather:
                add("dp_shard_cp", "all_gather", f"FSDP: {name} parameters again (bwd)", syncs * count,
                    units[name] * act, fsdp, t_bwd / 2)
            add("dp_shard_cp", "reduce_scatter", f"FSDP: {name} gradients ({plan.reduce_dtype})", syncs * count,
                units[name] * red, fsdp, t_bwd / 2 if name == "block" else None)
        if rep > 1:  # one all-reduce of each unit's gradient shard across the replicas
            count = blocks + sum(1 for k in ("embed", "head") if units[k])
            total = units["block"] * blocks + units["embed"] + units["head"]
            add("dp_replicate", "all_reduce", "HSDP: gradient shards", syncs * count, total * red / fsdp / count,
                rep, t_bwd)

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
        if ring > 1:
            # attention work per ring step: causal, so half the square the FLOP convention counts
            step = 2 * mbs * seq * seq * uly * (heads // plan.tp) * d / (device.peak_flops * workload.mfu)
            add("cp", "p2p", "ring: K/V blocks (fwd, recompute, bwd)", m * blocks * (ring - 1) * (2 + rec),
                2 * kv_loc * act, ring, step)
            add("cp", "p2p", "ring: dK/dV in fp32 (bwd)", m * blocks * ring, 2 * kv_loc * 4, ring, step)

    if plan.pp > 1:
        # Messages the busiest rank sends: each of its stages sends its output forward (but the last
        # stage) and its input gradient backward (but the first stage), once per microbatch.
        v = plan.pp_virtual_stages
        stages = plan.pp * v
        sends = max(sum((s < stages - 1) + (s > 0) for s in range(r, stages, plan.pp)) for r in range(plan.pp))
        boundary = mbs * seq * h * act // (plan.tp if plan.sequence_parallel and plan.tp > 1 else 1)
        add("pp", "p2p", "activations (fwd) and their gradients (bwd) between stages", sends * m, boundary, 2, 0.0)
        if out and out[-1].axis == "pp":  # sends are asynchronous: only the fill and drain wait on them
            c = out[-1]
            out[-1] = dataclasses.replace(c, exposed=2 * (plan.pp - 1) * c.time(lat) / c.calls)
    return out


# ---------------------------------------------------------------------------------- the estimate


@functools.lru_cache(maxsize=128)
def _simulate(schedule: str, pp: int, m: int, v: int, recompute: Fraction) -> Any:
    """meshkit's pipeline simulator in units of one stage forward (B = F + recompute, W = F)."""
    from meshkit.pipeline.schedules import build_schedule
    from meshkit.pipeline.simulate import Costs, simulate

    return simulate(build_schedule(schedule, pp, m, v), Costs(1, 1 + recompute, 1))


@dataclass(frozen=True)
class PipelineTiming:
    """One pipeline call: makespan in units of one stage forward, bubble, in-flight pairs per rank."""

    step_time: Fraction
    bubble_fraction: Fraction
    peak_activations: tuple[int, ...]


# Schedules whose steady state repeats per microbatch: after the warm-up, every further microbatch
# adds exactly its own work to every rank and nothing to the idle time or the in-flight peak.
_STEADY = ("1f1b", "zb_h1", "interleaved_1f1b")


def pipeline_timing(schedule: str, pp: int, m: int, v: int, recompute: Fraction) -> PipelineTiming:
    """The simulator's timing of one call, simulated at most ~4 rounds of pp microbatches deep.

    Replaying 128 microbatches costs a second in exact arithmetic and a search asks for hundreds of
    shapes; for the steady-state schedules the makespan beyond 4*pp microbatches grows by exactly
    v*(F+B+W) per microbatch (tests compare against full simulations), so longer calls extend a
    shorter simulation rather than replaying it.
    """
    cap = m % pp + 4 * pp  # keeps interleaving's grouping (first group pp + m % pp, then groups of pp)
    m_sim = cap if schedule in _STEADY and m > cap else m
    sim = _simulate(schedule, pp, m_sim, v, recompute)
    step = sim.step_time + (m - m_sim) * v * (3 + recompute)
    idle = sum(sim.idle, Fraction(0))
    return PipelineTiming(step, idle / (step * pp), sim.peak_activations)


@dataclass(frozen=True)
class RankMemory:
    """The memory of one pipeline rank at its peak (end of its last held forward)."""

    pp_rank: int
    state: ModelState
    per_block: dict[str, int]  # one block, one microbatch
    held_blocks: int           # block-microbatches alive at the peak
    in_flight: int             # (stage, microbatch) pairs alive at the peak
    shared: int                # rotary cos/sin per in-flight pair
    head: dict[str, int]       # final norm, LM head and loss (last stage only)
    transient: int             # max(loss backward buffers, one block's recompute + gradients)
    fsdp_buffers: int          # gathered units and gradient buffers in flight

    @property
    def activations(self) -> int:
        """Activation bytes held at the peak (all in-flight microbatches)."""
        return self.held_blocks * sum(self.per_block.values()) + self.in_flight * self.shared + sum(self.head.values())

    @property
    def peak(self) -> int:
        """Peak bytes: persistent state, activations and transient buffers."""
        return self.state.persistent + self.activations + self.transient + self.fsdp_buffers


@dataclass
class Estimate:
    """Everything the estimator derives for one plan: memory per rank, FLOPs, communication, time."""
    config: Any
    plan: Plan
    workload: Workload
    device: Device
    memory: RankMemory           # the rank with the highest peak
    flops: metrics.FlopsPerToken
    comm: list[Collective]
    sim: PipelineTiming | None
    times: dict[str, float]

    @property
    def peak_bytes(self) -> int:
        """The worst rank's peak memory."""
        return self.memory.peak

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step."""
        return self.workload.global_tokens(self.plan)

    @property
    def step_time(self) -> float:
        """Estimated seconds per step: compute, pipeline bubble and exposed communication."""
        return self.times["step"]

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation the estimated step time implies."""
        per_rank = self.flops.model * self.tokens_per_step / self.plan.world_size
        return per_rank / (self.step_time * self.device.peak_flops)


def _rank_memory(config: Any, plan: Plan, workload: Workload, pp_rank: int, sim: PipelineTiming | None) -> RankMemory:
    state = model_state(config, plan, pp_rank=pp_rank)
    seq, ac, sp = workload.seq // plan.cp, plan.activation_checkpointing, plan.sequence_parallel
    kw = dict(batch=workload.mbs, seq=seq, tp=plan.tp, dtype=plan.param_dtype)
    in_flight = sim.peak_activations[pp_rank] if sim is not None else 1
    last = pp_rank == plan.pp - 1
    head = acts.head_activations(config, sequence_parallel=sp, loss_parallel=plan.loss_parallel, **kw) if last else {}
    per_block = acts.block_activations(config, sequence_parallel=sp, ac=ac, **kw)
    if ac == "selective" and plan.cp > 1 and getattr(plan, "cp_attention", "zigzag") in ("ring", "zigzag", "usp"):
        # meshkit's policy saves every kernel output, so each ring step's partial (out, lse) is kept
        per_block["attention"] = per_block.get("attention", 0) * plan.cp
    transient = acts.recompute_working_set(config, sequence_parallel=sp, ac=ac, **kw)
    if last:
        transient = max(transient, acts.loss_transient(config, loss_parallel=plan.loss_parallel, **kw))
    fsdp_buffers = 0
    if plan.dp_shard * plan.cp * plan.dp_replicate > 1 or plan.param_dtype != "float32":
        act, red = _dtype_bytes(plan.param_dtype), _dtype_bytes(plan.reduce_dtype)
        unit = max(state.unit_elements.values())
        reshard = plan.reshard_after_forward if plan.reshard_after_forward is not None else plan.pp == 1
        gathered = 2 * unit if reshard else sum(state.unit_elements[k] for k in ("embed", "head")) + \
            state.blocks * state.unit_elements["block"]
        fsdp_buffers = gathered * act + unit * (act + red)  # + one unit's unsharded grads and reduce buffer
    largest_stage = max(stage_blocks(config, plan)[pp_rank])  # in-flight pairs may be of any of its stages
    return RankMemory(pp_rank, state, per_block, in_flight * largest_stage, in_flight,
                      acts.shared_activations(config, **kw), head, transient, fsdp_buffers)


def require_dense(config: Any) -> None:
    """The estimator traces dense blocks; an MoE block routes data-dependently, which a fake-tensor
    trace cannot follow, and its expert state and all-to-alls need their own accounting."""
    from meshkit.models.moe import moe_spec

    spec = moe_spec(config)
    if spec is not None:
        raise ValueError(f"{getattr(config, 'model_type', '?')} has {spec.num_experts} experts (top-{spec.top_k}): "
                         "mixture-of-experts models are not estimated yet; only dense Llama-family models are")


def estimate(config: Any, plan: Plan, world: int, workload: Workload, device: Device | str = "h100") -> Estimate:
    """Memory, FLOPs, communication and step time of one plan. pp/cp/ep degrees meshkit does not run
    yet are estimated all the same; `plan_search` marks them."""
    device = DEVICES[device] if isinstance(device, str) else device
    plan = plan.resolve(world)
    if plan.world_size != world:
        raise ValueError(f"the plan needs {plan.world_size} ranks, not world={world}")
    require_dense(config)
    if plan.ep > 1:
        raise ValueError(f"ep={plan.ep}: the model is dense, with no experts to shard; fix: ep=1")
    flops = metrics.flops_per_token(config, workload.seq, plan.activation_checkpointing)
    share = workload.mbs * workload.seq / (plan.tp * plan.cp) / (device.peak_flops * workload.mfu)
    heads, _, d = acts._attn_dims(config)
    t_layer_fwd = (2 * metrics.block_params(config) + 4 * heads * d * workload.seq) * share
    t_layer_rec = flops.recompute * share / config.num_hidden_layers
    t_stage_fwd = flops.model / 3 * share / plan.pp
    t_stage_rec = flops.recompute * share / plan.pp
    state0 = model_state(config, plan, pp_rank=plan.pp - 1)
    comm = communication(config, plan, workload, device, state0, t_layer_fwd, t_layer_rec)
    sim = None
    if plan.pp > 1:
        # Costs in units of one stage's forward; the recompute ratio is rounded so that plans share
        # simulations (P2P is accounted in `communication`, not in the simulated step).
        if workload.microbatches % plan.microbatches:
            raise ValueError(f"microbatches={workload.microbatches} per step is not a multiple of the plan's "
                             f"pp_microbatches={plan.microbatches}")
        v = plan.pp_virtual_stages
        recompute = Fraction(t_stage_rec / t_stage_fwd).limit_denominator(8) if t_stage_fwd else Fraction(0)
        sim = pipeline_timing(plan.pp_schedule, plan.pp, plan.microbatches, v, recompute)
        compute = workload.calls(plan) * float(sim.step_time) * t_stage_fwd / v
        bubble = float(sim.bubble_fraction)
    else:
        compute, bubble = workload.microbatches * (3 * t_stage_fwd + t_stage_rec), 0.0
    ranks = [_rank_memory(config, plan, workload, r, sim) for r in range(plan.pp)]
    exposed = sum(c.exposed for c in comm)
    times = {"compute": compute, "bubble": bubble, "exposed_comm": exposed, "step": compute + exposed}
    return Estimate(config, plan, workload, device, max(ranks, key=lambda r: r.peak), flops, comm, sim, times)


def flop_counter_check(config: Any, seq: int) -> tuple[float, float]:
    """(counted, formula): training FLOPs of one block on one sequence, counted by FlopCounterMode on a
    fake block of the real shape (eager attention: the counter has no formula for the CPU flash
    kernel), and metrics' convention for one block minus its norm weights, which feed no matmul."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from meshkit.models import llama

    mode, parts = acts._build(acts._config_key(config), 1, None, "bfloat16")
    block = parts.blocks[0]
    llama.use_attention(block, "eager")
    try:
        with mode, FlopCounterMode(display=False) as counter:
            x = torch.empty(1, seq, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
            pos = torch.arange(seq).unsqueeze(0)
            llama.run_block(block, x, parts.rotary(x, pos), pos).sum().backward()
    finally:
        acts._pin_attention(block)
    heads, _, d = acts._attn_dims(config)
    formula = 6.0 * (metrics.block_params(config) - 2 * config.hidden_size) * seq + 12.0 * heads * d * seq * seq
    return float(counter.get_total_flops()), formula


# ------------------------------------------------------------------------------------- report


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f}"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def render(e: Estimate, check_flops: bool = True) -> str:
    """The per-rank report the CLI prints."""
    c, p, w, mem = e.config, e.plan, e.workload, e.memory
    heads, kv, _ = acts._attn_dims(c)
    n_total = sum(math.prod(s.shape) * ({"block": c.num_hidden_layers}.get(s.unit, 1))
                  for s in _param_specs(acts._config_key(c))[0])
    L = []
    L.append(f"model: {n_total / 1e9:.2f}B params, L={c.num_hidden_layers} h={c.hidden_size} heads={heads}/{kv} "
             f"ffn={c.intermediate_size} vocab={c.vocab_size}")
    L.append(f"plan: {p.describe()} on {p.world_size} x {e.device.name} | AC {p.activation_checkpointing}, "
             f"{p.param_dtype} compute / {p.reduce_dtype} reduce, SP {'on' if p.sequence_parallel else 'off'}, "
             f"loss_parallel {'on' if p.loss_parallel else 'off'}" +
             (f", {p.pp_schedule} x{p.pp_virtual_stages} with {p.microbatches} microbatches" if p.pp > 1 else "") +
             (f", cp_attention {getattr(p, 'cp_attention', 'zigzag')}" if p.cp > 1 else ""))
    L.append(f"step: seq {w.seq}, mbs {w.mbs}, {w.microbatches} microbatch(es) per dp rank -> "
             f"{e.tokens_per_step:,} tokens per step (dp={p.dp})")
    s = mem.state
    L.append(f"\nmemory per rank (pp rank {mem.pp_rank}, the peak one){'':14}GiB")
    L.append(f"  parameters (fp32 shards = master weights){'':5}{_gib(s.param_bytes)}   {s.params:,} elements")
    L.append(f"  gradients (fp32 shards){'':23}{_gib(s.grad_bytes)}")
    L.append(f"  optimizer (AdamW exp_avg + exp_avg_sq){'':8}{_gib(s.optimizer_bytes)}")
    L.append(f"  activations held{'':30}{_gib(mem.activations)}   {mem.in_flight} microbatch(es) x "
             f"{mem.held_blocks // max(mem.in_flight, 1)} blocks in flight")
    for part, n in mem.per_block.items():
        L.append(f"    per block: {part:<16}{_bytes(n):>12}   x{mem.held_blocks} = {_bytes(n * mem.held_blocks)}")
    L.append(f"    rotary cos/sin{'':14}{_bytes(mem.shared):>12}   x{mem.in_flight}")
    for part, n in mem.head.items():
        L.append(f"    {part:<26}{_bytes(n):>12}")
    L.append(f"  transient (loss backward / block recompute){'':3}{_gib(mem.transient)}")
    L.append(f"  FSDP buffers (gathered units, grad buffers){'':3}{_gib(mem.fsdp_buffers)}")
    fits = "fits" if mem.peak <= e.device.memory_bytes else "DOES NOT FIT"
    L.append(f"  peak{'':42}{_gib(mem.peak)}   of {e.device.memory_bytes / GiB:.1f} GiB: {fits}")
    seq, tok = w.seq // p.cp, w.mbs * (w.seq // p.cp)
    measured = sum(mem.per_block.values())
    kort = acts.korthikanti_bytes(c, batch=w.mbs, seq=seq, tp=p.tp, sequence_parallel=p.sequence_parallel,
                                  ac=p.activation_checkpointing)
    L.append(f"  one block, measured: {measured / tok / c.hidden_size:.2f} x s*b*h bytes; Korthikanti "
             f"sbh(34+5as/h) for this TP/AC: {kort / tok / c.hidden_size:.2f} x s*b*h")
    z = "  ".join(f"{k} {v / GiB:.2f}" for k, v in s.zero.items())
    L.append(f"  Playbook model state per rank (GiB, 2+2+12 B/param, Nd={p.dp_shard * p.cp}): {z}; "
             f"meshkit FSDP2: {s.persistent / GiB:.2f} + buffers")
    f = e.flops
    world_flops = f.model * e.tokens_per_step
    L.append("\nFLOPs (model = 6*N_nonembedding + 12*L*h_attn*s per token; hardware adds recompute)")
    L.append(f"  per token: model {f.model / 1e9:.2f} GFLOP, hardware {f.hardware / 1e9:.2f} GFLOP")
    L.append(f"  per step: {world_flops / 1e15:.1f} PFLOP model, {world_flops / p.world_size / 1e12:.1f} TFLOP per rank")
    if check_flops:
        counted, formula = flop_counter_check(c, w.seq)
        L.append(f"  FlopCounterMode, one fake block at seq {w.seq}: {counted / 1e12:.3f} TFLOP vs formula "
                 f"{formula / 1e12:.3f} (ratio {counted / formula:.4f})")
    L.append(f"\ncommunication per step, per rank (link: nvlink {e.device.nvlink_bw / 1e9:.0f} GB/s, "
             f"ib {e.device.ib_bw / 1e9:.0f} GB/s per GPU)")
    L.append(f"  {'axis':<13}{'collective':<15}{'calls':>7}{'buffer/call':>13}{'wire/rank':>12}{'link':>7}"
             f"{'time ms':>9}{'exposed':>9}  hides?  what")
    for col in e.comm:
        t = col.time(e.device.latency_s)
        hidden = 1 - col.exposed / t if t else 1.0
        verdict = "yes" if hidden > 0.95 else "no" if hidden < 0.05 else \
            f"{hidden:.0%}"
        L.append(f"  {col.axis:<13}{col.kind:<15}{col.calls:>7}{_bytes(col.buffer):>13}{_bytes(col.wire):>12}"
                 f"{col.link:>7}{t * 1e3:>9.1f}{col.exposed * 1e3:>9.1f}  {verdict:<6}  {col.what}")
    tm = e.times
    L.append(f"\nstep time at {w.mfu:.0%} of {e.device.peak_flops / 1e12:.0f} TFLOP/s: compute "
             f"{tm['compute'] * 1e3:.0f} ms (pipeline bubble {tm['bubble']:.1%}) + exposed communication "
             f"{tm['exposed_comm'] * 1e3:.0f} ms = {tm['step'] * 1e3:.0f} ms -> MFU {e.mfu:.1%}, "
             f"{e.tokens_per_step / tm['step'] / p.world_size:,.0f} tokens/s/GPU")
    return "\n".join(L)


# ---------------------------------------------------------------------------------------- CLI


def parse_tokens(text: str) -> int:
    """'1M' -> 2**20 (binary suffixes, so 1M = 128 sequences of 8192), '1e6' -> 1000000."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The command-line flags shared by `meshkit.estimate` and `meshkit.plan_search`."""
    parser = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help=f"preset ({', '.join(MODEL_PRESETS)}), config.json or dir")
    parser.add_argument("--world", type=int, required=True, help="number of GPUs")
    parser.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--device", default="h100", choices=sorted(DEVICES))
    parser.add_argument("--peak-tflops", type=float, help="override the device's dense bf16 peak")
    parser.add_argument("--nvlink-gbps", type=float, help="intra-node GB/s per GPU per direction")
    parser.add_argument("--ib-gbps", type=float, help="inter-node GB/s per GPU per direction")
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--memory-gib", type=float, help="usable device memory")
    parser.add_argument("--mfu", type=float, default=0.45, help="assumed fraction of peak for compute")
    return parser


def device_from_args(args: argparse.Namespace) -> Device:
    """The device preset, with any bandwidth or peak overrides from the flags applied."""
    d = DEVICES[args.device]
    changes = {k: v for k, v in (("peak_flops", args.peak_tflops and args.peak_tflops * 1e12),
                                 ("nvlink_bw", args.nvlink_gbps and args.nvlink_gbps * 1e9),
                                 ("ib_bw", args.ib_gbps and args.ib_gbps * 1e9),
                                 ("gpus_per_node", args.gpus_per_node),
                                 ("memory_bytes", args.memory_gib and args.memory_gib * GiB)) if v}
    return dataclasses.replace(d, **changes)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = build_parser()
    parser.add_argument("--plan", default="", help='e.g. "tp=8,dp_shard=-1" (meshkit.Plan.from_string)')
    parser.add_argument("--mbs", type=int, default=1, help="sequences per microbatch per data-parallel rank")
    parser.add_argument("--ac", choices=acts.AC_MODES, help="activation checkpointing (overrides the plan)")
    parser.add_argument("--microbatches", type=int,
                        help="per step per data rank (default: the plan's pp_microbatches, or 1 without pipeline)")
    parser.add_argument("--global-batch-tokens", help="e.g. 1M; sets microbatches = tokens / (dp*mbs*seq)")
    parser.add_argument("--no-flop-check", action="store_true", help="skip the FlopCounterMode cross-check")
    Plan.add_cli_args(parser)
    args = parser.parse_args(argv)
    config = load_config(args.model)
    plan = Plan.from_cli_args(args, Plan.from_string(args.plan))
    given = args.plan.replace(" ", "")
    if "param_dtype=" not in given and getattr(args, "plan_param_dtype", None) is None:
        plan = dataclasses.replace(plan, param_dtype="bfloat16")  # the recipes' mixed precision
    if args.ac:
        plan = dataclasses.replace(plan, activation_checkpointing=args.ac)
    plan = plan.resolve(args.world)
    m = args.microbatches or plan.microbatches
    if args.global_batch_tokens:
        m = max(1, round(parse_tokens(args.global_batch_tokens) / (plan.dp * args.mbs * args.seq)))
    if plan.pp > 1 and plan.pp_microbatches is None:
        plan = dataclasses.replace(plan, pp_microbatches=m)  # one pipeline call per step
    workload = Workload(args.seq, args.mbs, m, args.mfu)
    print(render(estimate(config, plan, args.world, workload, device_from_args(args)), not args.no_flop_check))
    return 0


if __name__ == "__main__":
    sys.exit(main())
