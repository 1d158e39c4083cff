"""Train a Hugging Face Llama-family model with meshkit, from a TOML preset and command-line flags.

    torchrun --nproc-per-node 8 recipes/train_llama.py --config recipes/configs/debug_cpu.toml
    torchrun --nproc-per-node 8 recipes/train_llama.py --config recipes/configs/llama3_8b.toml --steps 50 --tp 2

The recipe is an ordinary training loop: everything parallel lives behind `meshkit.parallelize`, so the
loop reads the same for one process or a 5D mesh. The model is built on the meta device and only this
rank's shards are ever materialised. Data is synthetic by default (a Markov chain, so the loss has
something to learn and falls visibly within a few dozen steps); every rank with the same data-parallel
rank generates the same batches without any communication. With `[data] path` (a token store written
by `python -m meshkit.data prepare`) it trains on real text through `meshkit.data`; `data_setup.py`
builds either. The preset and flags are read by `train_config.py`, next to this file.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import data_setup  # the recipe's own modules beside this script (the script's folder is on sys.path)
import dry_run
import preflight
import torch
import torch.distributed as dist
from checkpointing import EXIT_SAVE_FAILED, Checkpointing, CheckpointWriteError, follow_schedule_after_resume
from data_setup import MarkovTokens
from run_log import LOG_KEY, RunLog
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
from tqdm import tqdm
from train_config import (  # the recipe's own module beside this script (the script's folder is on sys.path)
    RunConfig,
    TrainConfig,
    apply_cli,
    build_model_config,
    build_parser,
    load_config,
)
from transformers.utils import logging as hf_logging

import meshkit
from meshkit import heartbeat, metrics
from meshkit.mesh import ensure_process_group, world_size_from_env
from meshkit.state.run_record import resume_problem, run_record, with_run_record
from meshkit.step.nonfinite import NonFiniteGuard

# ------------------------------------------------------------------------------------------- data


def evaluate(pm: meshkit.ParallelModel, data: data_setup.SyntheticData | data_setup.StoreData, batches: int) -> float:
    """Loss over the held-out batches, weighted by their tokens (the single-device loss of them all)."""
    pm.eval()
    total = count = 0.0
    for index in range(data.held_out_batches(batches)):
        input_ids, labels, position_ids = data.held_out(index)
        tokens = pm.count_valid_tokens(labels)
        total += float(pm.evaluate(input_ids, labels, position_ids=position_ids)) * tokens
        count += tokens
    pm.train()
    return total / max(count, 1)


def lr_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup from lr/warmup to lr, then cosine decay to lr * min_lr_ratio at the last step."""
    warmup = max(cfg.warmup_steps, 0)
    decay_steps = max(cfg.steps - warmup, 1)

    def factor(step: int) -> float:  # step = optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / decay_steps, 1.0)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)




# ------------------------------------------------------------------------------------------- run


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _set_threads(cfg: TrainConfig) -> None:
    """Several ranks sharing a few cores thrash if each spawns a thread per core."""
    if torch.cuda.is_available():
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)


def _profiler(enabled: bool, trace_dir: Path, steps: int):
    """A few-step torch.profiler window, or None. Traces open in TensorBoard or chrome://tracing."""
    if not enabled:
        return None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    wait = 1 if steps > 4 else 0
    return profile(activities=activities,
                   schedule=schedule(wait=wait, warmup=1, active=min(3, max(steps - 2, 1)), repeat=1),
                   on_trace_ready=tensorboard_trace_handler(str(trace_dir), worker_name=f"rank{_rank()}"),
                   record_shapes=True)


def train(run: RunConfig) -> dict[str, float]:
    """The loop. Returns first/last loss and timing (rank-identical) for scripts and tests."""
    cfg = run.train
    model_config, ckpt_dir, load_weights = build_model_config(run.model)
    preflight.check_config(run, model_config, world_size_from_env())  # pure: before any collective
    _set_threads(cfg)
    torch.manual_seed(cfg.seed)
    ensure_process_group(timeout_s=cfg.timeout_s)
    beat = _start_heartbeat(cfg)
    if _rank() == 0:
        timeout = heartbeat.collective_timeout_s()
        print(f"meshkit: collective timeout {'unknown' if timeout is None else f'{timeout:.0f} s'}, heartbeat "
              f"{f'{cfg.heartbeat_s:g} s' if beat is not None else 'off'}", flush=True)
    try:
        return _train(run, model_config, ckpt_dir, load_weights, beat)
    finally:
        preflight.release_save_dir(cfg)
        if beat is not None:
            beat.stop()


