"""Checks that run before any training: a run that cannot finish must fail in its first seconds.

Everything a user can get wrong in a preset or on the command line is checked here, not found out
hours later at the first save or deep inside AdamW: a missing config file, a typo in `[model]`
(which HF would otherwise keep as a stray attribute and train with the default), `[train]`/`[data]`
values of the wrong type or range, a sequence length or batch the plan cannot split, and a save
directory that is not writable or too small for one checkpoint. The config checks are pure, so
every rank raises the same ValueError without communicating; the filesystem checks differ per rank
(each rank writes its own shards) and are agreed on with one all-reduce; rank 0 also takes the save
directory's lock, so a second run into the same directory is refused here, naming the first.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any

import checkpointing  # the recipe's own modules beside this one (the script's folder is on sys.path)
import data_setup
import dry_run
import save_lock
import torch.distributed as dist
from train_config import TrainConfig, build_model_config

import meshkit
from meshkit import estimate, metrics
from meshkit.models.moe import LLAMA_MOE_KEY, moe_spec
from meshkit.step.consensus import raise_if_any

# Ranges of the known [train] and [data] fields; fields other modules add are type-checked only.
AT_LEAST_1 = ("steps", "seq_len", "local_batch", "grad_accum", "log_every", "branching")
AT_LEAST_0 = ("eval_every", "eval_batches", "save_every", "keep_last", "load_step", "threads", "warmup_steps",
              "peak_tflops", "clip", "weight_decay", "heartbeat_s", "nonfinite_max_consecutive", "nonfinite_max_total")
POSITIVE = ("lr", "timeout_s")
FRACTION = ("beta1", "beta2")  # [0, 1)
RATIO = ("min_lr_ratio",)  # [0, 1]
CHOICES = {"on_nonfinite": ("error", "skip"), "on_save_error": ("stop", "continue")}
# Keys of [model] that are no HF config field yet mean something: the recipe's own, and meshkit's Llama-MoE
# switch (a `meshkit_moe` table swaps a Llama-family model's MLPs for meshkit MoE layers).
RECIPE_MODEL_KEYS = ("path", "pretrained", "model_type", LLAMA_MOE_KEY)


def check_config_file(path: str | None) -> None:
    """A named preset must exist (otherwise a raw FileNotFoundError traceback, on every rank)."""
    if path and not Path(path).is_file():
        raise ValueError(f"--config {path}: no such file; fix: the path of a TOML preset, e.g. "
                         "recipes/configs/debug_cpu.toml (or leave --config out for the built-in defaults)")


def field_problems(table: Any, where: str) -> list[str]:
    """Type and range problems of one config dataclass ([train], [data]), one line each."""
    found = []
    for f in dataclasses.fields(table):
        value = getattr(table, f.name)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        wrong = _type_problem(value, kind)
        if wrong:
            found.append(f"[{where}] {f.name}={value!r}: {wrong}")
            continue
        found.extend(f"[{where}] {f.name}={value!r}: {p}" for p in _range_problems(f.name, value))
    return found


def _type_problem(value: Any, kind: str) -> str | None:
    if kind == "bool":
        return None if isinstance(value, bool) else "must be true or false"
    if kind == "int":
        return None if isinstance(value, int) and not isinstance(value, bool) else "must be an integer"
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        return None if math.isfinite(value) else "must be a finite number"
    if kind == "str":
        return None if isinstance(value, str) else "must be a string"
    return None


def _range_problems(name: str, value: Any) -> list[str]:
    if name in AT_LEAST_1 and value < 1:
        return ["must be >= 1"]
    if name in AT_LEAST_0 and value < 0:
        return ["must be >= 0"]
    if name in POSITIVE and value <= 0:
        return ["must be > 0"]
    if name in FRACTION and not 0 <= value < 1:
        return ["must be in [0, 1)"]
    if name in RATIO and not 0 <= value <= 1:
        return ["must be in [0, 1]"]
    if name in CHOICES and value not in CHOICES[name]:
        return [f"must be one of {', '.join(CHOICES[name])}"]
    return []


def model_key_problems(table: dict[str, Any], config: Any) -> list[str]:
    """Keys of `[model]` that are no field of the model type's config.

    HF keeps an unknown keyword as a stray attribute, so `hiden_size = 64` trains silently with the
    default hidden size. A key counts as known when the config class declares it (its `__init__`,
    its defaults, its aliases) or consumed it (`rope_theta` becomes part of `rope_parameters`).
    """
    cls = type(config)
    default = cls()
    known = (set(default.to_dict()) | set(getattr(default, "attribute_map", {}))
             | set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"})
    stored = config.to_dict()
    found = []
    for key in table:
        if key in RECIPE_MODEL_KEYS or key in known or key not in stored:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        found.append(f"[model] {key}: not a field of {cls.__name__} ({config.model_type}); {hint}fix: a field "
                     f"of that config (see its documentation), or remove it")
    return found


def shape_problems(run: Any, model_config: Any, world: int) -> list[str]:
    """Sequence length and batch shape against the plan, before any process group exists."""
    cfg = run.train
    found = []
    limit = getattr(model_config, "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:  # the token-store loader refuses it too; synthetic data as well
        found.append(f"[train] seq_len={cfg.seq_len}: above the model's max_position_embeddings={limit} (positions "
                     f"past it extrapolate the rotary embedding silently); fix: --seq-len {limit} or less, or "
                     f"--model-set max_position_embeddings={cfg.seq_len}")
    try:
        plan = run.plan.validate(model_config, world_size=world, seq_len=cfg.seq_len)
    except meshkit.PlanError as err:  # one "[plan]" line per violation, not a list nested in the list
        return found + [f"[plan] {line.strip()[2:]}" for line in str(err).splitlines()[1:]]
    if found:
        return found
    if plan.pp > 1 and cfg.local_batch % plan.microbatches:
        return [f"[train] local_batch={cfg.local_batch}: the plan splits each batch into {plan.microbatches} "
                f"pipeline microbatches; fix: a local_batch divisible by {plan.microbatches}"]
    return []


def config_problems(run: Any, model_config: Any, world: int) -> list[str]:
    """Every config problem, one line each (pure: identical on every rank)."""
    found = field_problems(run.train, "train") + field_problems(run.data, "data")
    try:
        data_setup.check_data_config(run.data)
    except ValueError as err:
        found.append(str(err))
    found += model_key_problems(run.model, model_config)
    if not any(p.startswith(("[train] seq_len=", "[train] local_batch=")) for p in found):  # shapes need sane numbers
        found += shape_problems(run, model_config, world)
    return found


def check_config(run: Any, model_config: Any, world: int) -> None:
    """Every config problem at once, as one ValueError (pure: identical on every rank)."""
    found = config_problems(run, model_config, world)
    if found:
        raise ValueError("the configuration has problems:\n  - " + "\n  - ".join(found))


def checkpoint_bytes(model_config: Any) -> int | None:
    """The estimator's size of one checkpoint (fp32 parameters and AdamW's two moments), or None."""
    try:
        state = estimate.model_state(model_config, meshkit.Plan())
    except Exception:  # noqa: BLE001 - an estimator gap must not stop training; the check is skipped
        return None
    return state.param_bytes + state.optimizer_bytes


def save_dir_problem(save_dir: str, needed: int | None) -> str | None:
    """This rank's view of the save directory: creatable, writable (a probe file), room for a checkpoint."""
    directory = Path(save_dir)
    probe = directory / f".meshkit-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"meshkit")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as err:
        return (f"[train] save_dir={save_dir!r} is not writable ({err.strerror or err}); fix: a directory this "
                "user can write on a filesystem every rank sees")
    if needed is not None:
        free = shutil.disk_usage(directory).free
        if free < needed:
            return (f"[train] save_dir={save_dir!r}: {free / 2**30:.3g} GiB free, one checkpoint needs about "
                    f"{needed / 2**30:.3g} GiB (meshkit.estimate: fp32 parameters + AdamW moments); fix: free "
                    "space or another save_dir")
    return None


