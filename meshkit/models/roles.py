"""The role of every layer in a decoder block, read from what the model declares.

transformers ships each decoder config with a `base_model_tp_plan` ({"layers.*.self_attn.q_proj":
"colwise", ...}): which linears split on output features and which on input features. That plan
names the linears; the module structure says the rest: which norms sit on the residual stream,
whether a projection is packed ([q | k | v] in one weight, [gate | up] in one weight), whether a
q/k norm normalises each head or the whole projection. This module turns both into meshkit's roles;
`tensor_parallel` turns roles into styles. Nothing here is written per family.

Roles (names relative to the block):
  colwise / rowwise   linear split on output / input features (HF's `colwise_gather_output` and
                      `rowwise_split_input` too: meshkit keeps the heads local instead of gathering)
  kv_colwise          a K or V projection: colwise when tp divides the K/V heads, else each rank
                      computes the one K/V head its query heads read (replicated K/V heads)
  packed_qkv / packed_gate_up
                      one linear holding several logical parts; each rank takes its shard of each
  seq_norm            a norm on the residual stream (sequence-sharded under SP)
  head_norm           a q/k norm over head_dim, shared by all heads
  row_norm            a q/k norm over the whole projection (all heads: OLMo-2); needs the full row
  attention / mlp     modules whose input leaves the sequence-sharded region under SP

Multi-head latent attention (DeepSeek-V3: `kv_lora_rank` set; its config declares no attention plan)
splits by heads as well: the up-projections `q_b_proj` (or `q_proj` without a q latent) and
`kv_b_proj` are colwise (both lay their output out head-major, [nope | rope] of q and [k_nope | v] of
kv per head, so a contiguous row shard is whole heads) and `o_proj` rowwise. The heads share two
low-rank latents, and the rope key inside the kv one:
  latent              a down-projection or latent norm (q_a_proj, q_a_layernorm, kv_a_proj_with_mqa,
                      kv_a_layernorm): weight replicated, computed whole by every rank for the whole
                      sequence; its gradient, from this rank's heads only, is a partial sum over tp.
                      Not on the sequence shard under SP: HF's attention reads the sequence length
                      from its input, so that input must be the gathered sequence.
"""

from __future__ import annotations

import copy

from torch import nn

_PLAN_ROLES = {
    "colwise": "colwise",
    "colwise_gather_output": "colwise",
    "rowwise": "rowwise",
    "rowwise_split_input": "rowwise",
}
# Used when a config's plan declares nothing for the decoder blocks (older configs; gpt-oss's names
# only the embedding): Llama's, which every family here extends.
_DEFAULT_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}


def attention_dims(config) -> tuple[int, int, int]:
    """(query heads, K/V heads, head dim): K/V heads default to the query heads, head_dim to
    hidden/heads, as HF's attention modules read them."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def local_kv_heads(config, tp: int) -> int:
    """K/V heads one tp rank computes: its share when tp divides them, else the one head its query
    heads read (K/V heads replicated, `kv_rows`)."""
    _, kv_heads, _ = attention_dims(config)
    return kv_heads // tp if kv_heads % tp == 0 else 1


def score_value_dims(config) -> tuple[int, int, int]:
    """(query heads, per-head dim of the scores q.k, per-head dim of the values): head_dim twice,
    except for multi-head latent attention (DeepSeek-V3), whose scores use qk_nope + qk_rope dims
    and whose values use v_head_dim. What attention FLOPs are made of."""
    heads, _, head_dim = attention_dims(config)
    if getattr(config, "kv_lora_rank", None):
        return heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    return heads, head_dim, head_dim


def kernel_dims(config) -> tuple[int, int, int]:
    """(query heads, K/V heads, head dim) of the q, k and v the attention kernels receive: what
    context parallelism moves. `attention_dims`, except for multi-head latent attention (DeepSeek-V3),
    where every head has its own K and V (up-projected from the latent) and q, k and v share one head
    dim, max(qk_nope + qk_rope, v_head_dim): meshkit zero-pads the narrower side for the kernels and the
    ring's packed K/V buffer (`context_parallel.hf`), and cuts the output back after attention."""
    heads, kv_heads, head_dim = attention_dims(config)
    if getattr(config, "kv_lora_rank", None):
        _, d_qk, d_v = score_value_dims(config)
        return heads, heads, max(d_qk, d_v)
    return heads, kv_heads, head_dim


