"""What a training step achieved: model FLOPs and MFU/HFU, throughput, peak memory (bytes moved:
`meshkit.comm_counter`).

FLOP convention (per token, one training step = forward + backward):

- dense term `6 * N_nonembedding`: every parameter that takes part in a matmul costs 2 FLOPs per
  token forward and 4 backward (input grad + weight grad). `N_nonembedding` counts the decoder
  blocks, the final norm and the LM head; it leaves out the input embedding, which is a gather and
  costs no FLOPs. The LM head is counted even when tied to the embedding, because its matmul is
  real work either way. Norm weights are included (as in Kaplan et al.) although they feed no
  matmul; they add `6 * (2L + 1) * h`, under 0.1% for real models.
- attention term `12 * L * (n_heads * head_dim) * s`: QK^T and AV cost `4 * s * n_heads * head_dim`
  per token per layer forward, times 3 for forward + backward. The causal mask is NOT credited:
  we count the full square, as PaLM, Megatron-LM and torchtitan do, so MFU figures compare with
  published ones. Kernels that skip the masked half (flash attention) do about half of this work.
  GQA does not change the term: it shares K/V heads, not query-key products.

MFU divides model FLOP/s by the device's peak. HFU also credits the FLOPs activation
checkpointing spends recomputing. Full AC re-runs each block's forward: `2 * N_block` plus the
attention forward `4 * L * n_heads * head_dim * s` per token, minus the block's last matmul
(`down_proj`): torch's non-reentrant checkpoint stops recomputing once every saved tensor is back,
and nothing saves down_proj's output (it only feeds the residual add). An MoE block is re-run
whole: meshkit's combine multiplies the experts' outputs by the routing weights, which saves them.
MoE blocks count their *active* parameters (router plus top_k experts), as MoE MFU figures do. meshkit's selective AC saves
matmul and attention outputs and recomputes only elementwise ops and norms, which this convention
counts as zero, so selective HFU == MFU. tests/estimate/test_metrics.py checks all three against
FlopCounterMode exactly.
"""

from __future__ import annotations

import math
import os
import resource
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshkit.models import roles
from meshkit.models.moe import moe_spec

# ------------------------------------------------------------------------------------------ FLOPs


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs per token, split so MFU and HFU use the same numbers."""

    dense: float
    attention: float
    recompute: float = 0.0

    @property
    def model(self) -> float:
        """FLOPs MFU credits: the work the model needs, however it is executed."""
        return self.dense + self.attention

    @property
    def hardware(self) -> float:
        """FLOPs HFU credits: model FLOPs plus what activation checkpointing recomputes."""
        return self.model + self.recompute


def block_params(config: Any) -> int:
    """Parameters of one decoder block from the config alone (no model needed, so any size works).

    Exact for Llama and Mistral; for families with extra small parameters the config does not name
    (Qwen2's always-on q/k/v biases, Qwen3's per-head q/k norms) use `count_nonembedding_params` on
    the (meta) model: those parameters feed no matmul, so the FLOP count differs only by them.
    """
    h, inter = config.hidden_size, config.intermediate_size
    attn = roles.attention_params(config)
    mlp = 3 * h * inter
    if getattr(config, "mlp_bias", False):
        mlp += 2 * inter + h
    return attn + mlp + 2 * h


def nonembedding_params(config: Any) -> int:
    """`N_nonembedding`: blocks + final norm + LM head (counted even when tied, see module doc).

    For MoE configs only the *active* parameters count (router, and top_k of num_experts experts in
    each MoE block): they are what a token's FLOPs touch, which is what MFU measures.
    """
    return sum(active_block_params(config, i) for i in range(config.num_hidden_layers)) + config.hidden_size + \
        config.hidden_size * config.vocab_size


def active_block_params(config: Any, layer: int = 0) -> int:
    """Parameters of decoder block `layer` that one token's matmuls touch: the whole block when dense;
    for an MoE block the router and top_k of its experts instead of the dense MLP."""
    spec = moe_spec(config)
    if spec is None or layer not in spec.layers:
        return block_params(config)
    dense_mlp = 3 * config.hidden_size * config.intermediate_size
    active = spec.top_k * 3 * config.hidden_size * spec.intermediate_size + spec.num_experts * config.hidden_size
    shared = 3 * config.hidden_size * spec.shared_intermediate_size + (config.hidden_size if spec.shared_gate else 0)
    return block_params(config) - dense_mlp + active + shared


def count_nonembedding_params(model: torch.nn.Module) -> int:
    """The same count taken from a built model (meta tensors work), for configs the formula misses."""
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # a tied weight is yielded once
    tied = out is embed
    return total - embed.numel() + (out.numel() if tied else 0)


def flops_per_token(config: Any, seq_len: int, activation_checkpointing: str = "none",
                    n_nonembedding: int | None = None) -> FlopsPerToken:
    """Training FLOPs per token for a sequence length and AC mode (convention in the module doc)."""
    if activation_checkpointing not in ("none", "selective", "full"):
        raise ValueError(f"activation_checkpointing={activation_checkpointing!r}: must be none, selective or full")
    n = nonembedding_params(config) if n_nonembedding is None else n_nonembedding
    heads, d_qk, d_v = roles.score_value_dims(config)
    layers = config.num_hidden_layers
    spec = moe_spec(config)
    moe_layers = set(spec.layers) if spec is not None else set()
    full = range(layers) if activation_checkpointing == "full" else ()
    # A dense block's last matmul (down_proj) is not re-run; an MoE block's experts are, because the
    # combine's weighting saves their outputs (see module doc).
    recompute = float(sum(
        2 * heads * (d_qk + d_v) * seq_len + 2 * active_block_params(config, i)
        - (0 if i in moe_layers else 2 * config.intermediate_size * config.hidden_size) for i in full))
    return FlopsPerToken(dense=6.0 * n, attention=6.0 * layers * heads * (d_qk + d_v) * seq_len, recompute=recompute)


# ------------------------------------------------------------------------------------ peak FLOP/s

# Dense (no sparsity) peak per device. float32 means CUDA-core FP32: PyTorch leaves TF32 matmuls
# off by default; pass an explicit peak when you enable TF32.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h100": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 66.9e12, "float8": 1978.9e12},  # SXM
    "h100-pcie": {"bfloat16": 756.0e12, "float16": 756.0e12, "float32": 51.2e12, "float8": 1513.0e12},
    "h200": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 66.9e12, "float8": 1978.9e12},
    "a100": {"bfloat16": 312.0e12, "float16": 312.0e12, "float32": 19.5e12},
}

# An ESTIMATE, not a measured or vendor figure: one x86 core with two 256-bit FMA pipes (AVX2, or
# AVX-512 split over two cycles as on Zen 4) does 2 pipes * 8 fp32 lanes * 2 = 32 FLOP/cycle; at
# a nominal 3 GHz that is 96 GFLOP/s. Only for a rough CPU MFU; override with a measured figure.
CPU_PEAK_FLOPS_PER_CORE = 96e9


def detect_device() -> str:
    """Preset key for this process's accelerator ("cpu" when none, "" for an unknown GPU)."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for key in ("h200", "a100"):
        if key in name:
            return key
    if "h100" in name:
        return "h100-pcie" if "pcie" in name else "h100"
    return ""


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def peak_flops(device: str | None = None, dtype: str = "bfloat16", override: float | None = None) -> float | None:
    """Peak FLOP/s of one device (one process on CPU), or None when unknown.

    On CPU a "device" is a process: the host's estimated peak split evenly over the processes that
    share it (LOCAL_WORLD_SIZE), so eight ranks on two cores each get a quarter of a core.
    """
    if override:
        return float(override)
    device = detect_device() if device is None else device.lower()
    if device == "cpu":
        per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return CPU_PEAK_FLOPS_PER_CORE * _cores() / max(per_host, 1)
    return PEAK_FLOPS.get(device, {}).get(dtype)


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: float | None) -> float | None:
    """Fraction of peak: achieved FLOP/s of one device over its peak (pass `.model` or `.hardware`)."""
    if not peak:
        return None
    return flops_per_token * tokens_per_s_per_device / peak


