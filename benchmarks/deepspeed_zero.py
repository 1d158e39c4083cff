"""ZeRO-1 and ZeRO-2 against DeepSpeed 0.19.8 on CPU: CPU time per training step and the loss
against the single-process torch reference (`python -m benchmarks.deepspeed_zero [--out FILE]`).

DeepSpeed is an optional peer, never a meshkit dependency. It lives in a virtual environment of its
own, found by `--deepspeed-python` or the environment variable MESHKIT_DEEPSPEED_PYTHON; create it with

    python3 -m venv /work/peers/deepspeed-venv
    /work/peers/deepspeed-venv/bin/pip install torch==2.13.0          # the CPU build meshkit uses, first
    DS_BUILD_OPS=0 /work/peers/deepspeed-venv/bin/pip install deepspeed==0.19.8 transformers==5.24.0

DeepSpeed's CPU accelerator JIT-builds its shared-memory op (`deepspeed_shm_comm`, about 1.5 min) at the
first `init_distributed`, under a lock file in ~/.cache/torch_extensions; a build killed midway leaves
that lock behind and every later world waits on it forever (remove the stale lock; no build running).

Both sides train the same seeded 4-block Llama (hidden 256, vocab 1024, fp32) on the same tokens with
torch's AdamW (lr 1e-3, eps 1e-3) for STEPS steps on 2 gloo ranks, each rank 2 x 256 tokens per
step: meshkit `Plan(dp_shard=2, zero=N)` stepping `torch.optim.AdamW` over `pm.parameters()`, and
`deepspeed.initialize` with `zero_optimization.stage = N` wrapping the same AdamW (DeepSpeed's CPU
accelerator, `dist_backend="gloo"`). Each side is a world of its own (DeepSpeed needs its own
environment), so the pairing is by round: every round runs DeepSpeed's world and meshkit's back to back
for both stages, and the ratio of a round is meshkit's median step CPU over DeepSpeed's in that
round (CPU = `time.process_time`, gloo's threads included, summed over the two ranks). The table gives
the rounds' ratios and their median, the split into forward+backward and optimizer step, and the
largest loss difference from the torch reference (one process, the global batch, the same AdamW).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=1024, max_position_embeddings=1024, use_cache=False,
             tie_word_embeddings=False, attn_implementation="sdpa")
BATCH, SEQ, STEPS, WARMUP = 2, 256, 12, 3
ADAMW = dict(lr=1e-3, eps=1e-3, weight_decay=0.0)
ENV = "MESHKIT_DEEPSPEED_PYTHON"
ROOT = Path(__file__).resolve().parents[1]


def _batches(world: int):
    """Every step's global batch [world * BATCH, SEQ], the same on both sides and for the reference."""
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, MODEL["vocab_size"], (world * BATCH, SEQ), generator=g) for _ in range(STEPS)]


def _model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL))


