"""`parallelize`: apply a Plan to an unmodified HF model, in the one order that composes.

Order: validate (every rank, before any collective) -> mesh -> pipeline split (other ranks' layers
go to the meta device before anything touches them) -> float8 linears -> TP/SP -> EP -> CP attention
-> activation checkpointing -> torch.compile per block -> activation offload -> FSDP2 per unit
(experts, embedding, each block, [norm, lm_head], stage root) over dp_shard x cp, with its host or
NVMe offload. TP comes before FSDP because FSDP must shard the
DTensors TP produced (2D). Under pipelining FSDP keeps gathered weights through the step
(reshard_after_forward off) so microbatches do not re-gather them. AC wraps the block FSDP will
wrap, so FSDP's all-gather hooks stay outside the recomputed region; compile sees a block with its
TP collectives and checkpoint boundaries but not FSDP's hooks. float8 converts the linears before TP
shards them (TP shards torchao's float8 modules); activation offload wraps the compiled block, so its
saved-tensor hooks see what the compiled graph saves, and sits inside the FSDP unit, so gathered
weights are parameters it leaves alone.

The module is `compose`, not `parallelize`: `meshkit.parallelize` is the function, and a module of
the same name beside it would be shadowed by it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshkit import mesh as mesh_lib
from meshkit._compat.collectives import align_group_timeouts
from meshkit.activation_checkpoint import apply_activation_checkpointing
from meshkit.activation_offload import apply_activation_offload
from meshkit.context_parallel.hf import ContextParallelAttention
from meshkit.data_parallel import nvme
from meshkit.data_parallel.fsdp import apply_data_parallel
from meshkit.data_parallel.rules import shards_with_fsdp
from meshkit.expert_parallel import MoE, apply_expert_parallel
from meshkit.float8 import convert as float8
from meshkit.inference.hf_forward import install_hf_forward
from meshkit.integrations.peft import model as peft_model
from meshkit.models import llama, roles
from meshkit.models import moe as moe_models
from meshkit.models.stage import build_stages
from meshkit.parallel_model import ParallelModel, Sharded
from meshkit.pipeline import split as pipeline_split
from meshkit.pipeline.schedules import stage_chunks, stage_placement
from meshkit.plan import DTYPES, Plan, PlanError
from meshkit.tensor_parallel.path import runs_on_local_shards
from meshkit.tensor_parallel.styles import apply_tensor_parallel


def parallelize(model: nn.Module, plan: Plan, mesh: DeviceMesh | None = None) -> ParallelModel:
    """Shard and wrap `model` in place according to `plan`; return the handle that trains it.

    `model` is an HF Llama-family `*ForCausalLM`, or a PEFT `PeftModel` wrapping one with a LoRA adapter
    (its frozen weights stay frozen, each adapter is sharded like its base layer: `tensor_parallel.lora`,
    names stay PEFT's), on CPU, on its GPU, or on the meta device (then call
    `ParallelModel.init_weights` or `load_full_state_dict`: each rank materialises only its shards).
    Every invalid input raises ValueError on every rank before the first collective.
    """
    plan, mesh = _validate(model, plan, mesh)
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    llama.use_meshkit_attention(model)
    split = _apply_pipeline_split(model, plan, mesh)
    _apply_float8(split, plan, mesh)
    _apply_tensor_parallel(split, plan, mesh)
    expert_mesh = _apply_expert_parallel(split, plan, mesh)
    _keep_frozen(model, frozen)
    context_parallel = _context_parallel_attention(plan, mesh)
    blocks = _apply_activation_checkpointing(split, plan)
    _apply_compile(blocks, split.held_blocks, plan)
    _apply_activation_offload(blocks, split.held_blocks, plan, mesh)
    stages = build_stages(split.parts, blocks, split.ranges, split.stage_ids, context_parallel, split.chunks)
    use_fsdp = apply_data_parallel(stages, _held_moes(split), plan, mesh, expert_mesh, tied=split.parts.tied)
    _apply_nvme_offload(stages, plan, mesh)
    _apply_float8_scales(stages, plan, use_fsdp)
    align_group_timeouts()  # groups made while parallelizing (expert axes) time out like the default group
    pm = ParallelModel(model, plan, mesh, Sharded(stages, mesh_lib.mesh_device(mesh),
                                                  reduce_tp_grads=plan.tp > 1 and not use_fsdp,
                                                  tp_summed_params=_tp_summed_params(split, plan),
                                                  tied_aliases=split.tied_aliases, tied_group=split.tied_group,
                                                  mirror_group=split.mirror_group))
    for handle in {id(m): m for m in (model, llama.causal_lm(model))}.values():  # a PeftModel and its HF model
        install_hf_forward(handle, pm)  # model(...) and model.generate run through meshkit from here on
    return pm


def _keep_frozen(model: nn.Module, frozen: set[str]) -> None:
    """Freeze again what the user froze: torch's SequenceParallel makes fresh parameters that
    require grad, which would train a LoRA model's frozen norms (NeMo AutoModel #547 trained every
    parameter that way). Before FSDP, which keeps each parameter's flag."""
    for name, param in model.named_parameters(remove_duplicate=False):
        if name in frozen and param.requires_grad:
            param.requires_grad_(False)


def _validate(model: nn.Module, plan: Plan, mesh: DeviceMesh | None) -> tuple[Plan, DeviceMesh]:
    """Check plan, model and mesh on every rank before any collective; then build the mesh if needed.

    HF sparse MoE blocks are converted to meshkit's `MoE` first (same Parameter objects), so the
    MoE rules see the layers that will run; the blocks' structure (whole-projection q/k norms vs
    replicated K/V heads) is checked here too, not when TP meets it after the mesh exists.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"meshkit.parallelize: plan must be a meshkit.Plan, got {type(plan).__name__}")
    llama.check_supported(model)
    if peft_model.is_peft_model(model):  # before MoE conversion, which would drop an adapter on an MoE block
        peft_problems = peft_model.adapter_problems(model, plan.tp)
        if peft_problems:
            raise PlanError.of(*peft_problems)
    lm = llama.causal_lm(model)
    if moe_models.is_moe_model(lm):
        moe_models.convert_moe_blocks(lm)
    if mesh is None:
        mesh_lib.require_launcher(plan)
    world = mesh.size() if mesh is not None else mesh_lib.world_size_from_env()
    plan = plan.validate(model.config, world)
    parts = llama.parts(model)
    problems = moe_models.plan_problems(llama.moe_modules(parts), model.config, pp=plan.pp, tp=plan.tp,
                                        ep=plan.ep, sequence_parallel=plan.sequence_parallel)
    problems += roles.structure_problems(parts.blocks, model.config, plan.tp)
    problems += peft_model.tp_problems(model, plan.tp) if peft_model.is_peft_model(model) else []
    if plan.offload == "nvme":
        problems += filter(None, [nvme.dir_problem(plan.offload_dir)])
    if plan.float8 != "none" and not problems:
        problems += float8.module_problems(parts.blocks, model.config, plan.tp, plan.float8)
    if problems:
        raise PlanError.of(*problems)
    if mesh is None:
        return plan, mesh_lib.init_mesh(plan)
    mesh_lib.check_mesh(mesh, plan)
    return plan, mesh


class _PipelineSplit(NamedTuple):
    parts: llama.CausalLMParts
    ranges: list[range]  # every stage's decoder blocks
    stage_ids: list[int]  # the stages this rank holds
    held_blocks: list[int]  # the decoder blocks of those stages
    tied_aliases: dict[str, str]
    tied_group: dist.ProcessGroup | None
    chunks: tuple[int, ...]  # the chunk of layers every stage runs (DualPipe: each chunk twice)
    mirror_group: dist.ProcessGroup | None  # DualPipe: the pp pair (r, pp-1-r) holding the same chunks


def _apply_pipeline_split(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> _PipelineSplit:
    """Cut the model into chunks of layers, one per stage (DualPipe: each chunk runs as two stages, on
    two ranks); other ranks' layers go to meta, this rank's to its device.

    A tied embedding under pipelining is split first: the last stage gets its own copy as the LM
    head, answering to the embedding's name, and the first/last-stage pair sums the two gradients.
    """
    parts = llama.parts(model)
    pipelined = plan.pp > 1
    chunks = stage_chunks(plan.pp_schedule, plan.pp, plan.pp_stages_per_rank) if pipelined else (0,)
    chunk_ranges = pipeline_split.split_layers(len(parts.blocks), plan.pp_chunks, plan.pp_split or None)
    placement = stage_placement(plan.pp_schedule, plan.pp, plan.pp_stages_per_rank) if pipelined else (0,)
    stage_ids = pipeline_split.stages_of_rank(mesh["pp"].get_local_rank(), placement)
    chunk_ids = sorted({chunks[s] for s in stage_ids})
    aliases, group = {}, None
    if pipelined and parts.tied:  # embedding and head in different stage modules: each holds a copy
        aliases = llama.untie_for_pipeline(model, keep_copy=plan.pp_chunks - 1 in chunk_ids)
        # Under a V placement (and DualPipe's) the first and last stage share a rank: their copies'
        # gradients are summed there, locally.
        group = mesh_lib.first_last_stage_group(mesh) if placement[0] != placement[-1] else None
        parts = llama.parts(model)
    for module in pipeline_split.modules_not_held(parts, chunk_ranges, chunk_ids):
        module.to("meta")  # another pipeline rank's layers: keep the names, free the memory
    device = mesh_lib.mesh_device(mesh)
    if not all(p.is_meta for p in model.parameters()) and device.type != "cpu":
        for module in pipeline_split.modules_held(parts, chunk_ranges, chunk_ids):
            module.to(device)
    held = sorted({i for c in chunk_ids for i in chunk_ranges[c]})
    mirror = mesh_lib.mirror_pair_group(mesh) if pipelined and max(chunks) + 1 < len(chunks) else None
    return _PipelineSplit(parts, [chunk_ranges[c] for c in chunks], stage_ids, held, aliases, group, chunks,
                          mirror)


def _held_moes(split: _PipelineSplit) -> list[MoE]:
    """The MoE layers of the blocks this rank's stages hold."""
    return [split.parts.blocks[i].mlp for i in split.held_blocks if llama.has_moe(split.parts.blocks[i])]


def _apply_tensor_parallel(split: _PipelineSplit, plan: Plan, mesh: DeviceMesh) -> None:
    """Shard every block over tp (plain blocks on local shards where the plan allows it)."""
    if plan.tp > 1:
        apply_tensor_parallel(split.parts, mesh["tp"], sequence_parallel=plan.sequence_parallel,
                              loss_parallel=plan.loss_parallel, local=runs_on_local_shards(plan),
                              saved_reduce_scatter=plan.activation_checkpointing == "selective")


def _tp_summed_params(split: _PipelineSplit, plan: Plan) -> tuple[nn.Parameter, ...]:
    """The parameters TP leaves whole on every tp rank whose gradients meshkit sums over tp itself:
    the MoE layers' router, experts and shared expert (each tp rank routes its own sequence shard).
    Read once FSDP has wrapped them: `fully_shard` replaces a module's parameter objects."""
    return tuple(p for moe in _held_moes(split) for p in moe.parameters()) if plan.tp > 1 else ()


def _apply_expert_parallel(split: _PipelineSplit, plan: Plan, mesh: DeviceMesh) -> DeviceMesh | None:
    """Shard experts over ep (folded into dp_shard x cp); return the mesh FSDP shards experts over
    (None for a dense model).

    Balancing statistics are summed over every rank that splits the batch's tokens (`dp_cp_tp`), and
    each microbatch's aux loss is a whole batch's worth, so the step's is their mean.
    """
    moes = llama.moe_modules(split.parts)
    if not moes:
        return None
    ep_mesh, outer = mesh_lib.expert_axes(mesh, plan.ep)
    load_group = mesh_lib.axis(mesh, "dp_cp_tp").get_group()
    for moe in moes:
        apply_expert_parallel(moe, ep_mesh if plan.ep > 1 else None, load_group=load_group,
                              aux_loss_scale=1.0 / plan.microbatches)
    return mesh_lib.expert_fsdp_mesh(mesh, outer)


