"""The estimator's shared vocabulary: model presets, devices, workloads and one rank's model state.

A leaf: every other estimator module reads these types, none of them reads the others back. The
presets are written out because the machines meshkit is developed on have no hub access.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers

from meshkit import metrics
from meshkit.plan import DTYPES, Plan

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
    # DeepSeek-V3 (671B, 37B active): MLA, 256 routed experts in 8 groups (4 kept) top-8, one shared
    # expert, and the first 3 of its 61 blocks dense (`first_k_dense_replace`).
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                        qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
                        n_group=8, topk_group=4, n_shared_experts=1, routed_scaling_factor=2.5,
                        norm_topk_prob=True, first_k_dense_replace=3, max_position_embeddings=163840,
                        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False),
}


def load_config(spec: str) -> Any:
    """A preset name, a config.json, or a local model directory -> a transformers config."""
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


_KEYS: dict[int, tuple[Any, str]] = {}


def config_key(config: Any) -> str:
    """The config as JSON, the cache key of every trace; memoised per config object (a config is
    treated as immutable once estimated), because serialising it dominates a cached estimate."""
    hit = _KEYS.get(id(config))
    if hit is not None and hit[0]() is config:
        return hit[1]
    key = config.to_json_string(use_diff=False)
    try:
        _KEYS[id(config)] = (weakref.ref(config), key)
    except TypeError:  # not weak-referenceable: just do not memoise
        pass
    return key


def config_from_key(key: str) -> Any:
    """The transformers config a `config_key` was made from (a fresh object, safe to modify)."""
    return transformers.AutoConfig.for_model(**json.loads(key))


def dtype_bytes(name: str) -> int:
    """Bytes per element of a plan dtype name ("bfloat16" -> 2)."""
    return DTYPES[name].itemsize


# ------------------------------------------------------------------------------ device, workload


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
    host_bw: float = 55e9            # host <-> device link (PCIe Gen5 x16), per direction, what copies reach
    host_memory_bw: float = 75e9     # the node's DRAM bandwidth divided among its GPUs: the CPU step's share
    host_memory_bytes: float = 256 * GiB  # host memory per GPU (2 TiB over 8 GPUs, DGX H100/H200)
    nvme_bw: float = 3e9             # the node's NVMe drives, per GPU, per direction (offload="nvme")
    float8_flops: float | None = None  # dense float8 FLOP/s (None: no float8 tensor cores; plan_search skips float8)


# H100/H200 SXM: NVLink 4 moves 900 GB/s both ways (450 each way); one 400 Gb/s NDR NIC per GPU. Host side
# (DGX): PCIe Gen5 x16 per GPU (64 GB/s per direction on paper, ~55 reached by pinned copies), two sockets
# of 8-channel DDR5-4800 (~614 GB/s) shared by 8 GPUs, 2 TiB of DRAM; 8 NVMe U.2 data drives (~25 GB/s of
# sequential reads together: ~3 GB/s per GPU). Dense float8 (e4m3) tensor-core peak: twice bf16's.
DEVICES = {
    "h100": Device("h100", metrics.PEAK_FLOPS["h100"]["bfloat16"], 79.6 * GiB, 450e9, 50e9,
                   float8_flops=metrics.PEAK_FLOPS["h100"]["float8"]),
    "h200": Device("h200", metrics.PEAK_FLOPS["h200"]["bfloat16"], 139.8 * GiB, 450e9, 50e9,
                   float8_flops=metrics.PEAK_FLOPS["h200"]["float8"]),
}


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


# -------------------------------------------------------------------------------- model state


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor, the dim TP splits (None: replicated over tp) and its FSDP unit."""

    shape: tuple[int, ...]
    tp_dim: int | None  # when tp divides what it splits; `role` says when it is replicated instead
    unit: str  # "embed", "block", "head", or "expert" (dim 0 split by ep, then FSDP'd over fsdp/ep ranks)
    tp_summed: bool = False  # an MoE weight TP leaves whole: its gradient is all-reduced over tp
    kind: str = "dense"  # block and expert tensors: the kind of block ("dense" or "moe") they belong to
    role: str = ""  # the TP role of the layer holding it (models/roles.block_roles), "" outside blocks
    owner: str = ""  # the module holding it, within its block ("self_attn.q_proj"), "" outside blocks
    trainable: bool = True  # False: frozen (a LoRA model's base), no gradient and no optimizer state
    adapter: str = ""  # "lora_A" / "lora_B": a LoRA adapter tensor (placed by `tensor_parallel.lora`)
    attention: bool = False  # an adapter of an attention linear
    # the embedding's: it and the LM head are the plain modules TP may run on local shards
    # (`tensor_parallel.local.ends_are_plain`), whose gradient is then the vocabulary shard's
    plain_ends: bool = False