def _start_heartbeat(cfg: TrainConfig) -> heartbeat.Heartbeat | None:
    """Name a silent rank and end this one, so torchrun ends (or restarts) the job promptly."""
    if not cfg.heartbeat_s:
        return None

    def end_job(silent: list[heartbeat.Silent]) -> None:
        sys.stderr.write("".join(s.message(_rank()) + "\n" for s in silent))
        sys.stderr.flush()
        os._exit(EXIT_SILENT_RANK)

    # No namespace needed: each torchrun attempt's group has a store namespace of its own (meshkit.attempt_store).
    return heartbeat.start_for_process_group(cfg.heartbeat_s, end_job)


EXIT_SILENT_RANK = 3  # documented in docs/reliability.md


def _train(run: RunConfig, model_config: Any, ckpt_dir: Path | None, load_weights: bool,
           beat: heartbeat.Heartbeat | None) -> dict[str, float]:
    cfg = run.train
    preflight.check_filesystem(run, model_config)

    with torch.device("meta"):
        model = run.build_model(model_config)  # a PEFT model when [peft] asks for an adapter
    n_nonembedding = metrics.count_nonembedding_params(model)
    pm = meshkit.parallelize(model, run.plan)
    ckpt = Checkpointing(cfg, pm, global_batch=pm.dp_size * cfg.local_batch * cfg.grad_accum)
    if ckpt.resuming:
        pm.materialise()  # values come from the checkpoint below; the optimizer must hold the real tensors
    elif load_weights:
        pm.load_hf_checkpoint(ckpt_dir)  # each rank reads only the slices it holds
    else:
        pm.init_weights(cfg.seed)
    plan, world, rank = pm.plan, dist.get_world_size(), dist.get_rank()
    seq_problem = plan.seq_len_problem(cfg.seq_len)  # at startup, not at the first step
    if seq_problem:
        raise ValueError(f"[train] seq_len={cfg.seq_len}: {seq_problem}")
    record = run_record(plan, pm.dp_size, cfg.local_batch, cfg.grad_accum, cfg.seq_len)  # goes into checkpoints

    optimizer = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                  weight_decay=cfg.weight_decay)
    scheduler = lr_schedule(optimizer, cfg)
    data = data_setup.build(run.data, cfg, pm, ckpt_dir, lambda: MarkovTokens(
        model_config.vocab_size, cfg.seq_len, cfg.local_batch, pm.dp_rank, run.data, pm.dp_size))
    data_setup.use_data_tokens(pm.model, data, ckpt_dir)  # eos/pad that generation and the export stop at
    first_step = ckpt.restore(optimizer, scheduler, data=data.loader)
    if ckpt.resuming:
        restored_lr, lr_now = follow_schedule_after_resume(scheduler)
        if rank == 0 and not math.isclose(restored_lr, lr_now, rel_tol=1e-6):
            print(f"[train] resumed at step {first_step}: learning rate {restored_lr:.4g} -> {lr_now:.4g}, this "
                  f"run's schedule ([train] steps={cfg.steps}, warmup_steps={cfg.warmup_steps}) at that step",
                  flush=True)
    problem = resume_problem(ckpt.resumed_extra, record, cfg.allow_batch_change) if ckpt.resuming else None
    if problem:  # the same checkpoint metadata on every rank: every rank raises
        raise ValueError(f"[train] resume={cfg.resume!r}: {problem}")
    guard = NonFiniteGuard(cfg.on_nonfinite, max_consecutive=cfg.nonfinite_max_consecutive,
                           max_total=cfg.nonfinite_max_total, rank=rank,
                           names=("[train] nonfinite_max_consecutive", "[train] nonfinite_max_total"))

    fpt = metrics.flops_per_token(model_config, cfg.seq_len, plan.activation_checkpointing, n_nonembedding)
    peak = metrics.peak_flops(dtype=plan.param_dtype, override=cfg.peak_tflops * 1e12 or None)
    global_tokens = pm.dp_size * cfg.local_batch * cfg.grad_accum * cfg.seq_len
    logger = RunLog(run, ckpt.resumed_extra, first_step, rank)  # a resumed run continues its TensorBoard run
    log_dir = logger.dir
    logger.text("config", f"plan: {plan}\n\ntrain: {cfg}\n\ndata: {run.data}\n\nmodel: {model_config.to_json_string()}")
    if rank == 0:
        print(f"meshkit: plan {plan.describe()} on {world} ranks | {n_nonembedding / 1e6:.2f}M non-embedding params | "
              f"{global_tokens:,} tokens/step | {fpt.model / 1e6:.2f} MFLOPs/token | "
              f"peak {peak / 1e12 if peak else float('nan'):.3g} TFLOP/s/device | TensorBoard: {log_dir}", flush=True)
        for note in data.notes:
            print(f"meshkit: {note}", flush=True)
    predicted = preflight.print_prediction(run.estimate_config(model_config), plan, world, cfg) if rank == 0 else None  # rank 0 logs
    if predicted is not None:
        logger.log(first_step, {"predicted_peak_gib": predicted / 2**30})

    # A bar only on a terminal: piped into a log (make demo), it would interleave with the step lines.
    bar = tqdm(total=cfg.steps, initial=first_step - 1, disable=rank != 0 or not sys.stderr.isatty(),
               dynamic_ncols=True, desc="train")
    prof = _profiler(cfg.profile, log_dir / "profile", cfg.steps)
    if prof is not None:
        prof.start()
    losses: list[float] = []
    times: list[float] = []
    waits: list[float] = []  # seconds each step waited for its data (prefetch stall)
    eval_losses: dict[int, float] = {}
    metrics.reset_peak_memory()
    for step in range(first_step, cfg.steps + 1):
        # Made before the clock starts: a real loader prefetches, and the step time should be the model's.
        wait_before = data.wait_s
        batches = data.step_batches(step)  # meshkit.data prefetches; wait_s counts what the step waited
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        denominator = sum(pm.count_valid_tokens(labels) for _, labels, _ in batches)
        # Each call returns its share of the window's loss (same denominator), so the shares add up;
        # CE and the MoE router auxiliary terms come back apart (`parts`) and are logged apart.
        calls = [pm.forward_backward(input_ids, labels, position_ids=position_ids, loss_denominator=denominator,
                                     parts=True)
                 for input_ids, labels, position_ids in batches]
        loss, ce, aux = (sum(terms) for terms in zip(*calls))
        grad_norm = pm.clip_grad_norm_(cfg.clip if cfg.clip > 0 else float("inf"))
        if guard.allows_step(step, float(loss), float(grad_norm)):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        pm.update_expert_biases()  # DeepSeek-V3 router balancing; a no-op without it
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        loss_value = float(loss)  # a host sync, so the timing below covers the whole step
        step_s = time.perf_counter() - start
        logger.remember(step, loss_value)  # before the save: the history a checkpoint keeps (loss.png)
        save_s = ckpt.after_step(step, optimizer, scheduler, last=step == cfg.steps,  # not in step_s
                                 extra=with_run_record({LOG_KEY: logger.extra()}, record), data=data.loader)
        if beat is not None:
            beat.progress(step)
        if prof is not None:
            prof.step()
        losses.append(loss_value)
        times.append(step_s)
        waits.append(data.wait_s - wait_before)
        tps = metrics.tokens_per_s_per_device(global_tokens, step_s, world)
        mem, mem_label = metrics.peak_memory()
        values = {
            "loss": loss_value, **({"ce": float(ce), "aux": float(aux)} if float(aux) else {}),
            "lr": lr, "grad_norm": float(grad_norm), "step_s": step_s,
            "tokens_per_s_per_device": tps, "mfu": metrics.mfu(fpt.model, tps, peak),
            "hfu": metrics.mfu(fpt.hardware, tps, peak) if fpt.recompute else None,
            f"{'max_alloc' if mem_label.startswith('cuda') else 'peak_rss'}_gib": mem / 2**30,
        }
        if save_s:
            values["checkpoint_s"] = save_s  # blocking part only: staging, under async_save
        if guard.skipped:
            values["skipped_steps"] = len(guard.skipped)
        logger.log(step, values)
        if cfg.eval_every and cfg.eval_batches and (step % cfg.eval_every == 0 or step == cfg.steps):
            eval_losses[step] = evaluate(pm, data, cfg.eval_batches)  # after the clock: not in step_s
            values["eval_loss"] = eval_losses[step]
            logger.log(step, {"loss": eval_losses[step], "perplexity": math.exp(min(eval_losses[step], 50))},
                       prefix="eval/")
        bar.update(1)
        bar.set_postfix(loss=f"{loss_value:.3f}")
        # A held-out loss is printed when it is computed, even between log_every lines.
        if rank == 0 and (step % cfg.log_every == 0 or step in (first_step, cfg.steps) or step in eval_losses):
            bar.write(metrics.format_step_line(step, cfg.steps, values))
    if prof is not None:
        prof.stop()
    bar.close()
    ckpt.close()
    sample = None
    if cfg.sample_tokens and hasattr(data, "prompt"):  # token-store data: a held-out prompt, continued
        sample = _print_sample(pm, data, cfg.sample_tokens, rank)
    if cfg.export_hf:
        if data.tokenizer is None and rank == 0:
            print(f"meshkit: {cfg.export_hf}: exported without a tokenizer (neither the data nor the model directory "
                  "holds one)", flush=True)
        pm.save_hf_checkpoint(cfg.export_hf, tokenizer=data.tokenizer, merge=run.peft.merge)  # LoRA: adapter
    logger.close()
    if not losses:  # resumed at or past the last step: nothing left to train
        if rank == 0:
            print(f"meshkit: nothing to train: resumed at step {first_step} of {cfg.steps}", flush=True)
        return {}
    steady = times[1:] or times
    summary = {"first_loss": losses[0], "last_loss": losses[-1], "median_step_s": statistics.median(steady),
               "total_s": sum(times), "eval_losses": eval_losses, "skipped_steps": list(guard.skipped),
               "run_id": ckpt.run_id, "data_wait_s": sum(waits), "sample": sample, "failed_saves": ckpt.failed_saves,
               "loss_history": dict(logger.losses)}  # the whole run's, resumed launches included (loss.png)
    if rank == 0:
        drop = summary["first_loss"] - summary["last_loss"]
        mem, mem_label = metrics.peak_memory()
        memory = f"peak memory {mem / 2**30:.3g} GiB ({mem_label})"
        last_eval = eval_losses[max(eval_losses)] if eval_losses else None
        held_out = f" | held-out loss {last_eval:.4f} (perplexity {math.exp(min(last_eval, 50)):.2f})" if eval_losses else ""
        if predicted and mem_label.startswith("cuda"):
            memory += f" vs predicted {predicted / 2**30:.3g} GiB (measured/predicted {mem / predicted:.3g})"
        elif predicted:  # RSS also holds the interpreter and libraries: no ratio to tensor bytes
            memory += f"; the estimator predicts {predicted / 2**30:.3g} GiB of tensors"
        plot = logger.plot(data.reference_loss)
        print(f"loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} over steps {first_step}-{cfg.steps} "
              f"({'down' if drop > 0 else 'UP'} {abs(drop):.4f}, {data.reference}){held_out} | median step "
              f"{summary['median_step_s']:.3f}s | data wait {100 * sum(waits) / max(sum(times), 1e-9):.2f}% of step time | "
              f"{memory} | {guard.summary() + ' | ' if guard.skipped else ''}"
              f"TensorBoard: tensorboard --logdir {cfg.log_dir} | loss curve: "
              f"{plot or 'not drawn (pip install matplotlib)'}", flush=True)
    return summary