def check_filesystem(run: Any, model_config: Any, take_lock: bool = True) -> None:
    """Collective: the save directory works for every rank and no other run saves there (rank 0 takes
    its lock, `save_lock`), or every rank raises the same error. `release_save_dir` undoes it.
    `take_lock=False` (a dry check that will not train) only reports a live holder."""
    cfg = run.train
    problem = save_dir_problem(cfg.save_dir, checkpoint_bytes(model_config)) if cfg.save_every else None
    if problem is None and cfg.save_every and (not dist.is_initialized() or dist.get_rank() == 0):
        if not take_lock:
            problem = save_lock.holder_problem(cfg.save_dir)
        else:
            lock, note = save_lock.SaveDirLock.acquire(cfg.save_dir)
            if lock is None:
                problem = note
            elif note:
                print(f"meshkit: {note}", flush=True)
    raise_if_any(problem)


def release_save_dir(cfg: Any) -> None:
    """Give up this process's lock on the save directory (at the end of a run, however it ended)."""
    lock = save_lock.held(cfg.save_dir)
    if lock is not None:
        lock.release()


def predicted_peak_bytes(model_config: Any, plan: meshkit.Plan, world: int, cfg: TrainConfig) -> int | None:
    """meshkit.estimate's per-rank peak for this run, or None for a stack mixing dense and MoE blocks.

    Printed beside the measured peak so a user sees how far the estimator is from their hardware
    before trusting it for a plan they cannot try. The workload mirrors the loop: under pipelining the
    local batch is split into the plan's microbatches, and grad_accum pipeline calls make up a step.
    """
    spec = moe_spec(model_config)
    if spec is not None and len(spec.layers) != model_config.num_hidden_layers:
        return None
    plan = plan.resolve(world)
    device = "h200" if metrics.detect_device() == "h200" else "h100"  # memory does not depend on the device
    return estimate.estimate(model_config, plan, world, dry_run.workload(plan, cfg), device).peak_bytes


