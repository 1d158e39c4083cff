"""What a soft-capped block costs in the ring kinds: explicit scores against the fused CPU kernel.

    python -m benchmarks.attention_scores [--quick] [--out benchmarks/results/attention_scores.md]

Gemma 2 caps every attention score (c * tanh(x / c)), which no fused kernel computes, so under ring,
zig-zag and all-gather CP each of its blocks runs on explicit scores (`context_parallel/scores.py`).
One ring block (the square causal diagonal, forward then backward against its own out and lse) is
timed three ways in one process, interleaved so that machine load hits all alike:

- `flash`: meshkit's block on the CPU flash kernel, no cap (what the other families' ring blocks run);
- `explicit, capped`: meshkit's block with the cap (explicit scores, fp32);
- `HF eager, capped` (the peer): Gemma 2's own `eager_attention_forward` on the same block, with
  autograd for the backward: what HF itself runs for soft-capped attention on one device.

Memory: the explicit block holds [B, H, Sq, Sk] fp32 scores and probabilities (and the tanh in
backward) where the fused kernel holds O(Sq) per row; the table gives those bytes per block.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

from benchmarks.report import emit, machine_line, table
from meshkit.context_parallel.kernels import attention_backward, attention_forward

CAP = 50.0  # Gemma 2's attn_logit_softcapping


def _meshkit_block(q, k, v, dout, softcap):
    out, lse = attention_forward(q, k, v, causal_kind="causal", softcap=softcap)
    attention_backward(dout, q, k, v, out, lse, causal_kind="causal", softcap=softcap)


def _hf_block(q, k, v, dout, mask):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], training=False, head_dim=q.shape[-1])
    out, _ = eager_attention_forward(module, q, k, v, mask, softcap=CAP)
    out.backward(dout.transpose(1, 2))


def measure(batch: int, heads: int, kv_heads: int, seq: int, dim: int, repeats: int) -> list:
    """One table row: median seconds of each variant, the ratios and the explicit block's bytes."""
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(batch, heads, seq, dim, generator=g) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, dim, generator=g) for _ in range(2))
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    runs = {"flash": lambda: _meshkit_block(q, k, v, dout, None),
            "explicit": lambda: _meshkit_block(q, k, v, dout, CAP),
            "hf": lambda: _hf_block(q, k, v, dout, mask)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    scores_mib = 3 * batch * heads * seq * seq * 4 / 2**20  # scores, probabilities, tanh (fp32)
    return [f"{batch}x{heads}/{kv_heads}x{seq}x{dim}", f"{med['flash'] * 1e3:.1f}", f"{med['explicit'] * 1e3:.1f}",
            f"{med['hf'] * 1e3:.1f}", f"{med['explicit'] / med['flash']:.2f}", f"{med['explicit'] / med['hf']:.2f}",
            f"{scores_mib:.0f}"]


def main(argv: list[str] | None = None) -> None:
    """Time the three variants on a few ring-block shapes and print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, few repeats")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    shapes = [(1, 8, 4, 256, 64)] if args.quick else [(1, 8, 4, 256, 64), (1, 8, 4, 512, 64), (1, 8, 4, 1024, 64)]
    repeats = 3 if args.quick else 7
    rows = [measure(*shape, repeats) for shape in shapes]
    lines = ["# Soft-capped attention blocks: explicit scores vs the fused CPU kernel", "", machine_line(), "",
             "One causal diagonal ring block (B x H/Hkv x S x D), forward and backward, median ms over "
             f"{repeats} interleaved repetitions on 1 thread; cap {CAP}.", "",
             *table(["block", "flash (no cap) ms", "explicit, capped ms", "HF eager, capped ms",
                     "explicit / flash", "explicit / HF eager", "explicit scores MiB"], rows)]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
