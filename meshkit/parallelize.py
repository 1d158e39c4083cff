"""`parallelize`: apply a Plan to an unmodified HF model, in the one order that composes.

Order: validate (every rank, before any collective) -> mesh -> pipeline split (other ranks' layers
go to the meta device before anything touches them) -> TP/SP -> CP attention -> activation
checkpointing -> torch.compile per block -> FSDP2 per unit (embedding, each block, [norm, lm_head],
stage root) over dp_shard x cp. TP comes before FSDP because FSDP must shard the DTensors TP
produced (2D). Under pipelining FSDP keeps gathered weights through the step
(reshard_after_forward off) so microbatches do not re-gather them. AC wraps the block FSDP will
wrap, so FSDP's all-gather hooks stay outside the recomputed region; compile sees a block with its
TP collectives and checkpoint boundaries but not FSDP's hooks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshkit import data_parallel
from meshkit import mesh as mesh_lib
from meshkit.activation_checkpoint import apply_activation_checkpointing, moe_blocks_full
from meshkit.context_parallel import hf as cp_hf
from meshkit.expert_parallel import apply_expert_parallel
from meshkit.models import llama
from meshkit.models import moe as moe_models
from meshkit.parallel_model import ParallelModel
from meshkit.pipeline import split as pipeline_split
from meshkit.plan import Plan, PlanError
from meshkit.tensor_parallel import apply_tensor_parallel


def parallelize(model: nn.Module, plan: Plan, mesh: DeviceMesh | None = None) -> ParallelModel:
    """Shard and wrap `model` in place according to `plan`; return the handle that trains it.

    `model` is an HF Llama-family `*ForCausalLM`, on CPU, on its GPU, or on the meta device (then call
    `ParallelModel.init_weights` or `load_full_state_dict`: each rank materialises only its shards).
    Every invalid input raises ValueError on every rank before the first collective.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"meshkit.parallelize: plan must be a meshkit.Plan, got {type(plan).__name__}")
    llama.check_supported(model)
    if moe_models.is_moe_model(model):
        moe_models.convert_moe_blocks(model)  # HF sparse blocks -> meshkit MoE, same Parameter objects
    if mesh is None:
        mesh_lib.require_launcher(plan)
    world = mesh.size() if mesh is not None else mesh_lib.world_size_from_env()
    plan = plan.validate(model.config, world)
    _check_moe(plan, llama.moe_modules(llama.parts(model)), model.config)
    if mesh is None:
        mesh = mesh_lib.init_mesh(plan)
    else:
        _check_mesh(mesh, plan)

    device = _mesh_device(mesh)
    cp_hf.install(model)
    parts = llama.parts(model)
    ranges, stage_ids = _pipeline_layout(plan, mesh, len(parts.blocks))
    tied_copy, tied_group = {}, None
    if plan.pp > 1 and parts.tied:  # embedding and head on different ranks: each holds a copy
        tied_copy = llama.untie_for_pipeline(model, keep_copy=len(ranges) - 1 in stage_ids)
        tied_group = mesh_lib.first_last_stage_group(mesh)
        parts = llama.parts(model)
    for module in pipeline_split.modules_not_held(parts, ranges, stage_ids):
        module.to("meta")  # another pipeline rank's layers: keep the names, free the memory
    if not _on_meta(model) and device.type != "cpu":
        for module in pipeline_split.modules_held(parts, ranges, stage_ids):
            module.to(device)
    if plan.cp > 1:
        split = _context_parallel_attention(plan, mesh)
        for attention in llama.attention_modules(parts):
            attention.meshkit_context_parallel = split

    if plan.tp > 1:
        apply_tensor_parallel(
            parts, mesh["tp"], sequence_parallel=plan.sequence_parallel, loss_parallel=plan.loss_parallel
        )
    moes = llama.moe_modules(parts)
    expert_fsdp = _apply_expert_parallel(plan, mesh, moes) if moes else None
    held = sorted({i for s in stage_ids for i in ranges[s]})
    held_moes = [m for m in moes if any(m is getattr(parts.blocks[i], "mlp", None) for i in held)]
    blocks = list(parts.blocks)
    wrapped = apply_activation_checkpointing([blocks[i] for i in held], plan.activation_checkpointing,
                                             full_only=llama.has_moe if moe_blocks_full(plan.tp, plan.ep) else lambda block: False)
    for i, block in zip(held, wrapped):
        blocks[i] = block
        if plan.compile:
            block.compile()
    stages = pipeline_split.build_stages(parts, blocks, ranges, stage_ids)
    use_fsdp = data_parallel.needs_fsdp(mesh_lib.axis_size(mesh, "dp_shard_cp"), plan.dp_replicate, plan.param_dtype)
    if use_fsdp:
        reshard = plan.reshard_after_forward if plan.reshard_after_forward is not None else plan.pp == 1
        for moe in held_moes:
            # Experts get their own unit: sharded over the data ranks that ep leaves.
            data_parallel.apply_fsdp([], moe.experts, expert_fsdp, param_dtype=plan.param_dtype,
                                     reduce_dtype=plan.reduce_dtype, reshard_after_forward=reshard,
                                     shard_placement_fn=data_parallel.expert_placement(expert_fsdp.shape[-1]))
        for stage in stages.values():
            # A tied weight lives in both the embedding and the head; it can belong to one unit only, so
            # with tying both stay in the root unit.
            edges = [stage.embed] if stage.embed is not None and not parts.tied else []
            tail = [[stage.norm, stage.lm_head]] if stage.lm_head is not None and not parts.tied else []
            data_parallel.apply_fsdp(
                edges + list(stage.layers.values()) + tail,
                stage,
                mesh_lib.fsdp_mesh(mesh),
                param_dtype=plan.param_dtype,
                reduce_dtype=plan.reduce_dtype,
                reshard_after_forward=reshard,
            )
    tp_summed = [p for m in held_moes for p in m.parameters()] if plan.tp > 1 else []
    return ParallelModel(model, plan, mesh, stages, device, reduce_tp_grads=plan.tp > 1 and not use_fsdp,
                         tp_summed_params=tp_summed, tied_copy=tied_copy, tied_group=tied_group)


