"""float8 training's loss curve against bf16 on real text (`python -m benchmarks.float8_loss [--out ...]`).

A small Llama (every projection dim a multiple of 16) trains for `--steps` AdamW steps on the Python
standard library's source (a BPE-4096 token store, documents held out for validation), once with
`param_dtype="bfloat16"` and once with the same plan and `float8="tensorwise"` (torchao, through
meshkit), from the same initial weights on the same batches. Both runs' held-out losses are evaluated
every `--eval-every` steps on the same validation rows; the report gives both curves and the final
ratio, against the goal: float8 within 1% of bf16's final held-out loss. On this CPU-only machine
torch._scaled_mm runs float8 matmuls on the CPU, so the numbers (not the speed) are a GPU run's.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch
import transformers  # lazily: its modeling code (which imports torchao) loads after meshkit, which quiets torchao

import meshkit
from benchmarks.data import _stdlib_prefix
from benchmarks.report import emit, machine_line, table
from meshkit.data import PackedLoader, TokenStore
from meshkit.data.prepare import prepare
from meshkit.data.tokenizer import train_bpe

MODEL = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)
SEQ, BATCH, VAL_ROWS, LR, WARMUP = 128, 8, 64, 3e-3, 20


def build_store(work: Path, megabytes: float) -> TokenStore:
    """A token store of the first `megabytes` of stdlib source, 5% of the documents held out."""
    files = _stdlib_prefix(megabytes)
    train_bpe((f.read_text(encoding="utf-8") for f in files), 4096, work / "tok")
    prepare([str(f) for f in files], work / "store", tokenizer=work / "tok", val_fraction=0.05, seed=0,
            progress=False)
    return TokenStore(work / "store")


def train(store: TokenStore, recipe: str, steps: int, eval_every: int) -> dict:
    """One run: held-out loss every `eval_every` steps, training losses, seconds per step."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=store.vocab_size, **MODEL))
    plan = meshkit.Plan(param_dtype="bfloat16", float8=recipe)
    pm = meshkit.parallelize(model, plan)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    loader = iter(PackedLoader(store, seq_len=SEQ, global_batch=BATCH, seed=0))
    val = next(iter(PackedLoader(store, seq_len=SEQ, global_batch=VAL_ROWS, seed=0, split="val")))
    out = {"held_out": [], "train": [], "seconds": 0.0}
    start = time.perf_counter()
    for step in range(1, steps + 1):
        ids, labels, positions = next(loader)
        out["train"].append(pm.forward_backward(ids, labels, position_ids=positions).item())
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        if step % eval_every == 0 or step == steps:
            out["held_out"].append((step, pm.evaluate(val[0], val[1], position_ids=val[2]).item()))
    out["seconds"] = (time.perf_counter() - start) / steps
    return out


def _tail_mean(values: list[float], n: int = 20) -> float:
    tail = values[-n:]
    return sum(tail) / len(tail)


def main(argv: list[str] | None = None) -> int:
    """Run both recipes and print (and with --out write) the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--megabytes", type=float, default=4.0, help="stdlib source to tokenize")
    parser.add_argument("--out", help="write the markdown report here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        store = build_store(Path(tmp), args.megabytes)
        runs = {name: train(store, name, args.steps, args.eval_every) for name in ("none", "tensorwise")}
    bf16, f8 = runs["none"], runs["tensorwise"]
    rows = [[step, f"{a:.4f}", f"{b:.4f}", f"{b / a:.4f}"] for (step, a), (_, b) in zip(bf16["held_out"], f8["held_out"])]
    final = f8["held_out"][-1][1] / bf16["held_out"][-1][1]
    lines = ["# float8 (tensorwise, torchao through meshkit) vs bf16: held-out loss", "",
             machine_line(f", {store.num_tokens:,} tokens of stdlib source, {args.steps} steps of {BATCH} x {SEQ}"), "",
             f"Final held-out loss: bf16 {bf16['held_out'][-1][1]:.4f}, float8 {f8['held_out'][-1][1]:.4f}: ratio "
             f"**{final:.4f}** (goal: within 1%, {'met' if abs(final - 1) <= 0.01 else 'NOT met'}). Mean training loss "
             f"over the last 20 steps: bf16 {_tail_mean(bf16['train']):.4f}, float8 {_tail_mean(f8['train']):.4f}. "
             f"Seconds per step on this CPU (torch._scaled_mm on the CPU; no float8 speed-up here): "
             f"bf16 {bf16['seconds']:.2f}, float8 {f8['seconds']:.2f}.", "",
             *table(["step", "bf16 held-out", "float8 held-out", "float8 / bf16"], rows)]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