def attention_params(config) -> int:
    """Parameters of one block's attention from the config alone: Llama's q/k/v/o (with biases when
    `attention_bias`), or multi-head latent attention's down projections, latent norms and up
    projections. Small extras the config does not name (q/k norms, Qwen2's biases) are not counted."""
    h = config.hidden_size
    heads, kv_heads, d = attention_dims(config)
    if not getattr(config, "kv_lora_rank", None):
        attn = h * heads * d + 2 * h * kv_heads * d + heads * d * h
        if getattr(config, "attention_bias", False):
            attn += heads * d + 2 * kv_heads * d + h
        return attn
    _, d_qk, d_v = score_value_dims(config)
    q_rank, kv_rank, rope = config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim
    q = h * heads * d_qk if q_rank is None else h * q_rank + q_rank + q_rank * heads * d_qk
    kv = h * (kv_rank + rope) + kv_rank + kv_rank * heads * (config.qk_nope_head_dim + d_v)
    bias = (0 if q_rank is None else q_rank) + kv_rank + rope + h if getattr(config, "attention_bias", False) else 0
    return q + kv + heads * d_v * h + bias


def tp_replicated_params(config) -> int:
    """Weights of one block whose matmuls every tp rank computes whole, for the whole sequence: multi-head
    latent attention's down-projections (`latent` role; their norms feed no matmul), 0 for other
    attention. What tensor parallelism does not divide of a block's FLOPs."""
    if not getattr(config, "kv_lora_rank", None):
        return 0
    return config.hidden_size * ((config.q_lora_rank or 0) + config.kv_lora_rank + config.qk_rope_head_dim)


def declared_block_plan(config) -> dict[str, str]:
    """The config's tensor-parallel plan for one decoder block: {name in block: HF style}; Llama's
    when the config declares nothing for the blocks."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    prefix = "layers.*."
    declared = {key[len(prefix):]: style for key, style in plan.items() if key.startswith(prefix)}
    return declared or dict(_DEFAULT_PLAN)


def head_params(block: nn.Module, config) -> list[str]:
    """The attention module's own per-query-head parameters (gpt-oss's `sinks`: one logit per head
    in every row's softmax denominator), by name in the block.

    Read from the structure: a 1-D parameter of the attention module itself (not of its linears)
    with one entry per query head. Newer plans declare such a parameter `colwise`
    (`layers.*.self_attn.sinks`); gpt-oss's declares nothing. Under TP each belongs with the query
    heads a rank computes, so it is split like them (Shard(0)), also when K/V heads are replicated.
    """
    heads, _, _ = attention_dims(config)
    attn = getattr(block, "self_attn", None)
    if attn is None:
        return []
    return [f"self_attn.{name}" for name, p in attn.named_parameters(recurse=False)
            if p.ndim == 1 and p.shape[0] == heads]


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith(("RMSNorm", "LayerNorm")) and getattr(module, "weight", None) is not None


def block_roles(block: nn.Module, config) -> dict[str, str]:
    """Role of every layer of `block` that tensor parallelism must know, in execution order.

    Linears come from the config's plan; an MoE block's `mlp` (meshkit `MoE`, routed experts) is
    left to expert parallelism, so its plan entries are dropped. Raises ValueError for a declared
    style meshkit does not know, naming it.
    """
    heads, kv_heads, head_dim = attention_dims(config)
    modules = dict(block.named_modules())
    roles: dict[str, str] = {}
    for name, module in block.named_children():
        if _is_norm(module):
            roles[name] = "seq_norm"
        elif name in ("self_attn", "mlp"):
            roles[name] = "attention" if name == "self_attn" else "mlp"
    latent = _latent_roles(modules, config)
    roles.update(latent)  # the model declares no attention plan for them
    mlp_is_moe = type(modules.get("mlp")).__name__ == "MoE"
    for name, style in declared_block_plan(config).items():
        if name not in modules or (mlp_is_moe and name.startswith("mlp")) or name in latent:
            continue
        module = getattr(modules[name], "base_layer", modules[name])  # a PEFT LoRA layer: the linear it wraps
        if style == "replicated_with_grad_allreduce":
            roles[name] = "head_norm"
            continue
        role = _PLAN_ROLES.get(style)
        if role is None:
            raise ValueError(f"{type(block).__name__}.{name}: tensor-parallel style {style!r} from "
                             f"{type(config).__name__}.base_model_tp_plan has no meshkit equivalent")
        if role == "colwise" and isinstance(module, nn.Linear):
            out = module.out_features
            if name.startswith("self_attn") and out == (heads + 2 * kv_heads) * head_dim:
                role = "packed_qkv"
            elif name.startswith("self_attn") and out == kv_heads * head_dim and kv_heads != heads:
                role = "kv_colwise"
            elif name.startswith("mlp") and out == 2 * getattr(config, "intermediate_size", -1):
                role = "packed_gate_up"
        roles[name] = role
    if mlp_is_moe:
        roles["mlp"] = "moe"
    for name, module in modules.items():  # q/k norms the plan leaves implicit (Qwen3, OLMo-2)
        parent, _, leaf = name.rpartition(".")
        if parent == "self_attn" and leaf in ("q_norm", "k_norm") and _is_norm(module):
            roles[name] = "head_norm" if module.weight.shape[-1] == head_dim else "row_norm"
    return roles


def _latent_roles(modules: dict[str, nn.Module], config) -> dict[str, str]:
    """Roles of a multi-head latent attention's layers (module docstring), {} for any other attention."""
    if not getattr(config, "kv_lora_rank", None) or "self_attn.kv_a_proj_with_mqa" not in modules:
        return {}
    roles = {"self_attn.q_a_proj": "latent", "self_attn.q_a_layernorm": "latent", "self_attn.q_b_proj": "colwise",
             "self_attn.q_proj": "colwise", "self_attn.kv_a_proj_with_mqa": "latent",
             "self_attn.kv_a_layernorm": "latent", "self_attn.kv_b_proj": "colwise", "self_attn.o_proj": "rowwise"}
    return {name: role for name, role in roles.items() if name in modules}