def _warn_once() -> None:
    """Library warnings (torch, transformers) from rank 0 only: every rank would print the same ones."""
    if int(os.environ.get("RANK", "0")) != 0:
        warnings.simplefilter("ignore")
        hf_logging.set_verbosity_error()


def _print_sample(pm: meshkit.ParallelModel, data: Any, tokens: int, rank: int) -> list[int] | None:
    """Greedy continuation of a held-out prompt (collective), stopping where the model's generation
    config says (its eos, as HF's generate); skipped, with a note, for a store that holds no tokenizer
    or a prompt with no room left below max_position_embeddings (the same on every rank)."""
    try:
        prompt, tok = data.prompt()
    except ValueError as err:
        if rank == 0:
            print(f"meshkit: sample skipped ({err})", flush=True)
        return None
    room = min(tokens, pm.model.config.max_position_embeddings - prompt.shape[1])
    if room < 1:
        if rank == 0:
            print(f"meshkit: sample skipped (the prompt's {prompt.shape[1]} tokens fill max_position_embeddings)")
        return None
    sample = pm.generate(prompt, max_new_tokens=room, do_sample=False)
    if rank == 0:
        print(f"meshkit: sample (greedy) | {tok.decode(prompt[0])!r} -> {tok.decode(sample[0, prompt.shape[1]:])!r}",
              flush=True)
    return sample[0].tolist()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _warn_once()
    try:
        preflight.check_config_file(args.config)
        run = apply_cli(load_config(args.config), args)
        if args.check:  # one process, no process group: every problem listed, or the estimate
            return preflight.check_only(run, args.world or world_size_from_env())
        if args.dry_run:  # one process per simulated rank, fake tensors: no torchrun
            return dry_run.run(run, args.world, args.jobs)
        train(run)
    except ValueError as err:  # meshkit's PlanError included: a user error, not a crash
        # One write per rank, so eight ranks' messages do not interleave line by line.
        sys.stderr.write(f"[rank {_rank()}] error: {err}\n")
        sys.stderr.flush()
        return 2
    except CheckpointWriteError as err:  # disk full at a save (on_save_error = "stop"): every rank has it, one says it
        if _rank() == 0:
            sys.stderr.write(f"error: {err}\n")
        return EXIT_SAVE_FAILED
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