def tokens_per_s_per_device(global_tokens: int, step_s: float, world_size: int) -> float:
    """Throughput per device: every rank (tp and pp peers included) is a device the step occupied."""
    return global_tokens / step_s / max(world_size, 1)


# ---------------------------------------------------------------------------------------- memory


def reset_peak_memory() -> None:
    """Start a new CUDA peak window; process RSS peaks cannot be reset, so CPU keeps the run's peak."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> tuple[int, str]:
    """(bytes, label): CUDA max allocated by tensors, else the process's peak resident set size.

    The label travels with the number because the two are not comparable: RSS includes the Python
    interpreter, torch's libraries and allocator caches, not only tensors.
    """
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(), "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss * (1 if sys.platform == "darwin" else 1024), "cpu_peak_rss"


# --------------------------------------------------------------------------------------- logging


def format_step_line(step: int, total_steps: int, values: Mapping[str, float | None]) -> str:
    """One console line per step; keys with a None value (e.g. MFU on an unknown GPU) are skipped."""
    units = {
        "loss": "{:.4f}", "ce": "{:.4f}", "eval_loss": "{:.4f}", "lr": "{:.2e}", "grad_norm": "{:.3f}", "tokens_per_s": "{:,.0f}",
        "tokens_per_s_per_device": "{:,.0f}", "mfu": "{:.2%}", "hfu": "{:.2%}", "step_s": "{:.3f}s",
    }
    width = len(str(total_steps))
    parts = [f"step {step:>{width}}/{total_steps}"]
    for key, value in values.items():
        if value is None:
            continue
        if key.endswith("_gib"):
            parts.append(f"{key[:-4]} {value:.2f} GiB")
        else:
            parts.append(f"{key} {units.get(key, '{:.4g}').format(value)}")
    return " | ".join(parts)


class TensorBoardLogger:
    """Scalars to TensorBoard from rank 0 only; a no-op elsewhere so callers never branch on rank.

    One writer per run directory: several ranks writing event files into one directory make
    TensorBoard show interleaved, duplicated curves.
    """

    def __init__(self, log_dir: str, rank: int | None = None, purge_step: int | None = None) -> None:
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        self.log_dir = log_dir
        self._writer = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run continues the same directory; events a killed launch wrote
            # at or past the resumed step are dropped, so every step shows once.
            self._writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)

    def log(self, step: int, scalars: Mapping[str, float | None], prefix: str = "train/") -> None:
        """Write each non-None value as a scalar at `step` (rank 0 only)."""
        if self._writer is None:
            return
        for key, value in scalars.items():
            if value is not None and math.isfinite(float(value)):
                self._writer.add_scalar(prefix + key, float(value), step)

    def text(self, tag: str, value: str) -> None:
        """Write a text record (the run's configuration, say) once."""
        if self._writer is not None:
            self._writer.add_text(tag, value)

    def close(self) -> None:
        """Flush and close the event file."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