@dataclass(frozen=True)
class BlockUnits:
    """The decoder blocks of one kind on one rank, as FSDP2 units: how many, and one block's units
    as gathered (TP-local, padded rows). A stack mixing dense and MoE blocks has one of each."""

    kind: str     # "dense" or "moe"
    count: int    # blocks of this kind on the rank
    block: int    # one block's own unit (an MoE block's router and shared expert included)
    expert: int   # one block's expert unit (0 for a dense block)
    block_grad: int = -1   # of `block`, the elements with gradients (padded); -1: all (no frozen weights)
    expert_grad: int = -1  # of `expert`, likewise
    float8: int = 0  # of `block`, the projection weights float8 converts (gathered in float8 under tensorwise)

    def __post_init__(self) -> None:
        if self.block_grad < 0:
            object.__setattr__(self, "block_grad", self.block)
        if self.expert_grad < 0:
            object.__setattr__(self, "expert_grad", self.expert)


@dataclass(frozen=True)
class ModelState:
    """Model state of one rank."""

    params: int            # elements held (sharded)
    param_bytes: int       # sharded fp32 parameters, which are the master weights
    grad_bytes: int        # sharded gradients, in the parameters' dtype
    optimizer_bytes: int   # AdamW exp_avg + exp_avg_sq, plus its 4-byte `step` tensor per parameter
    unit_elements: dict[str, int]  # one FSDP unit of each kind as gathered (TP-local, padded rows; blocks: the largest)
    blocks: int            # decoder blocks on this pipeline rank
    zero: dict[str, float]  # Playbook bytes per rank: DDP and ZeRO-1/2/3, 2+2+12 bytes per parameter
    tp_summed_tensors: int = 0   # MoE weights whose gradient shards are all-reduced over tp (when tp > 1)
    tp_summed_elements: int = 0  # their elements on this rank
    tied_copy_elements: int = 0  # pp > 1, tied embedding, first or last stage: this rank's copy's shard
    held_elements: int = 0       # elements of this rank's parameters before FSDP shards them (TP/ep-local)
    block_units: tuple[BlockUnits, ...] = ()  # the rank's blocks by kind (dense, moe)
    # Weights TP keeps whole on every tp rank, each rank computing only its rows (replicated K/V heads,
    # packed projections: tensor_parallel.rows) or serving only its heads (MLA's latent layers): their
    # gradients are Partial, all-reduced over tp.
    tp_partial_tensors: int = 0
    tp_partial_elements: int = 0  # their elements on this rank before FSDP shards them
    tensors: int = 0  # parameter tensors on this rank
    # Of `held_elements` and `unit_elements`, what has gradients (a LoRA model's adapters; everything
    # without frozen weights: None). Gradient buffers, reductions and optimizer state follow these.
    held_trainable: int | None = None
    grad_unit_elements: dict[str, int] | None = None
    trained_params: int | None = None   # of `params`, elements with gradients (this rank's shards)
    trained_tensors: int | None = None  # of `tensors`, those with gradients
    adapter_partial_tensors: int = 0   # LoRA halves replicated over tp (A of a column base, B of a row base)
    adapter_partial_elements: int = 0  # their elements on this rank before FSDP shards them
    grad_free_edges: int = 0  # first-stage SP/TP conjugates backward skips (frozen embedding: `memory`)
    frozen_norms: bool = False  # the residual norms train not (LoRA): no norm-weight gradient sums over tp

    def __post_init__(self) -> None:
        if self.held_trainable is None:
            object.__setattr__(self, "held_trainable", self.held_elements)
        if self.grad_unit_elements is None:
            object.__setattr__(self, "grad_unit_elements", dict(self.unit_elements))
        if self.trained_params is None:
            object.__setattr__(self, "trained_params", self.params)
        if self.trained_tensors is None:
            object.__setattr__(self, "trained_tensors", self.tensors)

    @property
    def block_elements(self) -> int:
        """Elements of every block unit of the rank as gathered (expert units included)."""
        return sum(u.count * (u.block + u.expert) for u in self.block_units)

    @property
    def float8_elements(self) -> int:
        """Of `block_elements`, the projection weights `Plan.float8` converts (gathered padded rows)."""
        return sum(u.count * u.float8 for u in self.block_units)

    @property
    def persistent(self) -> int:
        """Bytes that live across steps: parameter shards, gradients, optimizer states."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes
