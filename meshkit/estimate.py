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
from meshkit import estimate_moe as moe
from meshkit import metrics
from meshkit.activation_checkpoint import moe_blocks_full
from meshkit.estimate_comm import Collective, communication, dtype_bytes
from meshkit.models.moe import moe_spec
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
    # Mixture-of-experts shapes, as published with the models.
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                         num_experts_per_tok=2, rope_theta=1e6, max_position_embeddings=32768, rms_norm_eps=1e-5,
                         sliding_window=None, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False),
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
        preset = dict(MODEL_PRESETS[spec.lower()])
        return transformers.AutoConfig.for_model(preset.pop("model_type", "llama"), **preset)
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
    unit: str  # "embed", "block", "head", or "expert" (dim 0 split by ep, then FSDP'd over fsdp/ep ranks)
    tp_summed: bool = False  # an MoE weight TP leaves whole: its gradient is all-reduced over tp


@functools.lru_cache(maxsize=16)
def _param_specs(config_json: str) -> tuple[tuple[ParamSpec, ...], int, bool]:
    """Shapes from a one-block model on the meta device and meshkit's role table, so biases (Qwen2)
    and per-head norms (Qwen3) are covered without a formula per model family; MoE blocks are
    converted to meshkit's layer first, whose router and shared expert TP leaves whole."""
    import torch
    import transformers

    from meshkit.models import llama
    from meshkit.models.moe import convert_moe_blocks

    cfg = transformers.AutoConfig.for_model(**json.loads(config_json))
    layers, cfg.num_hidden_layers = cfg.num_hidden_layers, 1
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    if moe.require_supported(cfg) is not None:
        convert_moe_blocks(model)
    parts = llama.parts(model)
    roles = llama.block_roles(parts.blocks[0])
    specs = [ParamSpec(tuple(parts.embed.weight.shape), 0, "embed")]
    for name, p in parts.blocks[0].named_parameters():
        owner, leaf = name.rsplit(".", 1)
        tp_dim = {"colwise": 0, "rowwise": 1 if leaf == "weight" else None}.get(roles.get(owner, ""))
        in_moe = roles.get("mlp") == "moe" and owner.startswith("mlp")
        specs.append(ParamSpec(tuple(p.shape), tp_dim, "expert" if owner == "mlp.experts" else "block", in_moe))
    specs.append(ParamSpec(tuple(parts.norm.weight.shape), None, "head"))
    if not parts.tied:
        specs.append(ParamSpec(tuple(parts.lm_head.weight.shape), 0, "head"))
    return tuple(specs), layers, parts.tied


