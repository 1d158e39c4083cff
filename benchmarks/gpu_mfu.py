"""Single-GPU MFU of a Llama-3-8B-shaped model with fewer layers: meshkit (every degree 1) vs plain HF.

    python -m benchmarks.gpu_mfu [--layers 4] [--seq 8192] [--reps 10] [--quick] [--peak-tflops X]

meshkit runs `Plan(param_dtype="bfloat16", activation_checkpointing="selective", compile=True)` on a
one-rank mesh: FSDP2's mixed precision keeps fp32 master weights and computes in bf16. The peer is the
same HF model with fp32 weights under bf16 autocast, `model(input_ids, labels=labels).loss.backward()`,
no compile, no checkpointing: what a user gets without meshkit, with the same master/compute dtypes.

Both models live on the GPU together so their steps can be interleaved (a clock or thermal drift
then hits both alike); that is why a step here is forward + backward without the optimizer: two
AdamW states of a ~1.9B-parameter model would not fit one 80 GiB GPU beside two sets of activations,
and the optimizer's FLOPs are not part of MFU anyway. The MFU convention is meshkit.metrics' (6N +
attention, recompute excluded). Without a CUDA device the script prints "no CUDA device: skipped"
and exits 0, so the CPU benchmark runner can always list it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

# Llama-3-8B's shapes (meta-llama/Meta-Llama-3-8B config.json); only the layer count is cut.
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, use_cache=False)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line; --quick shortens the run for a GPU lent by the minute."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=10, help="timed steps per model, interleaved")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per model (compile happens here)")
    p.add_argument("--quick", action="store_true", help="seq 4096, 5 reps, 2 warmup steps")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="per-GPU dense bf16 peak; 0: H100/H200 preset")
    args = p.parse_args(argv)
    if args.quick:
        args.seq, args.reps, args.warmup = min(args.seq, 4096), 5, 2
    return args


def timed(step: Callable[[], torch.Tensor]) -> tuple[float, float]:
    """(seconds, loss) of one step; synchronised on both sides so the time covers the GPU work."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss = float(step())  # a host sync
    torch.cuda.synchronize()
    return time.perf_counter() - start, loss


def build(config, seed: int):
    """(meshkit ParallelModel, plain HF model) with the same weights, both on the current GPU."""
    from transformers import LlamaForCausalLM

    import meshkit

    torch.manual_seed(seed)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(config)  # fp32 weights = master weights, like meshkit's FSDP shards
    hf.train()
    with torch.device("meta"):
        shell = LlamaForCausalLM(config)
    plan = meshkit.Plan(param_dtype="bfloat16", activation_checkpointing="selective", compile=True)
    pm = meshkit.parallelize(shell, plan)
    same = True
    try:
        pm.load_full_state_dict(hf.state_dict())
    except (ValueError, RuntimeError, KeyError) as err:  # the throughput comparison stands without it
        print(f"note: could not copy HF weights into meshkit ({str(err).splitlines()[0]}); random init instead")
        pm.init_weights(seed)
        same = False
    return pm, hf, same


def main(argv: list[str] | None = None) -> int:
    """meshkit and plain HF on one GPU, interleaved, with the MFU of each and their ratio (skipped without CUDA)."""
    args = parse(argv)
    if not torch.cuda.is_available():
        print("## Single-GPU MFU (meshkit vs plain HF)\n\nno CUDA device: skipped")
        return 0
    from transformers import LlamaConfig

    from meshkit import metrics

    torch.cuda.set_device(0)
    config = LlamaConfig(**LLAMA3_8B, num_hidden_layers=args.layers)
    pm, hf, same = build(config, seed=0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda", generator=gen)
    labels = ids.clone()  # unshifted, HF convention: both shift once

    def meshkit_step() -> torch.Tensor:
        """meshkit's step under its plan (bf16 compute, selective AC, compiled blocks): the variant measured."""
        pm.model.zero_grad(set_to_none=True)
        return pm.forward_backward(ids, labels)

    def hf_step() -> torch.Tensor:
        """Plain HF under bf16 autocast: the peer every single-GPU user already has."""
        hf.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = hf(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss.detach()

    steps = {"meshkit": meshkit_step, "HF": hf_step}
    first_loss = {name: timed(fn)[1] for name, fn in steps.items()}
    for _ in range(args.warmup - 1):
        for fn in steps.values():
            timed(fn)
    times: dict[str, list[float]] = {name: [] for name in steps}
    torch.cuda.reset_peak_memory_stats()
    for rep in range(args.reps):
        order = list(steps) if rep % 2 == 0 else list(reversed(steps))  # neither always goes first
        for name in order:
            times[name].append(timed(steps[name])[0])

    tokens = args.batch * args.seq
    fpt = metrics.flops_per_token(config, args.seq, "selective")
    peak = metrics.peak_flops(dtype="bfloat16", override=args.peak_tflops * 1e12 or None)
    gpu = torch.cuda.get_device_name()
    lines = [
        "## Single-GPU MFU (meshkit vs plain HF)\n",
        f"{gpu}; Llama-3-8B shapes with {args.layers} layers ({metrics.nonembedding_params(config) / 1e9:.2f}B "
        f"non-embedding params), B={args.batch}, S={args.seq}, bf16 compute / fp32 master weights, forward + "
        f"backward per step (no optimizer), {args.warmup} warm-up and {args.reps} interleaved timed steps each. "
        f"meshkit: Plan(param_dtype=bfloat16, activation_checkpointing=selective, compile=True), every degree 1. "
        f"HF: fp32 weights under torch.autocast(bfloat16), no compile, no checkpointing. MFU = "
        f"{fpt.model / 1e9:.2f} GFLOP/token (6N + attention) x tokens/s / "
        f"{'peak unknown' if not peak else f'{peak / 1e12:.0f} TFLOP/s'}.\n",
        "| | median step s | tokens/s | MFU | first loss |",
        "|---|---|---|---|---|",
    ]
    for name in steps:
        step_s = statistics.median(times[name])
        tps = tokens / step_s
        mfu = metrics.mfu(fpt.model, tps, peak)
        lines.append(f"| {name} | {step_s:.4f} | {tps:,.0f} | {'n/a' if mfu is None else f'{mfu:.1%}'} | "
                     f"{first_loss[name]:.4f} |")
    ratios = [h / m for m, h in zip(times["meshkit"], times["HF"])]
    lines += [
        "",
        f"meshkit / HF throughput: {statistics.median(ratios):.2f}x (median of per-repetition ratios; "
        f"range {min(ratios):.2f}-{max(ratios):.2f}). Peak allocated over the timed steps, both models resident: "
        f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB.",
        "Same weights in both, so the first losses should agree to bf16 precision." if same
        else "Weights differ (copy failed), so the first losses are not comparable.",
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
