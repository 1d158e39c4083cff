"""Activation memory of the real HF blocks, measured rather than taken from a formula.

Why measure: Korthikanti's `sbh(34 + 5as/h)` describes a GPT block (LayerNorm, 4h GeLU MLP,
dropout masks, unfused softmax). A Hugging Face Llama block saves different tensors: RMSNorm keeps
an fp32 copy of its input, SwiGLU keeps three [b, s, ffn] tensors, GQA shrinks K and V, and SDPA's
flash kernels keep (q, k, v, out, lse) instead of the s x s scores. So meshkit builds ONE real block
(and the final norm, LM head and meshkit's own loss) under FakeTensorMode, where tensors have shapes
but no memory, runs its forward at the exact local shapes of the plan, and counts:

- AC none: every tensor autograd saves for backward (`saved_tensors_hooks`), deduplicated by
  storage, parameters excluded (they are model state, not activations).
- AC selective: the outputs of the ops meshkit's own policy (`activation_checkpoint`) marks
  MUST_SAVE, plus the checkpoint's input; everything else is recomputed in backward.
- AC full: the checkpoint's input only.

Each saved tensor is attributed to the layer *part* that saved it (or produced it, for selective),
found from meshkit's block roles, never from HF module names. Tensor parallelism is traced exactly:
the block is built with the TP-local shapes (heads/tp, kv_heads/tp, ffn/tp). Sequence parallelism
is one division: the norm parts (and the checkpointed residual stream) live on s/tp tokens, while
the attention and MLP parts save the all-gathered [b, s, h] input, which the trace already shows
at full length. Traces run at batch 1 and scale by the batch: every saved tensor has a batch
dimension except the rotary cos/sin, which are shared by every block of a stage and reported apart.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

from meshkit._compat.dispatch import fake_tensor_mode
from meshkit._compat.subclasses import storage_key
from meshkit.activation_checkpoint import AC_MODES
from meshkit.estimate.spec import config_from_key, config_key
from meshkit.estimate.trace import Recorder, by_part, recording
from meshkit.integrations.peft import model as peft_model
from meshkit.models import llama, roles
from meshkit.models import quirks as quirks_lib
from meshkit.models.hf_moe import identity_stand_in
from meshkit.models.moe import moe_spec
from meshkit.plan import DTYPES
from meshkit.step import loss as loss_lib

BLOCK_PARTS = ("attn_norm", "qkv_proj", "attention", "o_proj", "mlp_norm", "gate_up_proj", "mlp_act",
               "down_proj", "residual")
_SEQ_SHARDED = frozenset({"attn_norm", "mlp_norm", "residual"})  # on s/tp tokens under SP
_ROLE_PART = {("colwise", "attention"): "qkv_proj", ("kv_colwise", "attention"): "qkv_proj",
              ("packed_qkv", "attention"): "qkv_proj", ("rowwise", "attention"): "o_proj",
              ("colwise", "mlp"): "gate_up_proj", ("packed_gate_up", "mlp"): "gate_up_proj", ("rowwise", "mlp"): "down_proj",
              ("attention", ""): "attention", ("mlp", ""): "mlp_act", ("head_norm", "attention"): "attention",
              ("row_norm", "attention"): "attention", ("latent", "attention"): "qkv_proj"}


# ---------------------------------------------------------------------------------- the traces


@dataclass(frozen=True)
class BlockTrace:
    """Bytes one block keeps for ONE sequence (batch 1) of `seq` tokens on one TP rank, SP not applied."""

    saved: dict[str, int]   # AC none, by part
    cached: dict[str, int]  # AC selective: MUST_SAVE op outputs, by part
    shared: int             # rotary cos/sin saved by the block: once per stage and microbatch
    block_input: int        # the [1, seq, h] residual stream a checkpoint keeps
    largest: int            # the largest single saved tensor (a backward working-set unit)


@dataclass(frozen=True)
class HeadTrace:
    """Bytes the last stage keeps beyond its blocks for ONE sequence: final norm, LM head, loss."""

    saved: dict[str, int]  # "final_norm", "lm_head", "loss"
    logits: int            # one [seq, vocab_local] tensor in the activation dtype (loss transients)


def local_config(config: Any, tp: int, vocab: int | None = None) -> Any:
    """The config of the block one TP rank holds: heads, KV heads and ffn divided by tp.

    Colwise/rowwise sharding leaves each rank an ordinary Llama block with fewer heads and a
    narrower MLP; HF reshapes with `view(..., -1, head_dim)`, so head_dim must be pinned.
    """
    heads, _, head_dim = roles.attention_dims(config)
    cfg = copy.deepcopy(config)
    cfg.num_attention_heads = heads // tp
    cfg.num_key_value_heads = roles.local_kv_heads(config, tp)
    cfg.head_dim = head_dim
    cfg.intermediate_size = config.intermediate_size // tp
    cfg.num_hidden_layers = 1
    cfg.use_cache = False
    if vocab is not None:
        cfg.vocab_size = vocab
    return cfg


@functools.lru_cache(maxsize=64)
def build_block(config_json: str, tp: int, vocab: int | None, dtype: str) -> tuple[Any, llama.CausalLMParts]:
    """A one-block model of the TP-local shapes, as fake CPU tensors; cached per shape."""
    cfg = local_config(config_from_key(config_json), tp, vocab)
    with torch.device("meta"):
        # a LoRA model's block as PEFT wraps it (frozen base, adapters at the TP-local shapes)
        model = peft_model.wrap(transformers.AutoModelForCausalLM.from_config(cfg), cfg).to(DTYPES[dtype])
    llama.check_supported(model)
    pin_attention(model)
    spec = moe_spec(cfg)  # routing is data-dependent: estimate.moe measures the MoE layer itself
    for i, block in enumerate(llama.parts(model).blocks):
        if spec is not None and i in spec.layers:
            block.mlp = identity_stand_in(block.mlp)
    mode = fake_tensor_mode()
    with mode:
        model.to_empty(device="cpu")
    return mode, llama.parts(model)


def pin_attention(model: nn.Module) -> None:
    """Route attention exactly as `parallelize` does (meshkit's registered causal attention, which
    is SDPA when cp = 1), so the trace saves what a meshkit run saves."""
    llama.use_meshkit_attention(model)


def _block_parts(block: nn.Module, config: Any) -> dict[str, str]:
    """Module name inside the block -> part name, from the roles tensor parallelism applies (no HF names here)."""
    block_roles = roles.block_roles(block, config)
    names: dict[str, str] = {}
    norms = ["attn_norm", "mlp_norm"]
    for name, role in block_roles.items():  # residual norms in the block's order: the attention's first
        if role == "seq_norm":
            names[name] = norms.pop(0) if norms else "mlp_norm"
            continue
        parent = block_roles.get(name.rsplit(".", 1)[0], "") if "." in name else ""
        part = _ROLE_PART.get((role, parent))
        if part is not None:
            names[name] = part
    return names


@functools.lru_cache(maxsize=512)
def _trace_block_cached(config_json: str, seq: int, tp: int, dtype: str) -> BlockTrace:
    mode, parts = build_block(config_json, tp, None, dtype)
    block, rotary = parts.blocks[0], parts.rotary
    params = {storage_key(p) for p in block.parameters()}
    sub = dict(block.named_modules())
    module_parts = {sub[name]: part for name, part in _block_parts(block, parts.config).items()}
    with mode:
        hidden = torch.empty(1, seq, block_hidden(parts), dtype=DTYPES[dtype], requires_grad=True)
        positions = torch.arange(seq).unsqueeze(0)
        # Rotary per layer type (Gemma-3's local and global bases) as the stage computes it; the
        # traced block is block 0, so it gets block 0's type.
        by_type = quirks_lib.position_embeddings(rotary, hidden, positions, parts.quirks)
        cos, sin = by_type[quirks_lib.layer_type(parts.quirks, 0)]
        rotary_keys = {storage_key(t) for pair in by_type.values() for t in pair}
        recorder = Recorder(params)
        with recording(recorder, module_parts, "residual"):
            llama.run_block(block, hidden, (cos, sin), positions)
    # The block input is the previous block's output: when a part saves it (an fp32 norm's
    # "copy" is the input itself), it belongs to this block. Only cos/sin are shared.
    shared = sum(n for key, (_, n) in recorder.saved.items() if key in rotary_keys)
    largest = max((n for key, (_, n) in recorder.saved.items() if key not in rotary_keys), default=0)
    return BlockTrace(
        saved=by_part(recorder.saved, rotary_keys),
        cached=by_part(recorder.cached, rotary_keys),
        shared=shared,
        block_input=hidden.numel() * hidden.element_size(),
        largest=largest,
    )


def block_hidden(parts: llama.CausalLMParts) -> int:
    """Hidden size of the residual stream (the final norm's width)."""
    return parts.norm.weight.shape[0]


def trace_block(config: Any, seq: int, tp: int = 1, dtype: str = "bfloat16") -> BlockTrace:
    """Trace one TP-local block on one sequence of `seq` tokens (cached per shape)."""
    key = config_key(config)
    if (key, tp) not in _TP_CHECKED:  # a plan search asks ~10^4 times; config reads are slow in transformers 5
        _check_tp(config, tp)
        _TP_CHECKED.add((key, tp))
    return _trace_block_cached(key, seq, tp, dtype)


_TP_CHECKED: set[tuple[str, int]] = set()  # (config_key, tp) pairs `_check_tp` passed


@functools.lru_cache(maxsize=256)
def _trace_head_cached(config_json: str, seq: int, vocab: int, dtype: str) -> HeadTrace:
    mode, parts = build_block(config_json, 1, vocab, dtype)
    params = {storage_key(p) for p in (parts.norm.weight, parts.lm_head.weight)}
    module_parts = {parts.norm: "final_norm", parts.lm_head: "lm_head"}
    with mode:
        hidden = torch.empty(1, seq, block_hidden(parts), dtype=DTYPES[dtype], requires_grad=True)
        labels = torch.zeros(1, seq, dtype=torch.long)
        recorder = Recorder(params)
        with recording(recorder, module_parts, "loss"):
            logits = parts.lm_head(parts.norm(hidden))
            loss_lib.summed_cross_entropy(logits, loss_lib.shift_labels(labels))
        nbytes = logits.numel() * logits.element_size()
    return HeadTrace(saved=by_part(recorder.saved, set()), logits=nbytes)


def trace_head(config: Any, seq: int, tp: int = 1, loss_parallel: bool = True, dtype: str = "bfloat16") -> HeadTrace:
    """Trace the final norm, the LM head and meshkit's summed cross-entropy on one sequence.

    With `loss_parallel` (and tp > 1) each rank holds vocab/tp logits and the loss runs on them;
    without it the logits are gathered to the full vocabulary first.
    """
    vocab = -(-config.vocab_size // tp) if loss_parallel else config.vocab_size
    return _trace_head_cached(config_key(config), seq, vocab, dtype)


def _check_tp(config: Any, tp: int) -> None:
    """Refuse a tp the model's attention or MLP cannot be split by, with the plan's own rule (K/V heads
    may be fewer than tp: they are then replicated, as `roles.kv_rows` has tensor parallelism do)."""
    problem = roles.tp_degree_problem(config, tp)
    if problem:
        raise ValueError(problem)
    spec = moe_spec(config)
    if (spec is None or len(spec.layers) < config.num_hidden_layers) and config.intermediate_size % tp:
        raise ValueError(f"tp={tp} does not divide intermediate_size={config.intermediate_size}; fix: use a tp "
                         f"that divides it")


# --------------------------------------------------------------------------- scaled by the plan


def traced_block_activations(config: Any, *, batch: int, seq: int, tp: int = 1, sequence_parallel: bool = True,
                              dtype: str = "bfloat16", ac: str = "none") -> dict[str, int]:
    """Bytes the traced part of one block keeps between its forward and backward, by part, on one rank.

    The traced part is the whole block of a dense model and everything but the MoE layer of an MoE
    block (`estimate.memory.block_activations` adds the layer). `seq` is the rank's sequence length
    (already divided by cp). The rotary cos/sin are not included: they are shared by the blocks of
    a stage (`shared_activations`).
    """
    if ac not in AC_MODES:
        raise ValueError(f"ac={ac!r}: must be one of {AC_MODES}")
    trace = trace_block(config, seq, tp, dtype)
    sp = tp if (tp > 1 and sequence_parallel) else 1
    if ac == "none":
        out = {part: batch * (n // sp if part in _SEQ_SHARDED else n) for part, n in trace.saved.items()}
    else:
        out = {"checkpoint_input": batch * trace.block_input // sp}
    if ac == "selective":
        out.update({part: batch * n for part, n in trace.cached.items()})
        if sp > 1:  # the reduce-scatters that end the SP regions are MUST_SAVE too
            out["reduce_scatter"] = 2 * batch * trace.block_input // sp
    return out


def shared_activations(config: Any, *, batch: int, seq: int, tp: int = 1, dtype: str = "bfloat16") -> int:
    """Rotary cos/sin saved once per stage and microbatch (HF builds them for position_ids [1, s])."""
    del batch  # meshkit passes position_ids of batch 1, broadcast over the batch
    return trace_block(config, seq, tp, dtype).shared


def head_activations(config: Any, *, batch: int, seq: int, tp: int = 1, sequence_parallel: bool = True,
                     loss_parallel: bool = True, dtype: str = "bfloat16") -> dict[str, int]:
    """Bytes the last stage keeps for its final norm, LM head and loss, by part, on one rank."""
    trace = trace_head(config, seq, tp, loss_parallel, dtype)
    sp = tp if (tp > 1 and sequence_parallel) else 1
    return {part: batch * (n // sp if part == "final_norm" else n) for part, n in trace.saved.items()}


def loss_transient(config: Any, *, batch: int, seq: int, tp: int = 1, loss_parallel: bool = True,
                   dtype: str = "bfloat16") -> int:
    """Extra bytes while the loss's backward starts: the fp32 gradient of the log-softmax output and
    the fp32 gradient of its input exist together with the saved fp32 log-probabilities; the
    vocab-parallel loss (DTensor's, tp > 1) builds its input gradient from a zeroed buffer and the
    exponentiated log-probabilities, three fp32 logits-sized buffers at once (measured by the dry run).

    The forward transient (activation-dtype logits plus their fp32 copy, freed after log-softmax)
    is smaller whenever the activation dtype is at most 4 bytes, so the backward one is the peak.
    """
    trace = trace_head(config, seq, tp, loss_parallel, dtype)
    elements = trace.logits // DTYPES[dtype].itemsize
    return batch * (12 if loss_parallel and tp > 1 else 8) * elements


def korthikanti_bytes(config: Any, *, batch: int, seq: int, tp: int = 1, sequence_parallel: bool = True,
                      ac: str = "none") -> float:
    """The Megatron paper's per-layer estimate in bytes (16-bit activations), for comparison only."""
    s, b, h, a = seq, batch, config.hidden_size, config.num_attention_heads
    if ac == "full":
        return 2.0 * s * b * h / (tp if sequence_parallel else 1)
    scores = 0.0 if ac == "selective" else 5.0 * a * s / (h * tp)
    if tp > 1 and sequence_parallel:
        return s * b * h * (34.0 / tp + scores)
    return s * b * h * (10.0 + 24.0 / tp + scores)