def _context_parallel_attention(plan: Plan, mesh: DeviceMesh) -> ContextParallelAttention | None:
    """How every attention layer splits its sequence over the cp axis (USP, and the all-gather kind with
    cp_ulysses > 1: a Ulysses x outer grid), or None without cp. dK/dV travel in the plan's reduce dtype."""
    if plan.cp == 1:
        return None
    grad_dtype = DTYPES[plan.reduce_dtype]
    if plan.cp_attention == "usp" or (plan.cp_attention == "allgather" and plan.cp_ulysses > 1):
        ulysses_group, ring_group = mesh_lib.usp_axes(mesh, plan.cp_ulysses)
        return ContextParallelAttention(plan.cp_attention, plan.cp_layout, ulysses_group=ulysses_group,
                                        ring_group=ring_group, grad_dtype=grad_dtype)
    return ContextParallelAttention(plan.cp_attention, plan.cp_layout, group=mesh["cp"], grad_dtype=grad_dtype,
                                    keep_kv=plan.cp_keep_kv)


def _apply_activation_checkpointing(split: _PipelineSplit, plan: Plan) -> list[nn.Module]:
    """Every decoder block, the held ones wrapped for the plan's activation checkpointing mode."""
    blocks = list(split.parts.blocks)
    held = split.held_blocks
    for i, block in zip(held, apply_activation_checkpointing([blocks[i] for i in held], plan.activation_checkpointing)):
        blocks[i] = block
    return blocks


def _apply_float8(split: _PipelineSplit, plan: Plan, mesh: DeviceMesh) -> None:
    """Swap the held blocks' projections for torchao's float8 linears (before TP shards them)."""
    if plan.float8 != "none":
        float8.apply_float8([split.parts.blocks[i] for i in split.held_blocks], split.parts.config,
                            recipe=plan.float8, tp=plan.tp, fsdp=shards_with_fsdp(plan))


def _apply_float8_scales(stages: dict[int, nn.Module], plan: Plan, use_fsdp: bool) -> None:
    """Where FSDP all-gathers float8 weights, recompute their scales before each stage's forward."""
    if plan.float8 != "none" and float8.gathers_in_float8(plan.float8, use_fsdp):
        float8.apply_float8_scales(stages.values())


def _apply_nvme_offload(stages: dict[int, nn.Module], plan: Plan, mesh: DeviceMesh) -> None:
    """With offload="nvme": the optimizer state of this rank's FSDP units in a file under offload_dir."""
    if plan.offload == "nvme":
        nvme.apply_nvme_offload(list(stages.values()), plan.offload_dir, mesh_lib.mesh_device(mesh))


def _apply_activation_offload(blocks: list[nn.Module], held: list[int], plan: Plan, mesh: DeviceMesh) -> None:
    """Wrap each held (checkpointed, compiled) block so what autograd saves in it lives in host memory."""
    if plan.activation_offload:
        apply_activation_offload(blocks, held, mesh_lib.mesh_device(mesh))


def _apply_compile(blocks: list[nn.Module], held: list[int], plan: Plan) -> None:
    """torch.compile each held (checkpointed) block in place, when the plan asks for it."""
    if plan.compile:
        for i in held:
            blocks[i].compile()
