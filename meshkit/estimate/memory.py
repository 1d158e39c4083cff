"""What one rank holds: model state from the real parameter shapes, and activations per block.

Model state follows what FSDP2 keeps: the *sharded* fp32 parameters (they are the master weights),
sharded fp32 gradients (meshkit reduces in fp32) and AdamW's two fp32 moments, 16 bytes per parameter
divided by the FSDP degree (dp_shard * cp). The bf16 parameter and gradient copies the Playbook
counts as persistent (2 + 2 bytes) exist here only per FSDP unit, while it runs; the Playbook's
DDP/ZeRO-1/2/3 figures are kept beside it for comparison.

Activations are composed here, dense and MoE in one place: the traced part of a block
(`activations`) plus, for MoE blocks, the measured MoE layer (`moe`), scaled by the in-flight
microbatches the pipeline simulator reports. `peak` composes them into the rank's peak.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import transformers

from meshkit.data_parallel.fsdp import expert_shard_dim
from meshkit.estimate import activations as acts
from meshkit.estimate import moe
from meshkit.estimate.spec import (
    BlockUnits,
    ModelState,
    ParamSpec,
    config_from_key,
    config_key,
)
from meshkit.integrations.peft import model as peft_model
from meshkit.integrations.peft.layers import owner_and_part
from meshkit.models import llama, roles
from meshkit.models.moe import convert_moe_blocks
from meshkit.pipeline.schedules import stage_chunks, stage_placement
from meshkit.pipeline.split import split_layers, stages_of_rank
from meshkit.plan import Plan
from meshkit.tensor_parallel.local import ends_are_plain


def stage_ranks(plan: Plan) -> tuple[int, ...]:
    """The pp rank of every stage: the schedule's placement (under a V, the last stage is on rank 0)."""
    return stage_placement(plan.pp_schedule, plan.pp, plan.pp_stages_per_rank) if plan.pp > 1 else (0,)


def chunk_of_stage(plan: Plan) -> tuple[int, ...]:
    """The chunk of layers every stage runs (DualPipe: each of its pp chunks as two stages)."""
    return stage_chunks(plan.pp_schedule, plan.pp, plan.pp_stages_per_rank) if plan.pp > 1 else (0,)


def edge_ranks(plan: Plan) -> tuple[set[int], set[int]]:
    """(the pp ranks holding the embedding, those holding the norm and LM head): the ranks of the stages
    running the first and the last chunk (rank 0 and pp-1 under DualPipe hold both)."""
    chunks, owner = chunk_of_stage(plan), stage_ranks(plan)
    return ({owner[s] for s, c in enumerate(chunks) if c == 0},
            {owner[s] for s, c in enumerate(chunks) if c == max(chunks)})


def stage_layers(config: Any, plan: Plan) -> list[list[range]]:
    """Decoder-block indices of each of a rank's stages, per pipeline rank, from meshkit's own split
    (the embedding and the head count as a layer each, so the first and last stages get fewer blocks).
    Under DualPipe each rank runs two chunks: every block is on two ranks (2x parameter memory)."""
    chunks = chunk_of_stage(plan)
    ranges = split_layers(config.num_hidden_layers, max(chunks) + 1, list(plan.pp_split) or None)
    return [[ranges[chunks[s]] for s in stages_of_rank(r, stage_ranks(plan))] for r in range(plan.pp)]


def stage_blocks(config: Any, plan: Plan) -> list[list[int]]:
    """Blocks of each of a rank's stages, per pipeline rank (`stage_layers`, counted)."""
    return [[len(r) for r in stages] for stages in stage_layers(config, plan)]


def stage_kinds(config: Any, plan: Plan) -> list[list[dict[str, int]]]:
    """Blocks of each kind ("dense", "moe") in each of a rank's stages, per pipeline rank: what a stack
    mixing dense and MoE blocks sums per stage."""
    kinds = moe.block_kinds(config)
    return [[{k: sum(kinds[i] == k for i in r) for k in moe.KINDS if any(kinds[i] == k for i in r)} for r in stages]
            for stages in stage_layers(config, plan)]


# -------------------------------------------------------------------------------- model state


