"""What bf16 dK/dV cost in accuracy: ring attention under bf16 inputs with the dK/dV buffer sent in
fp32 (the default, `reduce_dtype="float32"`) or in bf16 (`reduce_dtype="bfloat16"`), against the
fp64 reference on the whole sequence
(`python -m benchmarks.context_parallel.dkdv_dtype [--out benchmarks/results/cp_dkdv_dtype.md]`).

Under bf16 parameters the ring's dK/dV travel in `reduce_dtype`: every rank adds its share to the
buffer in fp32 and the buffer crosses the wire cp-1 (kept K/V) or cp (plain ring) times, rounded
to the wire dtype each time. Halving those bytes halves the ring's gradient traffic; the table says
what it does to dK and dV. The "one process" row is the same bf16 inputs through one bf16 kernel
call with no ring (the error bf16 attention has anyway). Errors: max |x - ref| / max |ref| over
the whole sequence, and the relative L2 norm, the median over seeds.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from benchmarks.launch import run_ranks
from benchmarks.report import emit, machine_line, table
from meshkit.context_parallel import ring_attention, shard, unshard
from meshkit.context_parallel.kernels import attention_block, reference_attention

B, H, HKV, D, SEQ = 1, 8, 2, 64, 1024
SEEDS = (0, 1, 2)


def _inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, SEQ, D), (B, HKV, SEQ, D), (B, HKV, SEQ, D), (B, H, SEQ, D)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def _reference(q, k, v, dout) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = reference_attention(q, k, v, causal_kind="causal", scale=D ** -0.5)
    out.backward(dout)
    return k.grad, v.grad


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = got.double() - ref
    return float(diff.abs().max() / ref.abs().max()), float(diff.norm() / ref.norm())


def measure(keep_kv: bool) -> dict[str, list[tuple[float, float, float, float]]]:
    """On every rank of a cp group (the world): per seed, (dK max, dK L2, dV max, dV L2) errors of
    each wire dtype and of one bf16 process."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, list[tuple[float, float, float, float]]] = {"fp32": [], "bf16": [], "one process": []}
    for seed in SEEDS:
        q, k, v, dout = _inputs(seed)
        ref_k, ref_v = _reference(q, k, v, dout)
        for name, grad_dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            local = [shard(t, "zigzag", cp, rank, dim=2).to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
            o = ring_attention(*local, dist.group.WORLD, layout="zigzag", grad_dtype=grad_dtype, keep_kv=keep_kv)
            o.backward(shard(dout, "zigzag", cp, rank, dim=2).to(torch.bfloat16))
            grads = []
            for t in local[1:]:
                parts = [torch.empty_like(t.grad) for _ in range(cp)]
                dist.all_gather(parts, t.grad.contiguous())
                grads.append(unshard(parts, "zigzag", dim=2))
            out[name].append((*_errors(grads[0], ref_k), *_errors(grads[1], ref_v)))
        one = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
        o, _ = attention_block(*one, causal_kind="causal", scale=D ** -0.5)
        o.backward(dout.to(torch.bfloat16))
        out["one process"].append((*_errors(one[1].grad, ref_k), *_errors(one[2].grad, ref_v)))
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure at cp=2 and 4, plain and kept-K/V ring; print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--cp", type=int, nargs="*", default=[2, 4])
    args = parser.parse_args(argv)
    rows = []
    for cp in args.cp:
        for keep in (False, True):
            res = run_ranks(measure, cp, keep)[0]
            for name, per_seed in res.items():
                if name == "one process" and keep:
                    continue
                med = [statistics.median(x[i] for x in per_seed) for i in range(4)]
                label = "one process, bf16 kernel" if name == "one process" else \
                    f"ring{' (K/V kept)' if keep else ''}, dK/dV sent in {name}"
                rows.append([cp, label, *(f"{m:.2e}" for m in med)])
    lines = ["# bf16 attention: dK/dV sent in fp32 or bf16 (ring, zig-zag layout)", "", machine_line(),
             f"- q [{B}, {H}, {SEQ}, {D}], k/v {HKV} heads, causal, bf16 inputs, fp64 reference on the whole "
             f"sequence; median over seeds {SEEDS}; error = max |x - ref| / max |ref| and relative L2", ""]
    lines += table(["cp", "variant", "dK max", "dK L2", "dV max", "dV L2"], rows)
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
