"""meshkit's Trainer vs HF's own Trainer: CPU time per optimizer step, paired
(`python -m benchmarks.trainer [--quick] [--out FILE]`).

Two gloo ranks, one process each (1 thread), the same seeded Llama (`benchmarks.launch.seeded_llama`),
the same rows and the same `TrainingArguments` (AdamW, clipping at 1.0, linear decay, logging every
step) on every side; only the parallelism differs:

- HF's Trainer with DDP (accelerate's default over 2 processes) vs `meshkit...Trainer(plan="dp_replicate=2")`;
- HF's Trainer with accelerate's FSDP2 (`fsdp=True, fsdp_config={"fsdp_version": 2}`) vs `plan="dp_shard=2"`.
  accelerate takes its FSDP plugin only for accelerator devices: on CPU processes
  (`DistributedType.MULTI_CPU`) it silently wraps the model in DDP instead. The run checks
  `trainer.is_fsdp_enabled` and records that fallback rather than timing DDP under FSDP2's name;
  meshkit's dp_shard=2 is then reported against DDP;
- HF's Trainer with accelerate's `ParallelismConfig(tp_size=2)` vs `plan="tp=2"`. accelerate refuses
  ParallelismConfig on CPU processes (`DistributedType.MULTI_CPU`); the run records its refusal, and
  meshkit's tp=2 is reported against DDP.

Every variant steps on the same global batch (4 rows, split over its data ranks), so all first losses agree.

A step's CPU time is `time.process_time()` from the Trainer's `on_step_begin` to `on_step_end` (the
forward and backward of the step's batch, clipping, the optimizer and scheduler steps, logging),
summed over both ranks, after warm-up steps. The machine is 2 cores shared with other work: every
repetition trains every variant back to back (order rotated) and the ratio is the median over
repetitions of (meshkit / peer) of that repetition's median step; the first logged losses show the
sides train the same model on the same rows.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import transformers

import meshkit
from benchmarks.launch import run_ranks, seeded_llama
from benchmarks.report import emit, machine_line, paired, table

MODEL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, vocab_size=1024, max_position_embeddings=1024, use_cache=False,
             tie_word_embeddings=False, attn_implementation="sdpa")
GLOBAL_BATCH, SEQ = 4, 256  # rows per optimizer step, split over each variant's data ranks
QUICK = dict(reps=2, steps=3, warmup=1)
FULL = dict(reps=5, steps=4, warmup=2)
# (name, meshkit plan or None for HF's own Trainer, extra TrainingArguments)
VARIANTS = [
    ("HF Trainer, DDP", None, {}),
    ("meshkit Trainer, dp_replicate=2", "dp_replicate=2", {}),
    ("HF Trainer, accelerate FSDP2", None, {"fsdp": True, "fsdp_config": {
        "fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}),
    ("meshkit Trainer, dp_shard=2", "dp_shard=2", {}),
    ("HF Trainer, ParallelismConfig(tp_size=2)", None, {"parallelism_config": "tp"}),
    ("meshkit Trainer, tp=2", "tp=2", {}),
]
PAIRS = [("meshkit Trainer, dp_replicate=2", "HF Trainer, DDP"),
         ("meshkit Trainer, dp_shard=2", "HF Trainer, accelerate FSDP2"),
         ("meshkit Trainer, dp_shard=2", "HF Trainer, DDP"),
         ("meshkit Trainer, tp=2", "HF Trainer, ParallelismConfig(tp_size=2)"),
         ("meshkit Trainer, tp=2", "HF Trainer, DDP")]


class _StepClock(transformers.TrainerCallback):
    """CPU and wall seconds of every optimizer step after the warm-up ones."""

    def __init__(self, warmup: int):
        self.warmup, self.cpu, self.wall, self._start = warmup, [], [], (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kwargs):
        """Start the clocks (the batch is already loaded)."""
        self._start = (time.process_time(), time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
        """Stop them after the optimizer and scheduler stepped."""
        if state.global_step > self.warmup:
            self.cpu.append(time.process_time() - self._start[0])
            self.wall.append(time.perf_counter() - self._start[1])


def _rows(count: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (count, SEQ), generator=gen)
    return [{"input_ids": row.tolist(), "labels": row.tolist()} for row in ids]


def _collate(features: list[dict]) -> dict:
    ids = torch.tensor([f["input_ids"] for f in features])
    return {"input_ids": ids, "labels": torch.tensor([f["labels"] for f in features])}


def train_variant(name: str, steps: int, warmup: int, output_dir: str) -> dict[str, Any]:
    """On every rank: train `name` for warm-up + `steps` optimizer steps; its step times and first loss."""
    from accelerate import ParallelismConfig
    from datasets import Dataset

    from meshkit.integrations.transformers import Trainer

    _, plan, extra = next(v for v in VARIANTS if v[0] == name)
    extra = dict(extra)
    model = seeded_llama(MODEL)
    if extra.get("parallelism_config") == "tp":
        extra["parallelism_config"] = ParallelismConfig(tp_size=dist.get_world_size())
    total = warmup + steps
    dp = meshkit.Plan.from_string(plan).resolve(dist.get_world_size()).dp if plan else dist.get_world_size()
    args = transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=GLOBAL_BATCH // dp, max_steps=total, learning_rate=1e-4,
        max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
        disable_tqdm=True, **extra)
    clock = _StepClock(warmup)
    data = Dataset.from_list(_rows(GLOBAL_BATCH * total))
    kwargs = dict(model=model, args=args, train_dataset=data, data_collator=_collate, callbacks=[clock])
    try:
        trainer = Trainer(plan=plan, **kwargs) if plan else transformers.Trainer(**kwargs)
        if extra.get("fsdp") and not trainer.is_fsdp_enabled:
            return {"refused": "accelerate ignores fsdp= on CPU processes (DistributedType.MULTI_CPU) and wraps DDP; "
                               "not an FSDP2 measurement"}
        trainer.train()
    except Exception as err:  # a peer that cannot run here is reported with its reason, not hidden
        return {"refused": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    first = next(e["loss"] for e in trainer.state.log_history if "loss" in e)
    return {"cpu": clock.cpu, "wall": clock.wall, "loss": first}


def measure(reps: int, steps: int, warmup: int, output_dir: str, names: list[str]) -> dict[str, Any]:
    """Every variant of `names` per repetition, order rotated; CPU seconds per step summed over the two ranks."""
    cpu: dict[str, list[float]] = {n: [] for n in names}
    wall: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, float] = {}
    refused: dict[str, str] = {}
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            if name in refused:
                continue
            ranks = run_ranks(train_variant, 2, name, steps, warmup, output_dir)
            if "refused" in ranks[0]:
                refused[name] = ranks[0]["refused"]
                continue
            per_step = [sum(r["cpu"][i] for r in ranks) for i in range(steps)]
            cpu[name].append(statistics.median(per_step))
            wall[name].append(statistics.median(max(r["wall"][i] for r in ranks) for i in range(steps)))
            losses[name] = ranks[0]["loss"]
    return {"cpu": cpu, "wall": wall, "losses": losses, "refused": refused}


def report(result: dict[str, Any], settings: dict[str, int]) -> list[str]:
    """The markdown: every variant's step time, then the meshkit / peer ratios."""
    cpu, wall, losses, refused = result["cpu"], result["wall"], result["losses"], result["refused"]
    lines = ["# meshkit's Trainer vs HF's own Trainer: CPU time per optimizer step (2 gloo ranks)", "",
             machine_line(), f"- model: {MODEL['num_hidden_layers']} Llama blocks, hidden {MODEL['hidden_size']}, "
             f"vocab {MODEL['vocab_size']}; {GLOBAL_BATCH} rows x {SEQ} tokens per optimizer step (over the data ranks), "
             "fp32, AdamW, clipping; "
             f"{settings['reps']} repetitions x {settings['steps']} timed steps after {settings['warmup']} warm-up; "
             "CPU = process time summed over both ranks; ratio = median over repetitions", ""]
    rows = []
    for name in settings["names"]:
        if name in refused:
            rows.append([name, "n/a", "n/a", "n/a", f"not run: {refused[name]}"])
        else:
            rows.append([name, f"{losses[name]:.6f}", f"{statistics.median(cpu[name]) * 1e3:.1f}",
                         f"{statistics.median(wall[name]) * 1e3:.1f}", ""])
    lines += table(["variant", "first loss", "CPU ms/step", "wall ms/step", "note"], rows)
    ratios = []
    for mine, peer in (pair for pair in PAIRS if set(pair) <= set(settings["names"])):
        if peer in refused or mine in refused:
            ratios.append([mine, peer, "n/a (peer does not run on CPU)" if peer in refused else "n/a", ""])
        else:
            ratios.append([mine, peer, f"{paired(cpu[mine], cpu[peer]):.3f}", f"{paired(wall[mine], wall[peer]):.3f}"])
    lines += ["## meshkit / peer (target <= 1.00)", ""] + table(["meshkit", "peer", "CPU ratio", "wall ratio"], ratios)
    return lines


def main(argv: list[str] | None = None) -> None:
    """Measure and print (and with --out, write) the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    parser.add_argument("--out", default=None, help="markdown file to write")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default: 5, --quick 2)")
    parser.add_argument("--only", nargs="*", default=None, metavar="PLAN",
                        help="only these meshkit plans (e.g. dp_replicate=2) and their peers")
    args = parser.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    if args.reps:
        settings["reps"] = args.reps
    names = [v[0] for v in VARIANTS]
    if args.only is not None:
        mine = {v[0] for v in VARIANTS if v[1] in args.only}
        names = [n for n in names if n in mine or any(p == n and m in mine for m, p in PAIRS)]
    settings["names"] = names
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        result = measure(settings["reps"], settings["steps"], settings["warmup"], scratch, names)
    emit(report(result, settings), args.out)


if __name__ == "__main__":
    main()
