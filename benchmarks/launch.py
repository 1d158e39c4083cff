"""The one way a benchmark starts gloo ranks: the worker pool meshkit's tests use.

`meshkit.testing.WorkerPool` forks ranks from a server that has already imported torch and
transformers, joins them in one gloo world, runs a module-level function on every rank and returns
every rank's value (or every rank's traceback). A benchmark keeps one pool per world size for its
whole run, so a world starts once however many measurements it serves.

It also builds what several benchmarks compare on those ranks: the same seeded Llama for every
variant, meshkit's parallel model of it, and the hand-written FSDP2 layout meshkit is measured against.
"""

from __future__ import annotations

import atexit
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from meshkit.testing import Outcome, WorkerPool

# Imported once by the fork server for every rank (stable third-party modules only).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "transformers.models.llama.modeling_llama")
TIMEOUT_S = 3600.0

_POOLS: dict[int, WorkerPool] = {}


def pool(world: int) -> WorkerPool:
    """This process's pool of `world` gloo ranks, started on first use and closed at exit."""
    if world not in _POOLS:
        _POOLS[world] = WorkerPool(world, timeout=TIMEOUT_S, preload=PRELOAD)
    return _POOLS[world]


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, **kwargs: Any) -> list[Any]:
    """`fn(*args, **kwargs)` on each of `world` ranks; their return values by rank.

    Raises `meshkit.testing.RankFailure` with every failing rank's traceback if any rank raised.
    """
    return pool(world).run(_importable(fn), *args, **kwargs)


def run_ranks_raw(fn: Callable[..., Any], world: int, *args: Any, **kwargs: Any) -> list[Outcome]:
    """Like `run_ranks`, but every rank's `Outcome` whatever happened (for probes expected to fail)."""
    return pool(world).run_raw(_importable(fn), *args, **kwargs)


def _importable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as the ranks can import it: a benchmark started with `python -m benchmarks.x` defines its
    functions in `__main__`, which the ranks do not have; its importable twin is the same code."""
    if getattr(fn, "__module__", None) != "__main__":
        return fn
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None:
        raise RuntimeError(f"{fn.__qualname__} is defined in a script; run the benchmark as python -m benchmarks.<name>")
    return getattr(importlib.import_module(spec.name), fn.__qualname__)


def seeded_llama(config: dict[str, Any]) -> LlamaForCausalLM:
    """A Llama of `config`'s fields with the same weights on every rank and in every variant (seed 0),
    so the variants of one comparison differ only in how they parallelize it."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config))


def meshkit_model(config: dict[str, Any], plan: str) -> meshkit.ParallelModel:
    """meshkit's parallel model of `seeded_llama(config)` under `plan`, input checks off (their two tiny
    collectives per step are not what a throughput or byte comparison measures)."""
    pm = meshkit.parallelize(seeded_llama(config), meshkit.Plan.from_string(plan))
    pm.check_inputs = False
    return pm


def handwritten_fsdp(model: LlamaForCausalLM) -> tuple[LlamaForCausalLM, Any]:
    """(`model` sharded the way FSDP2's documentation writes it by hand over the whole world, its mesh):
    the peer meshkit's FSDP is compared with. Units: embedding, each block, [norm, lm_head] (never
    resharded: backward needs them first), and the root."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.model.embed_tokens, mesh=mesh)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard([model.model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh)
    return model, mesh


@atexit.register
def _close() -> None:
    for p in _POOLS.values():
        p.close()
