"""What a user reads from a short recipe run: every TensorBoard scalar the recipe README promises is
there and sane (loss and held-out loss finite, tokens/s positive and equal to the step's tokens over
its time, MFU in (0, 1] and equal to hand-counted model FLOPs over the peak, memory positive), and a
held-out loss is printed on the console when it is computed, not only on `log_every` steps; the run
ends with its loss curve as a PNG beside the events."""

from __future__ import annotations

import dataclasses
import math
import re
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "recipes") not in sys.path:
    sys.path.insert(0, str(ROOT / "recipes"))
import train_llama  # noqa: E402  (the recipe's folder is on sys.path, as `python recipes/train_llama.py` has it)

STEPS, SEQ, LOCAL_BATCH, PEAK_TFLOPS = 4, 32, 2, 1.0


def _train(log_dir: str) -> dict:
    run = train_llama.load_config(str(ROOT / "recipes" / "configs" / "debug_cpu.toml"))
    run.plan = train_llama.meshkit.Plan(dp_shard=2)
    run.train = dataclasses.replace(run.train, steps=STEPS, seq_len=SEQ, local_batch=LOCAL_BATCH, grad_accum=1,
                                    eval_every=3, eval_batches=1, log_every=10, warmup_steps=1, threads=1,
                                    log_dir=log_dir, name="run", peak_tflops=PEAK_TFLOPS)
    return train_llama.train(run)


def _model_flops_per_token(table: dict) -> float:
    """6 x every parameter but the input embedding's (a gather; the LM head's matmul counts), counted on
    the HF model itself, + 12 x layers x hidden x seq (meshkit/metrics.py's convention)."""
    config = LlamaConfig(**{k: v for k, v in table.items() if k != "model_type"})
    model = LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    return 6 * n + 12 * config.num_hidden_layers * config.hidden_size * SEQ


def test_short_recipe_run_logs_sane_scalars_and_prints_each_held_out_loss(dist, tmp_path):
    outcomes = dist(2).run_raw(_train, str(tmp_path))
    assert all(o.ok for o in outcomes), "\n".join(f"rank {o.rank}: {o.message}\n{o.traceback}" for o in outcomes)
    console = outcomes[0].output
    eval_lines = [line for line in console.splitlines() if "eval_loss" in line]
    assert [re.match(r"step (\d+)/", line).group(1) for line in eval_lines] == ["3", "4"], console

    assert f"loss curve: {tmp_path / 'run' / 'loss.png'}" in console
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    steps = list(range(1, STEPS + 1))
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/step_s", "train/tokens_per_s_per_device",
                "train/mfu", "train/peak_rss_gib"):
        assert sorted(scalars.get(tag, {})) == steps, (tag, sorted(scalars))
        assert all(math.isfinite(v) and v > 0 for v in scalars[tag].values()), (tag, scalars[tag])
    assert sorted(scalars["eval/loss"]) == [3, 4] and sorted(scalars["eval/perplexity"]) == [3, 4]
    for step, loss in scalars["eval/loss"].items():
        assert 0 < loss < 2 * math.log(256) and scalars["eval/perplexity"][step] == pytest.approx(math.exp(loss), rel=1e-5)
    assert scalars["train/predicted_peak_gib"][1] > 0

    tokens = 2 * LOCAL_BATCH * SEQ  # dp=2 ranks x local_batch rows x seq_len, one micro-batch
    flops = _model_flops_per_token(train_llama.load_config(str(ROOT / "recipes" / "configs" / "debug_cpu.toml")).model)
    for step in steps:
        tps = scalars["train/tokens_per_s_per_device"][step]
        assert tps == pytest.approx(tokens / scalars["train/step_s"][step] / 2, rel=1e-5)
        mfu = scalars["train/mfu"][step]
        assert 0 < mfu <= 1 and mfu == pytest.approx(flops * tps / (PEAK_TFLOPS * 1e12), rel=1e-5)
        assert scalars["train/peak_rss_gib"][step] < 64  # a process's peak RSS in GiB, not bytes or MiB
