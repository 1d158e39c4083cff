"""Training checkpoints that move between plans: `torch.distributed.checkpoint` keyed by HF names.

Why not `torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)`: under pipelining
the HF model holds meta tensors for other ranks' layers, and the module paths of meshkit's stage
wrappers (checkpointed blocks, compiled blocks, stage modules) depend on the plan. The one name that
survives every plan is the HF parameter name, so every item is keyed by it:

- `model.<hf name>`: each parameter this rank holds (`pm.named_parameters()`) and each persistent
  buffer its model parts own (DeepSeek-V3's `expert_bias`), as the DTensor itself. DCP records its
  global shape and this rank's chunk, so a load under any other plan and world size reads exactly the
  chunks the new layout needs (resharding). Plain tensors are saved as replicated.
- `optim.state.<hf name>.<key>`: the optimizer state of that parameter (AdamW: `exp_avg`,
  `exp_avg_sq`, DTensors placed like their parameter, and the scalar `step`).
- `optim.param_groups` (hyperparameters, the current `lr` included), `scheduler`, `meshkit` (step,
  `extra`, the data loader's state, plan, world size, format version): pickled objects written once,
  by rank 0. A `meshkit.data.PackedLoader`'s state is the same on every rank and independent of the
  plan (its position is a global sample index), so one copy resumes any dp size.
- `rng.rank<r>`: every rank's torch CPU (and CUDA) generator state, written by that rank.

Saving is atomic (`atomic`: a hidden temporary directory renamed once complete) and every checkpoint
carries a manifest with a checksum per file (`manifest`); `latest` resumes from the newest one that
verifies (`retention`).

A load validates the checkpoint's metadata against the model on every rank before the first
collective, so a wrong checkpoint raises the same ValueError everywhere instead of hanging in DCP.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from meshkit.data_parallel.fused import FusedOptimizer
from meshkit.local_tensor import local_tensor
from meshkit.state import atomic, manifest, retention
from meshkit.state.manifest import step_dir
from meshkit.state.names import held_buffers, is_meshkit_only, persistent_tensors
from meshkit.step.consensus import brief, raise_if_any

if TYPE_CHECKING:
    from meshkit.parallel_model import ParallelModel

__all__ = ["FORMAT_VERSION", "is_checkpoint", "latest", "load", "save", "step_dir", "verify"]

FORMAT_VERSION = 1
# What `save` and `load` take as the optimizer: a torch optimizer, or the per-parameter optimizers of
# `meshkit.fuse_optimizer_into_backward` (which reads like one where it matters here).
Optimizer = torch.optim.Optimizer | FusedOptimizer
MODEL = "model."
OPTIM_STATE = "optim.state."
OPTIM_GROUPS = "optim.param_groups"
SCHEDULER = "scheduler"
META = "meshkit"
RNG = "rng.rank"
_IMPLEMENTATION_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def save(path: str | os.PathLike, pm: ParallelModel, optimizer: Optimizer, *,
         scheduler: Any = None, step: int = 0, extra: Any = None, run_id: str | None = None,
         global_batch: int | None = None, data: Any = None, adapter_only: bool = False) -> str:
    """Write a checkpoint of model, optimizer, scheduler, step, `extra` and RNG states to directory `path`.

    Collective: every rank calls it. Atomic: the files go to a hidden temporary directory that is
    renamed to `path` only after every rank's shards, DCP's metadata and the manifest (run id, step,
    plan, `global_batch`, a checksum per file) are on disk, so `path` never holds half a checkpoint.
    Refused (ValueError on every rank, nothing written) when `path` already holds files, or when any
    parameter or optimizer state is non-finite. A write that fails on any rank (disk full) raises
    `atomic.CheckpointWriteError` on every rank, its temporary directory removed. `extra` (e.g. a data-loader position) is any
    picklable object saved once, from rank 0, like `step`. `data`: a loader with `state_dict()` (a
    `meshkit.data.PackedLoader`), whose state is rank-independent by design and saved once too;
    `load(..., data=loader)` restores it. `adapter_only`: only the parameters that train (a LoRA model's
    adapters; meshkit's balancing buffers too), not the frozen base, which a resume loads from its own
    files first (`pm.load_hf_checkpoint(base_dir)`). Returns `path`.
    """
    state = state_dict(pm, optimizer, scheduler=scheduler, step=step, extra=extra, run_id=run_id, data=data,
                       adapter_only=adapter_only)
    final, partial = atomic.begin(path)
    problem = None
    try:
        dcp.save(state, checkpoint_id=partial, planner=save_planner())
    except (Exception, dcp.CheckpointException) as err:  # noqa: BLE001 - disk full, I/O: one error everywhere
        problem = atomic.describe_failure(err, partial)
    atomic.abandon_if_failed(partial, final, problem)
    atomic.publish_everywhere(partial, final, record(pm, step, run_id, global_batch))
    return final


def state_dict(pm: ParallelModel, optimizer: Optimizer, *, scheduler: Any = None, step: int = 0,
               extra: Any = None, run_id: str | None = None, data: Any = None,
               adapter_only: bool = False, check_finite: bool = True) -> dict[str, Any]:
    """What `save` hands DCP, keyed by HF names; refused when any tensor in it is non-finite.

    The finiteness check is collective (one all-reduce): a NaN on one rank's shard must stop every
    rank's save, or the others would wait in DCP for it. `check_finite=False` skips it, for tensors
    without values (a dry run planning a checkpoint on fake tensors, `meshkit.dryrun`).
    """
    state: dict[str, Any] = {MODEL + name: t.detach() for name, t in _model_tensors(pm) if _kept(name, t, adapter_only)}
    for name, param in _optimizer_params(pm, optimizer):
        for key, value in optimizer.state.get(param, {}).items():
            state[f"{OPTIM_STATE}{name}.{key}"] = value.detach() if isinstance(value, torch.Tensor) else value
    if check_finite:
        raise_if_any(_non_finite(state, step))
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:  # identical on every rank; one copy, so DCP never has to pick between ranks
        state[OPTIM_GROUPS] = [{k: v for k, v in g.items() if k != "params"} for g in _hyper_groups(optimizer)]
        if scheduler is not None:
            state[SCHEDULER] = scheduler.state_dict()
        state[META] = {"format": FORMAT_VERSION, "step": int(step), "extra": extra,
                       "data": None if data is None else data.state_dict(), "plan": pm.plan.to_dict(),
                       "world_size": _world_size(), "torch": torch.__version__, "run_id": run_id,
                       "adapter_only": adapter_only}
    state[f"{RNG}{rank}"] = _rng_state()
    return state


def record(pm: ParallelModel, step: int, run_id: str | None, global_batch: int | None) -> dict[str, Any]:
    """The manifest's description of a checkpoint (beside the per-file checksums)."""
    return {"run_id": run_id, "step": int(step), "plan": pm.plan.to_dict(), "world_size": _world_size(),
            "global_batch": global_batch, "torch": torch.__version__}


def _non_finite(state: dict[str, Any], step: int) -> str | None:
    bad = []
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            local = local_tensor(value)
            if local.numel() and not bool(torch.isfinite(local).all()):
                bad.append(key)
    if not bad:
        return None
    return (f"step {step}: non-finite values in {len(bad)} tensor(s) ({brief(bad)}); the checkpoint was not "
            "written, so the last one saved stays the newest")


@torch.no_grad()
def load(path: str | os.PathLike, pm: ParallelModel, optimizer: Optimizer, *, scheduler: Any = None,
         data: Any = None) -> dict[str, Any]:
    """Restore a checkpoint written by `save` under any plan and world size; return its step and `extra`.

    Call on every rank after `parallelize` (a meta-device model is materialised here) and after the
    optimizer and scheduler are constructed as for a fresh run. Returns `{"step", "extra",
    "rng_restored"}`. RNG states are restored only when the world size and the plan equal the saved
    ones (a rank's generator means nothing to a different layout). `data`: a loader saved with
    `save(..., data=)`, repositioned at the saved point (its `state_problems` are checked with the
    rest). Raises ValueError on every rank, before any collective, when the checkpoint does not fit the
    model, the optimizer or the loader.
    """
    metadata = _read_metadata(path)
    damaged = manifest.problems(path, checksums=False)  # sizes only: every rank reads its own bytes next
    if damaged:
        raise ValueError(f"checkpoint {path} is incomplete or damaged: {brief(damaged)}; fix: resume from an "
                         "older checkpoint (meshkit.state.checkpoint.latest skips damaged ones)")
    entries = metadata.state_dict_metadata
    # The small pickled items first, each rank on its own (no_dist: no collective yet).
    small: dict[str, Any] = {k: None for k in (META, OPTIM_GROUPS, SCHEDULER) if k in entries}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist on purpose
        dcp.load(small, checkpoint_id=path, planner=_load_planner(), no_dist=True)
    info = small.get(META)
    if not isinstance(info, dict) or info.get("format") != FORMAT_VERSION:
        found = info.get("format") if isinstance(info, dict) else "none (not written by meshkit.state.checkpoint.save)"
        raise ValueError(f"checkpoint {path}: format {found}; this meshkit reads format {FORMAT_VERSION}")
    problems = _model_problems(pm, entries, bool(info.get("adapter_only")))
    groups = small.get(OPTIM_GROUPS)
    if groups is not None and len(groups) != len(_hyper_groups(optimizer)):
        problems.append(f"the checkpoint's optimizer has {len(groups)} parameter group(s), this optimizer "
                        f"{len(_hyper_groups(optimizer))}; fix: build the optimizer as the saving run did")
    if scheduler is not None and SCHEDULER not in small:
        problems.append("a scheduler was passed but the checkpoint holds no scheduler state; fix: scheduler=None")
    if data is not None:
        if info.get("data") is None:
            problems.append("a data loader was passed but the checkpoint holds no loader state; fix: data=None")
        else:
            problems.extend(data.state_problems(info["data"]))
    _raise(path, problems)

    pm.materialise()
    state: dict[str, Any] = {MODEL + name: t.detach() for name, t in _model_tensors(pm) if MODEL + name in entries}
    state.update(_optimizer_targets(path, pm, optimizer, entries))
    same_layout = info["world_size"] == _world_size() and info["plan"] == pm.plan.to_dict()
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_key = f"{RNG}{rank}"
    if same_layout and rng_key in entries:
        state[rng_key] = None
    dcp.load(state, checkpoint_id=path, planner=_load_planner())

    params = dict(_optimizer_params(pm, optimizer))
    for key, value in state.items():
        if key.startswith(OPTIM_STATE) and not isinstance(value, torch.Tensor):
            name, sub = key[len(OPTIM_STATE):].rsplit(".", 1)
            optimizer.state[params[name]][sub] = value  # non-tensor state entries come back as objects
    if groups is not None:
        # A fused optimizer's per-parameter optimizers share the one saved group (see _hyper_groups).
        pairs = [(g, groups[0]) for g in optimizer.param_groups] if isinstance(optimizer, FusedOptimizer) \
            else zip(optimizer.param_groups, groups)
        for group, saved in pairs:
            # Hyperparameters (lr as the scheduler left it, betas, ...); not how this run implements the step.
            group.update({k: v for k, v in saved.items() if k not in _IMPLEMENTATION_FLAGS})
    if scheduler is not None:
        scheduler.load_state_dict(small[SCHEDULER])
    if rng_key in state:
        _set_rng_state(state[rng_key])
    if data is not None:
        data.load_state_dict(info["data"])
    return {"step": info["step"], "extra": info["extra"], "rng_restored": rng_key in state}


# ------------------------------------------------------------------------------------------ model


def _model_tensors(pm: ParallelModel) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's parameters and persistent buffers under their HF names (tied weights once)."""
    yield from pm.named_parameters()
    yield from held_buffers(pm.model, pm.model_parts)


def _kept(name: str, tensor: torch.Tensor, adapter_only: bool) -> bool:
    """Whether an adapter-only checkpoint holds this tensor: what trains, and meshkit's balancing state."""
    return not adapter_only or tensor.requires_grad or is_meshkit_only(name)


def _model_problems(pm: ParallelModel, entries: dict[str, Any], adapter_only: bool = False) -> list[str]:
    # Every rank computes the same table of global shapes and reaches the same verdict, no communication.
    expected = {n: tuple(t.shape) for n, t in persistent_tensors(pm.model).items()
                if n not in pm.tied_aliases and _kept(n, t, adapter_only)}
    if adapter_only and any(p.is_meta for p in pm.parameters() if not p.requires_grad):
        return ["an adapter-only checkpoint holds no frozen (base) weights, and this model's are still on the meta "
                "device; fix: pm.load_hf_checkpoint(base_dir) (or init_weights) before loading it"]
    saved = {k[len(MODEL):]: v for k, v in entries.items() if k.startswith(MODEL)}
    # meshkit's balancing buffers may be absent from a checkpoint of a model trained without them.
    missing = sorted(n for n in set(expected) - set(saved) if not is_meshkit_only(n))
    unexpected = sorted(set(saved) - set(expected))
    problems = []
    if missing:
        problems.append(f"{len(missing)} model tensor(s) missing from the checkpoint: {brief(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} checkpoint tensor(s) the model does not have: {brief(unexpected)}")
    wrong = [f"{n}: checkpoint {_shape(saved[n])}, model {expected[n]}" for n in sorted(set(saved) & set(expected))
             if _shape(saved[n]) != expected[n]]
    if wrong:
        problems.append(f"{len(wrong)} shape mismatch(es): {brief(wrong)}")
    # Optimizer state shaped unlike its (matching) parameter: a checkpoint written by something else.
    odd = []
    for key, entry in entries.items():
        if key.startswith(OPTIM_STATE) and isinstance(entry, TensorStorageMetadata) and len(entry.size) > 0:
            name = key[len(OPTIM_STATE):].rsplit(".", 1)[0]
            if name in expected and _shape(saved.get(name)) == expected[name] and tuple(entry.size) != expected[name]:
                odd.append(f"{key}: {tuple(entry.size)}, parameter {expected[name]}")
    if odd:
        problems.append(f"{len(odd)} optimizer state(s) shaped unlike their parameter: {brief(sorted(odd))}")
    if problems:
        problems.append("fix: load a checkpoint saved from a model with this config")
    return problems


# -------------------------------------------------------------------------------------- optimizer


def _hyper_groups(optimizer: Optimizer) -> list[dict[str, Any]]:
    """The parameter groups whose hyperparameters a checkpoint keeps. A fused optimizer's per-parameter
    optimizers come from one factory and so share their hyperparameters: one group is kept, which is
    also what makes its checkpoint load under a plan that places a different number of parameters
    on a rank (pipelining) or into an unfused optimizer, and back."""
    return optimizer.param_groups[:1] if isinstance(optimizer, FusedOptimizer) else optimizer.param_groups


def _optimizer_params(pm: ParallelModel, optimizer: Optimizer) -> Iterator[tuple[str, nn.Parameter]]:
    """(HF name, parameter) for every parameter the optimizer holds; each must be one of pm's."""
    names = {id(p): n for n, p in pm.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not one of "
                                 "this ParallelModel's; fix: build it from pm.parameters()")
            yield names[id(param)], param


def _optimizer_targets(path: str, pm: ParallelModel, optimizer: Optimizer,
                       entries: dict[str, Any]) -> dict[str, Any]:
    """Fresh optimizer state placed like the NEW plan's parameters, for DCP to fill in place.

    The state is created by the optimizer itself (one step with zero gradients and lr 0, which leaves
    every parameter bit-identical), so whatever it keeps (amsgrad, fused or capturable step tensors)
    has the dtype, device and placement this optimizer expects.
    """
    params = list(_optimizer_params(pm, optimizer))
    saved: dict[str, set[str]] = {}
    for key in entries:
        if key.startswith(OPTIM_STATE):
            name, sub = key[len(OPTIM_STATE):].rsplit(".", 1)
            saved.setdefault(name, set()).add(sub)
    fresh = [p for name, p in params if name in saved and not optimizer.state.get(p)]
    if fresh:
        _create_state(optimizer, fresh)
    targets: dict[str, Any] = {}
    problems = []
    for name, param in params:
        have = set(optimizer.state.get(param, {})) if name in saved else set()
        want = saved.get(name, set())
        if have != want:
            problems.append(f"{name}: checkpoint optimizer state {sorted(want)}, this optimizer {sorted(have)}")
            continue
        for sub in sorted(want):
            value = optimizer.state[param][sub]
            key = f"{OPTIM_STATE}{name}.{sub}"
            if isinstance(entries[key], TensorStorageMetadata) != isinstance(value, torch.Tensor):
                problems.append(f"{name}: optimizer state {sub} is a tensor in only one of checkpoint and optimizer")
                continue
            targets[key] = value.detach() if isinstance(value, torch.Tensor) else None
    if problems:
        # Local but identical on every rank of one optimizer type; the message says which state differs.
        problems.append("fix: build the optimizer with the class and options of the saving run")
    _raise(path, problems)
    return targets


def _create_state(optimizer: Optimizer, params: list[nn.Parameter]) -> None:
    """Let the optimizer create its state for `params` without changing any parameter."""
    every = [p for g in optimizer.param_groups for p in g["params"]]
    stashed = {id(p): p.grad for p in every}
    chosen = {id(p) for p in params}
    lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for p in every:
            p.grad = torch.zeros_like(p) if id(p) in chosen else None
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * 0 if isinstance(g["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p in every:
            p.grad = stashed[id(p)]


# ---------------------------------------------------------------------------------------- helpers


def save_planner() -> DefaultSavePlanner:
    """The DCP planner every meshkit save uses (also the async path), so all saves share one layout.

    flatten_state_dict=False: the non-tensor objects (metadata, scheduler, RNG, loader state) are
    stored whole, one pickled item each, rather than flattened into one DCP key per dict entry.
    """
    return DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _load_planner() -> DefaultLoadPlanner:
    # flatten_sharded_tensors=False as well: otherwise the planner works on a copy of the state dict and
    # loaded pickled objects never reach ours (torch 2.13).
    return DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _read_metadata(path: str) -> Metadata:
    try:
        return FileSystemReader(path).read_metadata()
    except (FileNotFoundError, NotADirectoryError, OSError) as err:
        raise ValueError(f"no meshkit checkpoint at {path!r} ({err}); fix: a directory written by "
                         "meshkit.state.checkpoint.save") from err


def _rng_state() -> dict[str, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def _set_rng_state(state: dict[str, torch.Tensor | None]) -> None:
    torch.set_rng_state(state["cpu"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _shape(entry: Any) -> tuple[int, ...] | str:
    return tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else "a non-tensor object"


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _raise(path: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"checkpoint {path} does not fit:\n  - " + "\n  - ".join(problems))


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` holds a complete meshkit checkpoint: manifest, metadata and every file of the
    recorded size (checksums are left to `verify`, which reads every byte)."""
    return not manifest.problems(path, checksums=False)


def verify(path: str | os.PathLike) -> list[str]:
    """Everything wrong with the checkpoint at `path` (empty: it loads as written); reads every file."""
    return manifest.problems(path)


def latest(root: str | os.PathLike) -> str | None:
    """The newest checkpoint under `root` that verifies (a `step-<n>` subdirectory), `root` itself if
    it is one, or None. Each newer checkpoint skipped is named in a warning with what was wrong, so
    a run killed mid-save or a damaged file resumes from the previous checkpoint."""
    found = retention.resolve(root)
    for line in found.warnings():
        warnings.warn(line, stacklevel=2)
    return found.path