def outputs_edited_in_place(roles: dict[str, str], config) -> list[str]:
    """The layers whose outputs the HF attention modifies in place: with `clip_qkv` (OLMo, OLMoE) it
    clamps q, k and v in place right after their projections (after the q/k norms where there are
    any). Under TP those outputs are views of DTensor shards, which must then be copied first."""
    if not getattr(config, "clip_qkv", None):
        return []
    names = []
    for part in ("q", "k", "v"):
        norm, proj = f"self_attn.{part}_norm", f"self_attn.{part}_proj"
        names += [norm] if norm in roles else [proj] if proj in roles else []
    return names


def kv_rows(config, tp: int, rank: int) -> tuple[int, int] | None:
    """The rows of a K/V projection rank `rank` computes when tp exceeds the K/V heads, or None
    when tp divides them (plain colwise). With tp = c * kv_heads, ranks [h*c, (h+1)*c) share head h."""
    heads, kv_heads, head_dim = attention_dims(config)
    if kv_heads % tp == 0:
        return None
    head = rank * kv_heads // tp
    return head * head_dim, (head + 1) * head_dim


def replication_problem(roles: dict[str, str], config, tp: int) -> str | None:
    """Why `tp` cannot replicate this block's K/V heads, naming the largest degree that works, or None.

    A q/k norm over the whole projection (OLMo-2, OLMoE) normalises all K/V heads together; a rank
    holding one replicated K/V head sees only that head's features, so its variance would be wrong.
    """
    heads, kv_heads, _ = attention_dims(config)
    if tp <= 1 or kv_heads % tp == 0 or "row_norm" not in roles.values():
        return None
    ok = [d for d in range(1, tp + 1) if kv_heads % d == 0 and heads % d == 0]
    return (f"tp={tp}: this model's q/k norms span the whole projection (all {kv_heads} K/V heads), which a rank "
            f"holding replicated K/V heads cannot normalise, so tp must divide num_key_value_heads={kv_heads}; "
            f"the largest tp that works is {max(ok)}; fix: tp in {ok}")