def _check_moe(plan: Plan, moes: list, config) -> None:
    """MoE rules the config alone cannot show; raised on every rank before any collective."""
    problems = []
    if moes and plan.pp > 1 and getattr(config, "output_router_logits", False):
        problems.append(
            f"pp={plan.pp} with output_router_logits=true: HF's auxiliary loss pools router statistics over all "
            f"layers, which pipelining puts on different ranks; fix: config.output_router_logits=false (and, "
            f"for balancing, a per-layer aux_loss_coef or bias_update_rate on the MoE layers)"
        )
    if plan.ep > 1 and not moes:
        problems.append(
            f"ep={plan.ep}: the model has no meshkit MoE layers to shard; fix: ep=1, or swap its MLPs for "
            f"meshkit.MoE layers (HF Mixtral / Qwen3-MoE blocks are converted automatically)"
        )
    for moe in moes[:1]:
        if moe.num_experts % plan.ep:
            problems.append(
                f"ep={plan.ep}: each expert-parallel rank holds num_experts/ep experts, and {plan.ep} does not "
                f"divide num_experts={moe.num_experts}; fix: an ep dividing {moe.num_experts}"
            )
    if moes and plan.tp > 1 and not plan.sequence_parallel:
        problems.append(
            f"tp={plan.tp} with MoE layers needs sequence_parallel=true: TP ranks route their own sequence shard "
            f"(experts are never split by TP); fix: sequence_parallel=true"
        )
    if problems:
        raise PlanError("Plan is invalid:\n" + "\n".join(f"  - {p}" for p in problems))


def _apply_expert_parallel(plan: Plan, mesh: DeviceMesh, moes: list) -> DeviceMesh:
    """Shard experts over ep (folded into dp_shard x cp); return the mesh FSDP shards experts over."""
    ep_mesh, outer = mesh_lib.expert_axes(mesh, plan.ep)
    load_group = mesh_lib.axis(mesh, "dp_cp_tp").get_group()
    for moe in moes:
        if plan.ep > 1:
            apply_expert_parallel(moe, ep_mesh, load_group=load_group)
        else:
            moe.load_group = load_group
        # Each microbatch's aux loss is a whole batch's worth; the step's is their mean.
        moe.aux_loss_scale = 1.0 / plan.microbatches
    return mesh_lib.expert_fsdp_mesh(mesh, outer)


def _pipeline_layout(plan: Plan, mesh: DeviceMesh, num_layers: int) -> tuple[list[range], list[int]]:
    """Every stage's layer range, and the stages this rank holds (all of them without pipelining)."""
    num_stages = plan.pp * plan.pp_virtual_stages
    ranges = pipeline_split.split_layers(num_layers, num_stages, plan.pp_split or None)
    if plan.pp == 1:
        return ranges, list(range(num_stages))
    return ranges, pipeline_split.stages_of_rank(mesh["pp"].get_local_rank(), plan.pp, plan.pp_virtual_stages)


def _context_parallel_attention(plan: Plan, mesh: DeviceMesh) -> cp_hf.ContextParallelAttention:
    if plan.cp_attention == "usp":
        ulysses_group, ring_group = mesh_lib.usp_axes(mesh, plan.cp_ulysses)
        return cp_hf.ContextParallelAttention("usp", plan.cp_layout, ulysses_group=ulysses_group,
                                              ring_group=ring_group)
    return cp_hf.ContextParallelAttention(plan.cp_attention, plan.cp_layout, group=mesh["cp"])


def _check_mesh(mesh: DeviceMesh, plan: Plan) -> None:
    names = tuple(mesh.mesh_dim_names or ())
    expected = tuple(getattr(plan, axis) for axis in mesh_lib.AXES)
    if names != mesh_lib.AXES or tuple(mesh.shape) != expected:
        raise PlanError(
            f"Plan is invalid:\n  - mesh {dict(zip(names, mesh.shape))} does not match the plan "
            f"{dict(zip(mesh_lib.AXES, expected))}; fix: pass mesh=meshkit.init_mesh(plan) or mesh=None"
        )


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _on_meta(model: nn.Module) -> bool:
    """Whether the user built the model on the meta device (then nothing is moved; init materialises)."""
    return all(p.is_meta for p in model.parameters())
