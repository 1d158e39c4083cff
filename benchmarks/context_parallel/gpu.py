"""Section 5 of the context-parallel benchmark (`--gpu`, CUDA only): kernel efficiency of meshkit's
ring blocks against one SDPA call on the same work."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.context_parallel.ranks import first_line
from benchmarks.report import table
from meshkit.context_parallel import merge_, ring_schedule, shard
from meshkit.context_parallel.kernels import attention_backward, attention_forward


def gpu_section(args: argparse.Namespace) -> list[str]:
    """Section 5: whether a ring's small per-step blocks keep the GPU kernel as busy as one whole-sequence SDPA call."""
    lines = ["## 5. GPU: kernel efficiency of ring blocks vs one SDPA call", ""]
    if not args.gpu:
        return lines + ["Not requested (pass `--gpu`; it runs only when torch.cuda.is_available()).", ""]
    if not torch.cuda.is_available():
        return lines + ["Skipped: torch.cuda.is_available() is False on this machine.", ""]
    shape = {"batch": 1, "heads": args.gpu_heads, "kv_heads": args.gpu_kv_heads, "head_dim": args.gpu_head_dim}
    lines += [f"{torch.cuda.get_device_name()}, bf16, B=1, H={shape['heads']}, Hkv={shape['kv_heads']}, "
              f"D={shape['head_dim']}; CUDA-event medians of {args.gpu_reps} reps after warm-up. (a) one ring step: "
              "meshkit's block fwd+bwd (out + lse, backward from final out/lse) on an S/cp x S/cp off-diagonal "
              "block vs F.scaled_dot_product_attention fwd+bwd on the same shapes (same work). (b) every block "
              "kernel + merge of one zig-zag rank over a whole ring turn, no communication, vs a full causal SDPA "
              "fwd+bwd on S divided by cp (the ideal share). efficiency = SDPA time / meshkit time.", ""]
    rows = []
    for seq in args.gpu_seqs:
        for cp in (4, 8):
            try:
                rows.append([seq, cp] + gpu_rows(dict(shape, seq=seq), cp, torch.device("cuda"), torch.bfloat16,
                                                  args.gpu_reps))
            except Exception as e:  # noqa: BLE001 - report the kernel's refusal, keep the other rows
                rows.append([seq, cp, f"failed: {first_line(e)}", "", "", "", "", ""])
    return lines + table(["S", "cp", "(a) block ms", "(a) SDPA ms", "(a) efficiency", "(b) zig-zag turn ms",
                          "(b) full SDPA / cp ms", "(b) efficiency"], rows)


def device_timer(device: torch.device, reps: int) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of fn: CUDA events on a GPU (kernels are async), perf_counter elsewhere."""

    def measure(fn: Callable[[], Any]) -> float:
        """Two warm-up calls first: the first launches pay for kernel selection and allocation."""
        for _ in range(2):
            fn()
        samples = []
        for _ in range(reps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    return measure


def gpu_rows(shape: dict, cp: int, device: torch.device, dtype: torch.dtype, reps: int) -> list[str]:
    """(a) and (b) of the GPU section for one (S, cp); device-agnostic so it can be smoke-tested on CPU."""
    B, H, Hkv, S, D = shape["batch"], shape["heads"], shape["kv_heads"], shape["seq"], shape["head_dim"]
    g = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(B, H, S, D, generator=g, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, Hkv, S, D, generator=g, device=device, dtype=dtype) for _ in range(2))
    measure = device_timer(device, reps)
    n = S // cp

    def sdpa(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor, d_: torch.Tensor, causal: bool) -> None:
        """The peer: one fused SDPA forward and backward over the same blocks."""
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q_, k_, v_))
        F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=Hkv != H).backward(d_)

    # An off-diagonal block: the queries of the second shard against the keys of the first.
    qi, kj, vj, di = (t.contiguous() for t in (q[:, :, n:2 * n], k[:, :, :n], v[:, :, :n], dout[:, :, n:2 * n]))

    def block() -> None:
        """One ring step's work: meshkit's block kernel forward and backward with the final O and LSE."""
        out, lse = attention_forward(qi, kj, vj)
        attention_backward(di, qi, kj, vj, out, lse)

    a_block = measure(block)
    a_sdpa = measure(lambda: sdpa(qi, kj, vj, di, False))
    shards = {name: [shard(t, "zigzag", cp, r, dim=2) for r in range(cp)]
              for name, t in (("q", q), ("k", k), ("v", v), ("d", dout))}
    plan = ring_schedule("zigzag", True, cp, 0)
    b_turn = measure(lambda: _zigzag_turn(shards, plan, attention_forward, attention_backward))
    b_full = measure(lambda: sdpa(q, k, v, dout, True)) / cp
    return [f"{a_block:.3f}", f"{a_sdpa:.3f}", f"{a_sdpa / a_block:.2f}", f"{b_turn:.3f}", f"{b_full:.3f}",
            f"{b_full / b_turn:.2f}"]


def _half(x: torch.Tensor, half: int | None) -> torch.Tensor:
    """The first or second half of the sequence dim (zig-zag's half blocks); None keeps the whole tensor."""
    return x if half is None else x.narrow(2, half * (x.shape[2] // 2), x.shape[2] // 2)


def _zigzag_turn(shards: dict, plan: list, forward: Callable, backward: Callable) -> None:
    """Rank 0's block kernels for one zig-zag turn: forward + fp32 merge, then backward from the final
    out/lse, exactly the computation ring.py runs between its transfers."""
    q, d = shards["q"][0], shards["d"][0]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)
    for blk in plan:
        kv = (_half(shards["k"][blk.src], blk.kv_half), _half(shards["v"][blk.src], blk.kv_half))
        o_i, l_i = forward(_half(q, blk.q_half), *kv, causal_kind="causal" if blk.causal else "none")
        merge_(_half(out, blk.q_half), _half(lse, blk.q_half), o_i, l_i)
    final = out.to(q.dtype)
    for blk in plan:
        kv = (_half(shards["k"][blk.src], blk.kv_half), _half(shards["v"][blk.src], blk.kv_half))
        backward(_half(d, blk.q_half), _half(q, blk.q_half), *kv, _half(final, blk.q_half), _half(lse, blk.q_half),
                 causal_kind="causal" if blk.causal else "none")