def structure_problems(blocks: list[nn.Module], config, tp: int) -> list[str]:
    """What the module structure rules out for `tp`, before any collective (the config alone cannot
    show whether a q/k norm spans the whole projection). One entry per distinct problem."""
    problems: list[str] = []
    for block in blocks:
        problem = replication_problem(block_roles(block, config), config, tp)
        if problem and problem not in problems:
            problems.append(problem)
    return problems


def selected_rows(roles: dict[str, str], config, tp: int, rank: int) -> dict[str, list[tuple[int, int]]]:
    """{layer: row ranges of its weight this rank computes} for layers plain colwise cannot split."""
    heads, kv_heads, head_dim = attention_dims(config)
    out: dict[str, list[tuple[int, int]]] = {}
    kv = kv_rows(config, tp, rank)
    problem = replication_problem(roles, config, tp)
    if problem:
        raise ValueError(problem)
    for name, role in roles.items():
        if role == "kv_colwise" and kv is not None:
            out[name] = [kv]
        elif role == "packed_qkv":
            q_per = heads // tp * head_dim
            q = (rank * q_per, (rank + 1) * q_per)
            if kv is None:
                kv_per = kv_heads // tp * head_dim
                k_local = (rank * kv_per, (rank + 1) * kv_per)
            else:
                k_local = kv
            q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
            out[name] = [q, (q_end + k_local[0], q_end + k_local[1]), (k_end + k_local[0], k_end + k_local[1])]
        elif role == "packed_gate_up":
            inter = config.intermediate_size
            per = inter // tp
            out[name] = [(rank * per, (rank + 1) * per), (inter + rank * per, inter + (rank + 1) * per)]
    return out


def localize_head_counts(block: nn.Module, roles: dict[str, str], config, tp: int) -> None:
    """Make an attention with a packed [q | k | v] projection slice its local output by local counts.

    Phi-3's attention cuts `qkv_proj`'s output at `config.num_attention_heads * head_dim` and reads
    `self.num_key_value_heads`: global counts, wrong for the rank's shard. The module gets its own
    shallow copy of the config with this rank's head counts (the model's config is untouched).
    """
    if "packed_qkv" not in roles.values():
        return
    heads, _, _ = attention_dims(config)
    local_kv = local_kv_heads(config, tp)
    attn = block.get_submodule("self_attn")
    view = copy.copy(attn.config)
    view.num_attention_heads, view.num_key_value_heads = heads // tp, local_kv
    attn.config = view
    if hasattr(attn, "num_key_value_heads"):
        attn.num_key_value_heads = local_kv
    if hasattr(attn, "num_heads"):
        attn.num_heads = heads // tp


def tp_degree_problem(config, tp: int) -> str | None:
    """Why `tp` cannot split this model's attention, naming the largest degree that works, or None.

    Query heads must split evenly; K/V heads must either split evenly or be a divisor of tp (then
    they are replicated), so that every rank's query heads read whole K/V heads. Multi-head latent
    attention has a K and V per query head, so only the query heads count.
    """
    heads, kv_heads, _ = attention_dims(config)
    if tp > 1 and getattr(config, "kv_lora_rank", None):
        if heads % tp == 0:  # every head has its own K and V: only the query heads must split
            return None
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        return (f"tp={tp}: multi-head latent attention (kv_lora_rank={config.kv_lora_rank}) splits its "
                f"num_attention_heads={heads} heads evenly over tp (each rank up-projects the shared latents "
                f"for its own heads); the largest tp that works is {max(d for d in ok if d <= tp)}; fix: use a tp "
                f"in {ok}")
    if tp <= 1 or (heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)):
        return None
    ok = [d for d in range(1, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]
    best = max(d for d in ok if d <= tp) if any(d <= tp for d in ok) else 1
    return (f"tp={tp}: tensor parallelism splits the num_attention_heads={heads} query heads evenly and needs "
            f"num_key_value_heads={kv_heads} to be a multiple or a divisor of tp (then K/V heads are "
            f"replicated); the largest tp that works is {best}; fix: use a tp in {ok}")