def _rank_side(side: str, zero: int) -> dict:
    """One rank of a world (run under torchrun): per step CPU seconds of forward+backward and of the
    optimizer step, and the loss."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    model = _model()
    if side == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True,
                  "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
        engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

        def fwd_bwd(ids):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            return loss

        def step():
            engine.step()
    else:
        import meshkit

        pm = meshkit.parallelize(model, meshkit.Plan(dp_shard=-1, zero=zero))
        optimizer = torch.optim.AdamW(pm.parameters(), **ADAMW)

        def fwd_bwd(ids):
            return pm.forward_backward(ids, ids)

        def step():
            optimizer.step()
            optimizer.zero_grad()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"fwd_bwd": [], "step": [], "loss": []}
    for batch in _batches(world):
        ids = batch[rank * BATCH:(rank + 1) * BATCH]
        dist.barrier()
        c0 = time.process_time()
        loss = fwd_bwd(ids)
        c1 = time.process_time()
        step()
        c2 = time.process_time()
        loss = loss.detach().clone()
        if side == "deepspeed":  # DeepSpeed's loss is this rank's mean: the global mean of equal shares
            dist.all_reduce(loss)
            loss /= world
        out["fwd_bwd"].append(c1 - c0)
        out["step"].append(c2 - c1)
        out["loss"].append(float(loss))
    return out


def _reference(world: int) -> list[float]:
    """The torch reference: one process, the global batch, the same AdamW."""
    import torch

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for batch in _batches(world):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def _launch(python: str, side: str, zero: int) -> list[dict]:
    """One world of 2 ranks for `side`; every rank's measurements."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
               "--rank-side", side, "--zero", str(zero)]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    results = [json.loads(line.split(" ", 1)[1]) for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    if run.returncode != 0 or len(results) != 2:
        raise RuntimeError(f"{side} zero={zero}: rc {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    return results


def main(argv: list[str] | None = None) -> int:
    """Rounds of (DeepSpeed world, meshkit world) per stage; print the ratios, write them with --out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--deepspeed-python", default=os.environ.get(ENV))
    parser.add_argument("--rank-side", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--zero", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_side:  # a rank of a world this script launched
        result = _rank_side(args.rank_side, args.zero)
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")  # one write: the ranks share the pipe
        sys.stdout.flush()
        return 0
    if not args.deepspeed_python or not Path(args.deepspeed_python).exists():
        parser.error(f"DeepSpeed's python not found ({args.deepspeed_python!r}): pass --deepspeed-python or set {ENV}; "
                     "the module docstring says how to create that environment")
    from benchmarks.report import emit, machine_line, table

    load = os.getloadavg()
    reference = _reference(2)
    rows, summary = [], []
    for zero in args.stages:
        ratios, parts = [], {"ds": [], "mk": []}
        drift = {"deepspeed": 0.0, "meshkit": 0.0}
        for _ in range(args.rounds):
            sides = {}
            for side, python in (("deepspeed", args.deepspeed_python), ("meshkit", sys.executable)):
                ranks = _launch(python, side, zero)
                per_step = [[sum(r[key][i] for r in ranks) for i in range(WARMUP, STEPS)] for key in ("fwd_bwd", "step")]
                sides[side] = [statistics.median(x) for x in per_step]
                drift[side] = max(drift[side], max(abs(a - b) for a, b in zip(ranks[0]["loss"], reference)))
            ratios.append(sum(sides["meshkit"]) / sum(sides["deepspeed"]))
            parts["ds"].append(sides["deepspeed"])
            parts["mk"].append(sides["meshkit"])
            rows.append([zero, len(ratios), *(f"{x * 1e3:.1f}" for x in sides["deepspeed"] + sides["meshkit"]),
                         f"{ratios[-1]:.3f}"])
        summary.append([zero, f"{statistics.median(ratios):.3f}", ", ".join(f"{r:.3f}" for r in ratios),
                        f"{drift['meshkit']:.1e}", f"{drift['deepspeed']:.1e}"])
    lines = ["# ZeRO-1 / ZeRO-2 vs DeepSpeed 0.19.8 (CPU accelerator, gloo, 2 ranks)", "",
             machine_line(f"; load average at start {', '.join(f'{x:.1f}' for x in load)}"),
             f"- model: {MODEL['num_hidden_layers']} Llama blocks, hidden {MODEL['hidden_size']}, vocab "
             f"{MODEL['vocab_size']}, fp32; {BATCH} x {SEQ} tokens per rank per step; torch AdamW {ADAMW}; "
             f"{STEPS} steps, the first {WARMUP} not timed; CPU = process time summed over both ranks, median over "
             "steps; each side a world of its own, paired by round", ""]
    lines += table(["ZeRO", "meshkit / DeepSpeed CPU per step (median of rounds)", "rounds", "max abs(loss - torch) meshkit",
                    "max abs(loss - torch) DeepSpeed"], summary)
    lines += table(["ZeRO", "round", "DeepSpeed fwd+bwd ms", "DeepSpeed step ms", "meshkit fwd+bwd ms", "meshkit step ms",
                    "meshkit / DeepSpeed"], rows)
    lines.append(f"- load average at end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