# The dim tensor parallelism splits, by (role, parameter): what `tensor_parallel.styles` applies
# (ColwiseParallel: weight and bias on dim 0; RowwiseParallel: weight on dim 1, bias replicated).
# Packed projections and norms stay whole on every tp rank; a kv_colwise projection is split only
# when tp divides the K/V heads (`_tp_dim`).
_TP_DIMS = {("colwise", "weight"): 0, ("colwise", "bias"): 0, ("kv_colwise", "weight"): 0, ("kv_colwise", "bias"): 0,
            ("rowwise", "weight"): 1}
# A LoRA layer's adapter follows its base (`tensor_parallel.lora`): a column base's A is replicated and B
# split on rows, a row base's A split on columns and B replicated. By (role, adapter part, parameter).
_LORA_TP_DIMS = {("colwise", "lora_B", "weight"): 0, ("colwise", "lora_B", "bias"): 0,
                 ("kv_colwise", "lora_B", "weight"): 0, ("kv_colwise", "lora_B", "bias"): 0,
                 ("rowwise", "lora_A", "weight"): 1}


# The adapter halves `tensor_parallel.lora` replicates over tp: each rank's gradient is its share (Partial).
_PARTIAL_ADAPTERS = {("lora_A", "colwise"), ("lora_A", "kv_colwise"), ("lora_B", "rowwise")}


def _grad_free_edges(specs: tuple[ParamSpec, ...], kind_count: dict[str, int], first: bool) -> int:
    """Of the first stage's SP/TP boundary conjugates, how many backward never reaches: with a frozen
    embedding nothing before the first adapter needs a gradient, so the embedding output's and block
    0's attention input's (and, without attention adapters, its attention output's and MLP input's too)."""
    if not first or next(s for s in specs if s.unit == "embed").trainable or not any(kind_count.values()):
        return 0
    return 1 if any(s.adapter and s.attention for s in specs) else 2


# Roles of layers whose weight `tensor_parallel.rows` keeps whole and row-selects (when not split).
# Like MLA's "latent" layers (whole on every tp rank, each serving its own heads), their gradients
# are partial over tp.
_ROW_SELECTED = ("kv_colwise", "packed_qkv", "packed_gate_up")


def _tp_dim(spec: ParamSpec, config: Any, tp: int) -> int | None:
    """The dim TP splits `spec` on under degree `tp`: None for K/V projections whose heads tp exceeds
    (every rank holds the whole projection and computes its query heads' K/V rows, `roles.kv_rows`)."""
    if spec.role == "kv_colwise" and roles.kv_rows(config, tp, 0) is not None:
        return None
    return spec.tp_dim


@functools.lru_cache(maxsize=16)
def _param_specs(config_json: str, kind: str) -> tuple[tuple[ParamSpec, ...], int, bool]:
    cfg = config_from_key(config_json)
    layers, cfg.num_hidden_layers = cfg.num_hidden_layers, 1
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    if moe.model_experts(cfg) is not None:
        convert_moe_blocks(model)
    model = peft_model.wrap(model, cfg)  # a LoRA model: frozen base, adapters (`ParamSpec.trainable`)
    parts = llama.parts(model)
    block = parts.blocks[0]
    block_roles = roles.block_roles(block, cfg)
    head_params = set(roles.head_params(block, cfg))
    specs = [ParamSpec(tuple(parts.embed.weight.shape), 0, "embed", trainable=parts.embed.weight.requires_grad,
                       plain_ends=ends_are_plain(parts.embed, parts.lm_head))]
    for name, p in block.named_parameters():
        owner, leaf = name.rsplit(".", 1)
        owner, adapter_part = owner_and_part(owner)
        role = block_roles.get(owner, "")
        adapter = adapter_part if adapter_part in ("lora_A", "lora_B") else ""
        tp_dim = 0 if name in head_params else _LORA_TP_DIMS.get((role, adapter, leaf)) if adapter else \
            _TP_DIMS.get((role, leaf))
        in_moe = block_roles.get("mlp") == "moe" and owner.startswith("mlp")
        in_attention = adapter != "" and block_roles.get(owner.rsplit(".", 1)[0]) == "attention"
        specs.append(ParamSpec(tuple(p.shape), tp_dim, "expert" if owner == "mlp.experts" else "block", in_moe,
                               kind, role, owner, p.requires_grad, adapter, in_attention))
    specs.append(ParamSpec(tuple(parts.norm.weight.shape), None, "head", trainable=parts.norm.weight.requires_grad))
    if not parts.tied:
        specs.append(ParamSpec(tuple(parts.lm_head.weight.shape), 0, "head",
                               trainable=parts.lm_head.weight.requires_grad))
    return tuple(specs), layers, parts.tied


