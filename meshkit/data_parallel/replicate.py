"""Plain data parallelism for plans that only replicate: DDP's bucketed all-reduce on each stage.

When `dp_replicate` is the plan's only parallelism (`rules.replicates_with_ddp`), every rank holds the
whole model, gradients and optimizer state, so FSDP2 would shard nothing and still run its per-unit
hooks, copy-in/copy-out of every gradient and a DTensor optimizer step: 13% more CPU per step than
HF's Trainer on DDP before this path, 0.98x with it (benchmarks/results/trainer.md). Here torch's DDP
reducer (through its composable `replicate`, which keeps parameter names) all-reduces gradients in
25 MB buckets as backward produces
them, summing them (meshkit's loss carries the global denominator), with each gradient a view into
its bucket. The buckets exist from the first forward on, so the gradients' bytes are resident for
the whole run. After `zero_grad` (gradients set to None) each window starts with the gradients
pointed back at their zeroed bucket views, so backward accumulates in place: without that, a
window's calls before the reducing one would hold fresh gradients beside the buckets (two gradients'
bytes, as in the first window, before any bucket view exists).

Accumulation windows reduce once, at the window's last call, under either `Plan.grad_sync`: with
nothing sharded, reducing an earlier call would free no memory (FSDP's reason for `every_microbatch`)
and would cost its bytes again plus a copy (DDP reduces whole buckets, so gradients already reduced
must be set aside first). The sum is the same. Gradients a caller kept from an earlier window (no
`zero_grad` between) are such reduced ones: they are set aside, a copy, when the window opens and
added back once its reduction ran, so nothing is summed twice.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshkit._compat.replicate import is_replicated, replicate_summing, start_replicating

BUCKET_MB = 25.0  # DDP's default: few enough collectives, and backward overlaps all but the last


def apply_replicate(stages: Iterable[nn.Module], mesh: DeviceMesh) -> None:
    """Replicate each stage over the mesh's `dp_replicate` axis (the plan's only parallelism). The set-up
    (rank 0's weights broadcast, shapes checked) runs here when the weights exist, else at the first
    forward after `init_weights` or loading a meta-device model."""
    group = mesh["dp_replicate"].get_group()
    for stage in stages:
        replicate_summing(stage, group, BUCKET_MB)
        if not any(p.is_meta for p in stage.parameters()):
            start_replicating(stage)


@contextlib.contextmanager
def replicated_call(roots: list[nn.Module], sync: bool) -> Iterator[None]:
    """Around one forward and backward of replicated stages: when `sync` (the window's last call), reduce
    the gradients accumulated since the last reduction, and only those (see the module docstring)."""
    if not roots:
        yield
        return
    if not any(root in _SET_ASIDE for root in roots):  # a reduction period opens: what is there is reduced
        for root in roots:
            _SET_ASIDE[root] = _set_aside(root)
            _point_at_buckets(root)
    for root in roots:
        root.set_requires_gradient_sync(sync)
    closes = True
    try:
        yield
        closes = sync
    finally:
        for root in roots:
            root.set_requires_gradient_sync(True)
            if closes:
                for p, kept in _SET_ASIDE.pop(root, []):
                    if p.grad is None:
                        p.grad = kept
                    else:
                        p.grad.add_(kept)
                _BUCKET_VIEWS[root] = [(p, p.grad) for p in root.parameters() if p.grad is not None]


# replicated root -> (parameter, its gradient reduced before the open period), added back once the period's
# reduction ran. The parameter, not its gradient tensor: DDP rebuilds its buckets after the first step
# and may point `.grad` at a new bucket meanwhile.
_SET_ASIDE: weakref.WeakKeyDictionary[nn.Module, list[tuple[nn.Parameter, torch.Tensor]]] = \
    weakref.WeakKeyDictionary()


# replicated root -> (parameter, its gradient as the last reduction left it: a view into DDP's bucket)
_BUCKET_VIEWS: weakref.WeakKeyDictionary[nn.Module, list[tuple[nn.Parameter, torch.Tensor]]] = \
    weakref.WeakKeyDictionary()


def _point_at_buckets(root: nn.Module) -> None:
    """Give each parameter whose gradient was set to None (`zero_grad`) its bucket view back, zeroed, so
    backward accumulates in the bucket: no fresh gradient beside the buckets (a window's earlier calls
    would otherwise hold one until DDP copies it in), and no copy into the bucket at the reduction.
    The views are dropped here: if DDP rebuilds its buckets (once, in the next forward) it moves the
    gradients to the new ones, and nothing keeps the old alive."""
    for p, view in _BUCKET_VIEWS.pop(root, []):
        if p.grad is None:
            p.grad = view.zero_()


def _set_aside(root: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Copy and zero the gradients `root` holds (DDP reduces whole buckets: they must read zero)."""
    kept = []
    for p in root.parameters():
        if p.grad is not None:
            kept.append((p, p.grad.clone()))
            p.grad.zero_()
    return kept


def replicated_roots(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """The modules among `modules` that `apply_replicate` made data parallel."""
    return [m for m in modules if is_replicated(m)]
