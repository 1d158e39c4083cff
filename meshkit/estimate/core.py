"""What a plan costs before any GPU is touched: memory per rank, FLOPs, bytes per axis, step time.

The Ultrascale Playbook's accounting, specialised to what meshkit actually runs:

- Model state and activations per rank (`memory`): FSDP2's sharded fp32 parameters, gradients and
  AdamW moments; activations measured from the real HF block under FakeTensorMode (`activations`)
  and from meshkit's MoE layer (`moe`), scaled by the plan: TP/SP local shapes, s/cp tokens,
  in-flight microbatches from meshkit's pipeline simulator.
- FLOPs: `meshkit.metrics.flops_per_token` (the MFU convention), cross-checked on one real-shaped
  fake block with `torch.utils.flop_counter.FlopCounterMode`.
- Communication (`comm`): every collective the plan issues per step, its link (NVLink inside a node, the
  GPU's NIC across nodes, from the mesh order pp > dp_replicate > dp_shard > cp > tp), and how much
  of it the compute it overlaps with can hide.

- Host offload (`offload`): host memory, the bytes crossing the host link, the optimizer step on the CPU.

Step time = compute at an assumed efficiency (with the pipeline bubble from the simulator) + the
communication that does not hide + what offload adds. docs/estimate.md has the derivations and the conventions.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from meshkit import metrics
from meshkit.estimate import activations as acts
from meshkit.estimate import moe
from meshkit.estimate.comm import Collective, communication
from meshkit.estimate.memory import float8_params_per_layer, model_state, stage_ranks
from meshkit.estimate.offload import ActivationOffloadCost, OffloadCost, activation_offload_cost, offload_cost
from meshkit.estimate.peak import RankMemory, rank_memory
from meshkit.estimate.spec import DEVICES, Device, Workload, config_key
from meshkit.expert_parallel import expert_split_problem
from meshkit.models import llama, roles
from meshkit.pipeline.schedules import build_schedule, stage_chunks
from meshkit.pipeline.simulate import Costs, simulate
from meshkit.pipeline.split import split_layers
from meshkit.plan import Plan

# ---------------------------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class StageCosts(Costs):
    """Costs scaled per stage: stage s's F, B and W take `weights[s]` times the base costs, for a
    stack whose stages hold different block kinds (a dense stage computes less than an MoE one)."""

    weights: tuple[Fraction, ...] = ()

    def duration(self, action: Any) -> Fraction:
        """The base cost of the action's kind, times its stage's weight."""
        return super().duration(action) * self.weights[action.stage]


@functools.lru_cache(maxsize=128)
def _simulate(schedule: str, pp: int, m: int, v: int, recompute: Fraction,
              weights: tuple[Fraction, ...] | None = None, memory_limit: int | None = None) -> Any:
    """meshkit's pipeline simulator in units of one stage forward (B = F + recompute, W = F), every
    stage alike or, with `weights`, each stage's costs scaled by its weight. zb_auto's schedule is
    built at these costs (the device's, from FLOPs) within `memory_limit`."""
    costs = Costs(1, 1 + recompute, 1) if weights is None else StageCosts(1, 1 + recompute, 1, weights=weights)
    return simulate(build_schedule(schedule, pp, m, v, costs=costs, memory_limit=memory_limit), costs)


def stage_weights(config: Any, plan: Plan, seq: int) -> tuple[Fraction, ...] | None:
    """Each pipeline stage's forward FLOPs over the mean stage's, when the stack mixes dense and MoE
    blocks (None: the stages' blocks are all of one kind and the split balances them as it is).

    Why: DeepSeek-V3's first dense blocks or Qwen2-MoE's `mlp_only_layers` make the stages that hold
    them lighter, and the slowest stage paces a pipeline; the simulator gets every stage's own cost.
    Recompute is taken proportional to a stage's forward."""
    if len(set(moe.block_kinds(config))) == 1:
        return None
    heads, d_qk, d_v = roles.score_value_dims(config)
    cost = [2 * metrics.active_block_params(config, i) + 2 * heads * (d_qk + d_v) * seq
            for i in range(config.num_hidden_layers)]
    chunks = stage_chunks(plan.pp_schedule, plan.pp, plan.pp_stages_per_rank)
    ranges = split_layers(config.num_hidden_layers, max(chunks) + 1, list(plan.pp_split) or None)
    per_stage = [sum(cost[i] for i in ranges[c]) for c in chunks]
    mean = Fraction(sum(per_stage), len(per_stage))
    return tuple((c / mean).limit_denominator(64) for c in per_stage)


@dataclass(frozen=True)
class PipelineTiming:
    """One pipeline call: makespan in units of one stage forward, bubble, in-flight pairs per rank."""

    step_time: Fraction
    bubble_fraction: Fraction
    peak_activations: tuple[int, ...]


# Schedules whose steady state repeats per microbatch: after the warm-up, every further microbatch
# adds exactly its own work to every rank and nothing to the idle time or the in-flight peak.
_STEADY = ("1f1b", "zb_h1", "interleaved_1f1b", "zb_h2", "zb_v", "dualpipe_v", "dualpipe", "zb_auto")


def pipeline_timing(schedule: str, pp: int, m: int, v: int, recompute: Fraction,
                    weights: tuple[Fraction, ...] | None = None, memory_limit: int | None = None) -> PipelineTiming:
    """The simulator's timing of one call, simulated at most ~4 rounds of pp microbatches deep.

    Replaying 128 microbatches costs a second in exact arithmetic and a search asks for hundreds of
    shapes; for the steady-state schedules the makespan beyond 4*pp microbatches grows by exactly
    one microbatch's work per rank (F+B+W of each stage it passes on the rank: v of them, one under
    DualPipe, whose microbatch passes each chunk once, on one of its two ranks) per microbatch
    (tests compare against full simulations), so longer calls extend a shorter simulation rather than
    replaying it. With per-stage `weights` (`stage_weights`) the growth per microbatch is the one
    measured between that simulation and one pp microbatches deeper (the slowest rank's work per
    microbatch once the steady state is reached).
    """
    cap = m % pp + 4 * pp  # keeps interleaving's grouping (first group pp + m % pp, then groups of pp)
    m_sim = cap if schedule in _STEADY and m > cap else m
    sim = _simulate(schedule, pp, m_sim, v, recompute, weights, memory_limit)
    chains = sim.schedule.pipelines
    path = sim.schedule.num_stages // chains  # the stages one microbatch passes through
    if weights is None:
        per_microbatch = Fraction(path * (3 + recompute), pp)
    elif m > m_sim:
        deeper = _simulate(schedule, pp, m_sim + pp, v, recompute, weights, memory_limit)
        per_microbatch = (deeper.step_time - sim.step_time) / pp
    else:
        per_microbatch = Fraction(0)
    step = sim.step_time + (m - m_sim) * per_microbatch
    # Each further microbatch adds every stage's work; what the makespan grows beyond it is idle.
    work = (3 + recompute) * (sum(weights, Fraction(0)) / chains if weights is not None else path)
    idle = step * pp - (sum(sim.busy, Fraction(0)) + (m - m_sim) * work)
    return PipelineTiming(step, idle / (step * pp), sim.peak_activations)


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
    offload: OffloadCost | None = None  # host memory, host-link bytes and CPU step of the slowest rank
    activation_offload: ActivationOffloadCost | None = None  # the worst rank's host bytes and copies

    @property
    def host_bytes(self) -> int:
        """Host memory one GPU's rank needs for what the plan offloads (model state and activations)."""
        return (self.offload.host_bytes if self.offload else 0) + \
            (self.activation_offload.host_bytes if self.activation_offload else 0)

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


_MEAN_ACTIVE: dict[str, float] = {}


def _mean_active_params(config: Any) -> float:
    """Parameters one token's matmuls touch per block, averaged over the stack; once per config (a plan
    search estimates thousands of plans of one config, and each config read is slow in transformers 5)."""
    key = config_key(config)
    if key not in _MEAN_ACTIVE:
        layers = config.num_hidden_layers
        _MEAN_ACTIVE[key] = sum(metrics.active_block_params(config, i) for i in range(layers)) / layers
    return _MEAN_ACTIVE[key]


def _backward_ratio(flops: metrics.FlopsPerToken, state: Any) -> float:
    """Backward over forward FLOPs: 2 when every weight trains; a LoRA model computes the input
    gradients of its frozen weights but not their weight gradients, so its dense part costs about
    (1 + trainable share) of the forward. (Pipeline schedules are simulated at full fine-tuning's
    costs, an upper bound for LoRA.)"""
    if flops.model == 0 or state.held_trainable == state.held_elements:
        return 2.0
    trainable = state.held_trainable / max(state.held_elements, 1)
    return (flops.dense / 3 * (1 + trainable) + 2 * flops.attention / 3) / (flops.model / 3)


def estimate(config: Any, plan: Plan, world: int, workload: Workload, device: Device | str = "h100") -> Estimate:
    """Memory, FLOPs, communication and step time of one plan. pp/cp/ep degrees meshkit does not run
    yet are estimated all the same; `plan_search` marks them."""
    device = DEVICES[device] if isinstance(device, str) else device
    plan = plan.resolve(world).resolve_cp(config)  # the CP kind parallelize would run ("auto": choose_cp)
    if plan.world_size != world:
        raise ValueError(f"the plan needs {plan.world_size} ranks, not world={world}")
    spec = moe.model_experts(config)
    if plan.ep > 1 and spec is None:
        raise ValueError(f"ep={plan.ep}: the model is dense, with no experts to shard; fix: ep=1")
    if spec is not None and expert_split_problem(plan.ep, spec.num_experts):
        raise ValueError(expert_split_problem(plan.ep, spec.num_experts))
    flops = metrics.flops_per_token(config, workload.seq, plan.activation_checkpointing)
    share = workload.mbs * workload.seq / (plan.tp * plan.cp) / (device.peak_flops * workload.mfu)
    share *= float8_time_factor(config, plan, device, flops)
    heads, d_qk, d_v = roles.score_value_dims(config)
    # One block's forward, averaged over the stack (dense and MoE blocks differ): what a per-block
    # transfer (FSDP's gather of the next block) can hide behind.
    # MLA's down-projections run whole on every tp rank: (tp - 1) more copies of their FLOPs, per rank 1/tp
    replicated = 2 * roles.tp_replicated_params(config) * (plan.tp - 1)
    mean_active = _mean_active_params(config)
    t_layer_fwd = (2 * mean_active + replicated + 2 * heads * (d_qk + d_v) * workload.seq) * share
    t_layer_rec = (flops.recompute / config.num_hidden_layers
                   + replicated * (plan.activation_checkpointing == "full")) * share
    t_stage_fwd = (flops.model / 3 + replicated * config.num_hidden_layers) * share / plan.pp
    t_stage_rec = (flops.recompute + replicated * config.num_hidden_layers * (plan.activation_checkpointing == "full")
                   ) * share / plan.pp
    state0 = model_state(config, plan, pp_rank=stage_ranks(plan)[-1])
    comm = communication(config, plan, workload, device, state0, t_layer_fwd, t_layer_rec)
    sim = None
    if plan.pp > 1:
        # Costs in units of one stage's forward; the recompute ratio is rounded so that plans share
        # simulations (P2P is accounted in `communication`, not in the simulated step).
        if workload.microbatches % plan.microbatches:
            raise ValueError(f"microbatches={workload.microbatches} per step is not a multiple of the plan's "
                             f"pp_microbatches={plan.microbatches}")
        v = plan.pp_stages_per_rank
        recompute = Fraction(t_stage_rec / t_stage_fwd).limit_denominator(8) if t_stage_fwd else Fraction(0)
        sim = pipeline_timing(plan.pp_schedule, plan.pp, plan.microbatches, v, recompute,
                              stage_weights(config, plan, workload.seq), plan.pp_memory_limit)
        # A simulated unit is one stage's forward: 1/v of a rank's layers (DualPipe: one chunk, 1/pp of them).
        compute = workload.calls(plan) * float(sim.step_time) * t_stage_fwd * plan.pp / plan.pp_chunks
        bubble = float(sim.bubble_fraction)
    else:
        compute, bubble = workload.microbatches * ((1 + _backward_ratio(flops, state0)) * t_stage_fwd + t_stage_rec), 0.0
    if state0.held_trainable != state0.held_elements:  # LoRA: model FLOPs without the frozen weights' gradients
        flops = dataclasses.replace(flops, dense=flops.dense * (1 + _backward_ratio(flops, state0)) / 3)
    ranks = [rank_memory(config, plan, workload, r, sim.peak_activations[r] if sim is not None else 1)
             for r in range(plan.pp)]
    exposed = sum(c.exposed for c in comm)
    off = None
    if plan.offload != "none":  # every pp rank steps its own shards on the CPU: the slowest sets the pace
        off = max((offload_cost(config, plan, workload, r.state, device) for r in ranks),
                  key=lambda c: (c.exposed, c.host_bytes))
    worst = max(ranks, key=lambda r: r.peak)
    moved = activation_offload_cost(plan, workload, max(ranks, key=lambda r: r.activation_host_peak), device,
                                   compute)
    host = (off.exposed if off is not None else 0.0) + (moved.exposed if moved is not None else 0.0)
    times = {"compute": compute, "bubble": bubble, "exposed_comm": exposed, "offload": host,
             "step": compute + exposed + host}
    return Estimate(config, plan, workload, device, worst, flops, comm, sim, times, off, moved)


def float8_time_factor(config: Any, plan: Plan, device: Device, flops: metrics.FlopsPerToken) -> float:
    """What float8 multiplies compute time by: the converted projections' share of the model FLOPs runs
    at the device's float8 peak instead of bf16's (1 without float8, or on a device without float8)."""
    if plan.float8 == "none" or not device.float8_flops:
        return 1.0
    linear = 6.0 * float8_params_per_layer(config) * config.num_hidden_layers
    share = min(linear / flops.model, 1.0)
    return 1.0 - share + share * device.peak_flops / device.float8_flops


def flop_counter_check(config: Any, seq: int) -> tuple[float, float]:
    """(counted, formula): training FLOPs of one block on one sequence, counted by FlopCounterMode on a
    fake block of the real shape (eager attention: the counter has no formula for the CPU flash
    kernel), and metrics' convention for one block minus its norm weights, which feed no matmul.

    For an MoE block both sides leave the MoE layer out: its FLOPs depend on the routing, which fake
    tensors cannot follow (tests count it with real tensors at small shapes)."""
    mode, parts = acts.build_block(config_key(config), 1, None, "bfloat16")
    block = parts.blocks[0]
    llama.use_attention(block, "eager")
    try:
        with mode, FlopCounterMode(display=False) as counter:
            x = torch.empty(1, seq, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
            pos = torch.arange(seq).unsqueeze(0)
            llama.run_block(block, x, parts.rotary(x, pos), pos).sum().backward()
    finally:
        acts.pin_attention(block)
    heads, d_qk, d_v = roles.score_value_dims(config)
    params = metrics.block_params(config) - 2 * config.hidden_size
    if moe.block_kinds(config)[0] == "moe":  # build_block made block 0's MLP an Identity
        params -= 3 * config.hidden_size * config.intermediate_size
    # A LoRA block: the frozen base's forward and input gradients (4 per weight), the adapters' all 6.
    frozen = any(not p.requires_grad for p in block.parameters())
    adapter = sum(p.numel() for p in block.parameters() if p.requires_grad) if frozen else 0
    dense = 6.0 * params if not adapter else 4.0 * params + 6.0 * adapter
    formula = dense * seq + 6.0 * heads * (d_qk + d_v) * seq * seq
    return float(counter.get_total_flops()), formula