def param_specs(config: Any) -> tuple[tuple[ParamSpec, ...], int, bool]:
    """(the edges' parameters and one block's of each kind the stack has, the layer count, whether
    embeddings are tied).

    Shapes come from a one-block model per block kind on the meta device and meshkit's role table, so
    biases (Qwen2), per-head norms (Qwen3) and MLA's latents are covered without a formula per model
    family; MoE blocks are converted to meshkit's layer first, whose router and shared expert TP leaves
    whole. `ParamSpec.kind` says which kind of block a block or expert tensor belongs to.
    """
    present = [k for k in moe.KINDS if k in moe.block_kinds(config)]
    specs: list[ParamSpec] = []
    for i, kind in enumerate(present):
        one, layers, tied = _param_specs(config_key(moe.kind_config(config, kind)), kind)
        specs += [s for s in one if s.unit in ("block", "expert") or i == 0]
    edges = [s for s in specs if s.unit not in ("block", "expert")]
    return (edges[0], *(s for s in specs if s.unit in ("block", "expert")), *edges[1:]), layers, tied


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
    return expert_shard_dim(tuple(_split_shape(spec, tp, tp_rank)), fsdp)


def local_numel(spec: ParamSpec, tp: int, tp_rank: int, fsdp: int, fsdp_rank: int) -> int:
    """Elements of one parameter on one rank: TP's (or ep's) chunk, then FSDP's chunk of that."""
    shape = _split_shape(spec, tp, tp_rank)
    dim = fsdp_dim(spec, tp, tp_rank, fsdp)
    shape[dim] = _chunk(shape[dim], fsdp, fsdp_rank)
    return math.prod(shape)
def _float8_converted(spec: ParamSpec, tp: int) -> bool:
    """Whether `Plan.float8` converts the linear this weight belongs to (`float8.convert.float8_linears`):
    a colwise or rowwise projection of a block, outside the MoE layer, split plainly under TP."""
    return (spec.unit == "block" and len(spec.shape) == 2 and spec.role in ("colwise", "kv_colwise", "rowwise")
            and not spec.tp_summed and (tp == 1 or spec.tp_dim is not None))


def float8_params_per_layer(config: Any) -> float:
    """Parameters of the projections float8 converts, per decoder block, averaged over the stack."""
    specs, layers, _ = param_specs(config)
    kinds = moe.block_kinds(config)
    per_kind = {k: sum(math.prod(s.shape) for s in specs if s.kind == k and _float8_converted(s, 1))
                for k in set(kinds)}
    return sum(per_kind[k] for k in kinds) / layers


def float8_weights_per_block(config: Any, tp: int) -> dict[str, int]:
    """Weight tensors `Plan.float8` converts in one block of each kind: with "tensorwise", their amaxes
    ride one all-reduce before each stage forward (`float8.convert.apply_float8_scales`)."""
    specs = param_specs(config)[0]
    return {k: sum(1 for s in specs if s.kind == k and _float8_converted(s, tp)) for k in moe.KINDS}