def _chunk(n: int, parts: int, index: int) -> int:
    """Rows of chunk `index` when torch.chunk splits n rows into `parts` (DTensor and FSDP2 both do)."""
    size = -(-n // parts)
    return max(0, min(size, n - index * size))


def _split_shape(spec: ParamSpec, tp: int, tp_rank: int) -> list[int]:
    shape = list(spec.shape)
    if spec.tp_dim is not None:
        shape[spec.tp_dim] = _chunk(shape[spec.tp_dim], tp, tp_rank)
    return shape


def fsdp_dim(spec: ParamSpec, tp: int, tp_rank: int, fsdp: int) -> int:
    """The dim FSDP shards: 0, except for experts whose count does not divide the FSDP ranks."""
    if spec.unit != "expert":
        return 0
    from meshkit.data_parallel import expert_shard_dim

    return expert_shard_dim(tuple(_split_shape(spec, tp, tp_rank)), fsdp)


def local_numel(spec: ParamSpec, tp: int, tp_rank: int, fsdp: int, fsdp_rank: int) -> int:
    """Elements of one parameter on one rank: TP's (or ep's) chunk, then FSDP's chunk of that."""
    shape = _split_shape(spec, tp, tp_rank)
    dim = fsdp_dim(spec, tp, tp_rank, fsdp)
    shape[dim] = _chunk(shape[dim], fsdp, fsdp_rank)
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
    tp_summed_tensors: int = 0   # MoE weights whose gradient shards are all-reduced over tp (when tp > 1)
    tp_summed_elements: int = 0  # their elements on this rank
    tied_copy_elements: int = 0  # pp > 1, tied embedding, first or last stage: this rank's copy's shard

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
    count_of = {"block": blocks, "expert": blocks, "embed": int(pp_rank == 0 or (tied and pp_rank == plan.pp - 1)),
                "head": int(pp_rank == plan.pp - 1)}
    numel = tensors = summed_tensors = summed_elements = tied_copy = 0
    units = {"embed": 0, "block": 0, "head": 0, "expert": 0}
    zero = {"DDP": 0.0, "ZeRO-1": 0.0, "ZeRO-2": 0.0, "ZeRO-3": 0.0}
    for spec in specs:
        count = count_of[spec.unit]
        # Experts: ep neighbouring ranks of dp_shard x cp split the experts (ep is the inner factor),
        # and FSDP shards each rank's block of experts over the fsdp/ep ranks holding the same block.
        split, split_rank, shards, shard_rank = plan.tp, tp_rank, fsdp, fsdp_rank
        if spec.unit == "expert":
            spec = dataclasses.replace(spec, tp_dim=0)
            split, split_rank, shards, shard_rank = plan.ep, fsdp_rank % plan.ep, fsdp // plan.ep, fsdp_rank // plan.ep
        local = count * local_numel(spec, split, split_rank, shards, shard_rank)
        numel += local
        tensors += count
        if spec.tp_summed and plan.tp > 1:
            summed_tensors, summed_elements = summed_tensors + count, summed_elements + local
        if spec.unit == "embed" and tied and plan.pp > 1:  # the head's copy on the last stage
            tied_copy = local
        held = count * local_numel(spec, split, split_rank, 1, 0)  # the Playbook's Psi on this rank
        zero["DDP"] += 16.0 * held
        zero["ZeRO-1"] += 4.0 * held + 12.0 * held / shards
        zero["ZeRO-2"] += 2.0 * held + 14.0 * held / shards
        zero["ZeRO-3"] += 16.0 * held / shards
        shape = _split_shape(spec, split, split_rank)
        rows = shape[fsdp_dim(spec, split, split_rank, shards)]
        per_row = math.prod(shape) // max(rows, 1)
        units[spec.unit] += -(-rows // shards) * shards * per_row if count else 0  # FSDP2 pads to equal rows
    return ModelState(numel, numel * param_bytes, numel * param_bytes, 2 * numel * param_bytes + 4 * tensors,
                      units, blocks, zero, summed_tensors, summed_elements, tied_copy)


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
    per_block = acts.block_activations(config, sequence_parallel=sp, ac=ac, ep=plan.ep, **kw)
    if ac == "selective" and plan.cp > 1 and getattr(plan, "cp_attention", "zigzag") in ("ring", "zigzag", "usp"):
        # meshkit's policy saves every kernel output, so each ring step's partial (out, lse) is kept
        per_block["attention"] = per_block.get("attention", 0) * plan.cp
    transient = acts.recompute_working_set(config, sequence_parallel=sp, ac=ac, ep=plan.ep, **kw)
    if last:
        transient = max(transient, acts.loss_transient(config, loss_parallel=plan.loss_parallel, **kw))
    fsdp_buffers = 0
    if plan.dp_shard * plan.cp * plan.dp_replicate > 1 or plan.param_dtype != "float32":
        act, red = dtype_bytes(plan.param_dtype), dtype_bytes(plan.reduce_dtype)
        unit = max(state.unit_elements.values())
        reshard = plan.reshard_after_forward if plan.reshard_after_forward is not None else plan.pp == 1
        gathered = 2 * unit if reshard else sum(state.unit_elements[k] for k in ("embed", "head")) + \
            state.blocks * (state.unit_elements["block"] + state.unit_elements["expert"])
        fsdp_buffers = gathered * act + unit * (act + red)  # + one unit's unsharded grads and reduce buffer
    largest_stage = max(stage_blocks(config, plan)[pp_rank])  # in-flight pairs may be of any of its stages
    return RankMemory(pp_rank, state, per_block, in_flight * largest_stage, in_flight,
                      acts.shared_activations(config, **kw), head, transient, fsdp_buffers)


def estimate(config: Any, plan: Plan, world: int, workload: Workload, device: Device | str = "h100") -> Estimate:
    """Memory, FLOPs, communication and step time of one plan. pp/cp/ep degrees meshkit does not run
    yet are estimated all the same; `plan_search` marks them."""
    device = DEVICES[device] if isinstance(device, str) else device
    plan = plan.resolve(world)
    if plan.world_size != world:
        raise ValueError(f"the plan needs {plan.world_size} ranks, not world={world}")
    spec = moe.require_supported(config)
    if plan.ep > 1 and spec is None:
        raise ValueError(f"ep={plan.ep}: the model is dense, with no experts to shard; fix: ep=1")
    if spec is not None and spec.num_experts % plan.ep:
        raise ValueError(f"ep={plan.ep} does not divide num_experts={spec.num_experts}; fix: an ep dividing it")
    flops = metrics.flops_per_token(config, workload.seq, plan.activation_checkpointing,
                                    moe_blocks_full=moe_blocks_full(plan.tp, plan.ep))
    share = workload.mbs * workload.seq / (plan.tp * plan.cp) / (device.peak_flops * workload.mfu)
    heads, _, d = acts._attn_dims(config)
    t_layer_fwd = (2 * metrics.active_block_params(config) + 4 * heads * d * workload.seq) * share
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
    kernel), and metrics' convention for one block minus its norm weights, which feed no matmul.

    For an MoE block both sides leave the MoE layer out: its FLOPs depend on the routing, which fake
    tensors cannot follow (tests count it with real tensors at small shapes)."""
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
    params = metrics.block_params(config) - 2 * config.hidden_size
    if moe_spec(config) is not None:  # _build made the MLP an Identity
        params -= 3 * config.hidden_size * config.intermediate_size
    formula = 6.0 * params * seq + 12.0 * heads * d * seq * seq
    return float(counter.get_total_flops()), formula


def main(argv: list[str] | None = None) -> int:
    """`python -m meshkit.estimate`: see `meshkit.estimate_report.main`."""
    from meshkit.estimate_report import main as cli

    return cli(argv)


if __name__ == "__main__":
    sys.exit(main())