def print_prediction(model_config: Any, plan: meshkit.Plan, world: int, cfg: TrainConfig) -> int | None:
    """The prediction, or None with one printed line: an estimator failure must never stop training."""
    try:
        predicted = predicted_peak_bytes(model_config, plan, world, cfg)
    except Exception as err:  # noqa: BLE001 - any estimator bug is reported, not fatal
        print(f"meshkit: estimate: failed ({type(err).__name__}: {err}); training continues", flush=True)
        return None
    if predicted is None:
        print("meshkit: estimate: n/a for stacks mixing dense and MoE blocks", flush=True)
    else:
        print(f"meshkit: estimate: predicted peak {predicted / 2**30:.3g} GiB per rank (meshkit.estimate; "
              "tensors only, so on CPU the measured RSS adds the interpreter and libraries)", flush=True)
    return predicted


def check_only(run: Any, world: int) -> int:
    """`train_llama.py --check --world N`: every pre-flight check on this one process, then the estimate.

    A torchrun launch spends its first 20-30 s forming the process group and building the model
    before the first config error; this runs the same checks (config, plan for N ranks, data
    stores, save directory, the resume decision) without torchrun or a process group, lists every
    problem at once and exits 2, or prints the plan and the estimated peak memory and exits 0.
    """
    model_config, model_dir, _ = build_model_config(run.model)
    problems = config_problems(run, model_config, world)
    problems += data_setup.data_problems(run.data, run.train, model_config, model_dir)[1]
    if run.train.save_every:
        problems.append(save_dir_problem(run.train.save_dir, checkpoint_bytes(model_config)))
        problems.append(save_lock.holder_problem(run.train.save_dir))  # a live run saving there
    if run.train.resume or run.train.save_every:
        problems.append(checkpointing.decide(run.train).error)
    problems = [p for p in problems if p]
    if problems:
        sys.stderr.write(f"--check: {len(problems)} problem(s) for {world} rank(s):\n  - " + "\n  - ".join(problems)
                         + "\n")
        return 2
    plan = run.plan.resolve(world).resolve_cp(model_config)  # cp: the kind parallelize will choose, and why
    print(f"--check: ok for {world} rank(s): plan {plan.describe()}, config, data and save dir checked", flush=True)
    print_prediction(model_config, plan, world, run.train)
    return 0