def model_state(config: Any, plan: Plan, *, pp_rank: int = 0, tp_rank: int = 0, fsdp_rank: int = 0,
                param_bytes: int = 4) -> ModelState:
    """Exact for the visible local shards (`p.to_local()`), which tests check on a CPU mesh; FSDP2
    pads each shard's allocation to equal rows, at most one row per tensor more."""
    specs, layers, tied = param_specs(config)
    fsdp = plan.dp_shard * plan.cp
    on_rank = [i for r in stage_layers(config, plan)[pp_rank] for i in r]
    kinds = moe.block_kinds(config)
    kind_count = {k: sum(kinds[i] == k for i in on_rank) for k in moe.KINDS}
    blocks = len(on_rank)
    first, last = stage_ranks(plan)[0], stage_ranks(plan)[-1]
    embeds, heads = edge_ranks(plan)
    copy = tied and plan.pp > 1 and pp_rank in heads  # the head's copy of a tied embedding
    edge_count = {"embed": int(pp_rank in embeds) + int(copy), "head": int(pp_rank in heads)}
    numel = tensors = summed_tensors = summed_elements = tied_copy = held_total = partial_tensors = partial_elements = 0
    trained = trained_tensors = trained_held = 0  # what has gradients and optimizer state (a LoRA model: adapters)
    adapter_tensors = adapter_elements = 0  # replicated adapter halves under tp: Partial gradients, summed over tp
    units, grad_units = {"embed": 0, "head": 0}, {"embed": 0, "head": 0}
    kind_units = {k: {"block": 0, "expert": 0, "block_grad": 0, "expert_grad": 0, "float8": 0} for k in moe.KINDS}
    zero = {"DDP": 0.0, "ZeRO-1": 0.0, "ZeRO-2": 0.0, "ZeRO-3": 0.0}
    for spec in specs:
        block_part = spec.unit in ("block", "expert")
        count = kind_count[spec.kind] if block_part else edge_count[spec.unit]
        # Experts: ep neighbouring ranks of dp_shard x cp split the experts (ep is the inner factor),
        # and FSDP shards each rank's block of experts over the fsdp/ep ranks holding the same block.
        split, split_rank, shards, shard_rank = plan.tp, tp_rank, fsdp, fsdp_rank
        spec = dataclasses.replace(spec, tp_dim=_tp_dim(spec, config, plan.tp))
        if spec.unit == "expert":
            spec = dataclasses.replace(spec, tp_dim=0)
            split, split_rank, shards, shard_rank = plan.ep, fsdp_rank % plan.ep, fsdp // plan.ep, fsdp_rank // plan.ep
        local = count * local_numel(spec, split, split_rank, shards, shard_rank)
        numel += local
        tensors += count
        if spec.tp_summed and plan.tp > 1:
            summed_tensors, summed_elements = summed_tensors + count, summed_elements + local
        if spec.unit == "embed" and tied and plan.pp > 1 and first != last:  # all-reduced with the other copy
            tied_copy = local
        held = count * local_numel(spec, split, split_rank, 1, 0)  # the Playbook's Psi on this rank
        held_total += held
        if spec.trainable:
            trained, trained_tensors, trained_held = trained + local, trained_tensors + count, trained_held + held
        if plan.tp > 1 and (spec.adapter, spec.role) in _PARTIAL_ADAPTERS:
            adapter_tensors, adapter_elements = adapter_tensors + count, adapter_elements + held
        if plan.tp > 1 and spec.unit == "block" and not spec.adapter and (
                spec.role in _ROW_SELECTED and spec.tp_dim is None or spec.role == "latent"):
            partial_tensors, partial_elements = partial_tensors + count, partial_elements + held
        if spec.trainable:
            zero["DDP"] += 16.0 * held
            zero["ZeRO-1"] += 4.0 * held + 12.0 * held / shards
            zero["ZeRO-2"] += 2.0 * held + 14.0 * held / shards
            zero["ZeRO-3"] += 16.0 * held / shards
        else:  # frozen: the 16-bit weights alone (no gradient, no optimizer state)
            zero["DDP"], zero["ZeRO-1"], zero["ZeRO-2"] = (zero[k] + 2.0 * held for k in ("DDP", "ZeRO-1", "ZeRO-2"))
            zero["ZeRO-3"] += 2.0 * held / shards
        shape = _split_shape(spec, split, split_rank)
        rows = shape[fsdp_dim(spec, split, split_rank, shards)]
        per_row = math.prod(shape) // max(rows, 1)
        padded = -(-rows // shards) * shards * per_row if count else 0  # FSDP2 pads to equal rows
        if block_part:
            kind_units[spec.kind][spec.unit] += padded
            kind_units[spec.kind][f"{spec.unit}_grad"] += padded if spec.trainable else 0
            if _float8_converted(spec, plan.tp):
                kind_units[spec.kind]["float8"] += padded
        else:
            units[spec.unit] += padded
            grad_units[spec.unit] += padded if spec.trainable else 0
    block_units = tuple(BlockUnits(k, kind_count[k], kind_units[k]["block"], kind_units[k]["expert"],
                                   kind_units[k]["block_grad"], kind_units[k]["expert_grad"],
                                   kind_units[k]["float8"])
                        for k in moe.KINDS if kind_count[k])
    units["block"] = max((u.block for u in block_units), default=0)
    units["expert"] = max((u.expert for u in block_units), default=0)
    grad_units["block"] = max((u.block_grad for u in block_units), default=0)
    grad_units["expert"] = max((u.expert_grad for u in block_units), default=0)
    return ModelState(numel, numel * param_bytes, trained * param_bytes, 2 * trained * param_bytes + 4 * trained_tensors,
                      units, blocks, zero, summed_tensors, summed_elements, tied_copy, held_total, block_units,
                      partial_tensors, partial_elements, tensors, trained_held, grad_units, trained, trained_tensors,
                      adapter_tensors, adapter_elements,
                      _grad_free_edges(specs, kind_count, pp_rank in embeds),
                      any(s.role == "seq_norm" and not s.trainable for s in specs))


# -------------------------------------------------------------------------------- activations


def _one_kind(config: Any, kind: str | None) -> tuple[Any, str]:
    """(the uniform config of `kind`, kind); `kind` may be left out only for a uniform stack."""
    if kind is None:
        kinds = sorted(set(moe.block_kinds(config)))
        if len(kinds) > 1:
            raise ValueError(f"{getattr(config, 'model_type', '?')} mixes dense and MoE blocks: pass kind="
                             f"'dense' or 'moe' for the block to estimate")
        kind = kinds[0]
    return moe.kind_config(config, kind), kind


def block_activations(config: Any, *, batch: int, seq: int, tp: int = 1, sequence_parallel: bool = True,
                      dtype: str = "bfloat16", ac: str = "none", kind: str | None = None) -> dict[str, int]:
    """Bytes one block keeps between its forward and backward, by part, on one rank: the traced
    block, plus the measured MoE layer in an MoE block (each TP rank routes its own sequence shard).

    `seq` is the rank's sequence length (already divided by cp). `kind` ("dense" or "moe") picks the
    block of a stack that mixes both. The rotary cos/sin are not included: they are shared by the
    blocks of a stage (`activations.shared_activations`).
    """
    config, kind = _one_kind(config, kind)
    is_moe = kind == "moe"
    out = acts.traced_block_activations(config, batch=batch, seq=seq, tp=tp, sequence_parallel=sequence_parallel,
                                        dtype=dtype, ac=ac)
    if is_moe:
        sp = tp if (tp > 1 and sequence_parallel) else 1
        out.update(moe.layer_activations(config, batch * seq // sp, dtype, ac))
    return out


def recompute_working_set(config: Any, *, batch: int, seq: int, tp: int = 1, sequence_parallel: bool = True,
                          dtype: str = "bfloat16", ac: str = "none", kind: str | None = None) -> int:
    """Bytes one block (of `kind`, in a mixed stack) needs on top of what it kept while its backward runs.

    Under AC the block's dropped tensors come back all at once (recompute), then its gradients
    need buffers: two of the largest saved tensor for the gradient in flight, or in an MoE block the
    backward of the experts' weighted sum where that is more (`moe.combine_backward_bytes`; the dry
    run measured DeepSeek-V3's, 1.8 GiB per microbatch of 4096 tokens). Without AC only the gradient
    buffers remain.
    """
    config, kind = _one_kind(config, kind)
    kw = dict(batch=batch, seq=seq, tp=tp, sequence_parallel=sequence_parallel, dtype=dtype, kind=kind)
    kept = sum(block_activations(config, ac=ac, **kw).values())
    everything = sum(block_activations(config, ac="none", **kw).values())
    gradients = 2 * batch * acts.trace_block(config, seq, tp, dtype).largest
    if kind == "moe":
        sp = tp if (tp > 1 and sequence_parallel) else 1
        gradients = max(gradients, moe.combine_backward_bytes(config, batch * seq // sp))
    return max(everything - kept, 0) + gradients
