"""One training step measured on one rank, the same way in a fake world and in a real one.

The step is the recipes' (`recipes/train_llama.py`): `forward_backward` over the step's calls (one
per gradient-accumulation microbatch, or one pipeline call per `pp_microbatches`), `clip_grad_norm_`,
the optimizer's step. A first step runs unmeasured so that the optimizer state exists, as it does in
every step of a run but the first; the second is measured: the peak of live bytes with its split
(`memory.AllocationTracker`) and every collective by kind and axis (`CommCounter`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from meshkit._compat.fake import group_by_name, storage_resizes
from meshkit.comm_counter import CommCounter
from meshkit.dryrun.memory import AllocationTracker, Peak
from meshkit.mesh import AXES, DERIVED, axis, expert_axes, usp_axes
from meshkit.plan import Plan

#: The step's inputs: (input_ids, labels) per forward_backward call.
Batches = list[tuple[torch.Tensor, torch.Tensor]]


#: The names a collective's group is reported under, the first that is that group winning: FSDP's
#: axis first (as `CommCounter` does), then the estimator's other axes, the derived ones last.
AXIS_NAMES = ("dp_shard_cp", "tp", "cp", "pp", "pp_ends", "pp_mirror", "dp_replicate", "ep", "ep_fsdp", "dp_cp_tp",
              "pp_cp_tp", "dp", "dp_cp", "cp_ulysses", "cp_ring")
_ALIASES = {"cp_ulysses": "cp", "cp_ring": "cp"}  # USP's two parts: the estimator's cp rows


@dataclass
class Measured:
    """What one rank held and moved in the measured step."""

    peak: Peak
    events: list[tuple[str, str, int]] = field(default_factory=list)  # (kind, axis, bytes) in issue order
    axes: dict[str, list[int]] = field(default_factory=dict)  # axis name -> the ranks of this rank's group

    def collectives(self, smallest: int = 0) -> dict[str, dict[str, int]]:
        """Bytes per axis and kind (a send and its receive are one `p2p`), leaving out calls of fewer
        than `smallest` bytes."""
        out: dict[str, dict[str, int]] = {}
        for kind, axis_name, nbytes in self.events:
            if nbytes < smallest or kind == "recv":
                continue
            kind = "p2p" if kind == "send" else kind
            per_axis = out.setdefault(axis_name, {})
            per_axis[kind] = per_axis.get(kind, 0) + nbytes
        return out


def measure_step(pm, optimizer: torch.optim.Optimizer, batches: Batches, *, clip: float = 1.0) -> Measured:
    """Run two training steps on `pm` and measure the second (see the module docstring).

    `pm` is materialised already (fake or real weights); every rank of the world calls this alike.
    """
    tracker = AllocationTracker()
    tracker.adopt([*pm.parameters(), *(b for part in pm.model_parts for b in part.buffers())], "parameters")
    axes = axis_groups(pm.mesh, pm.plan)
    with storage_resizes(tracker.on_resize), tracker:
        _step(pm, optimizer, batches, clip, tracker)
        optimizer.zero_grad(set_to_none=True)
        counter = CommCounter(pm.mesh, axes=tuple(DERIVED))
        tracker.begin_window()
        with counter:
            _step(pm, optimizer, batches, clip, tracker)
        state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        host = ("parameters", "gradients", "optimizer") if pm.plan.offload != "none" else ()
        peak = tracker.end_window(parameters=list(pm.parameters()),
                                  gradients=[p.grad for p in pm.parameters() if p.grad is not None],
                                  optimizer_state=state, host=host)
        optimizer.zero_grad(set_to_none=True)
    return Measured(peak, _named(counter, pm.mesh, axes), axes)


def _step(pm, optimizer: torch.optim.Optimizer, batches: Batches, clip: float, tracker: AllocationTracker) -> None:
    tracker.phase = "step"
    for i, (input_ids, labels) in enumerate(batches):
        pm.forward_backward(input_ids, labels, last_microbatch=i == len(batches) - 1)
    pm.clip_grad_norm_(clip)
    tracker.phase = "optimizer"
    optimizer.step()
    tracker.phase = "step"


def axis_groups(mesh, plan: Plan) -> dict[str, list[int]]:
    """The ranks of this rank's group on every axis the estimator names (the expert axes and USP's two
    parts included), so that each measured group can be matched to the estimator's axis by its ranks.
    Collective where the expert or USP axes are new: every rank calls it."""
    out = {name: dist.get_process_group_ranks(axis(mesh, name).get_group())
           for name in (*AXES, "dp_shard_cp", "dp_cp_tp", "pp_cp_tp", "dp", "dp_cp")}
    pp = out["pp"]  # pp-ordered: a tied embedding's first and last stage, DualPipe's mirror pair
    mine = pp.index(dist.get_rank())
    out["pp_ends"], out["pp_mirror"] = [pp[0], pp[-1]], sorted({pp[mine], pp[-1 - mine]})
    if plan.ep > 1:
        ep, ep_fsdp = expert_axes(mesh, plan.ep)
        out["ep"], out["ep_fsdp"] = (dist.get_process_group_ranks(_group(m)) for m in (ep, ep_fsdp))
    if plan.cp > 1 and 1 < plan.ulysses_degree < plan.cp:
        uly, ring = usp_axes(mesh, plan.cp_ulysses)
        out["cp_ulysses"], out["cp_ring"] = (dist.get_process_group_ranks(_group(m)) for m in (uly, ring))
    return out


def axis_name(ranks: list[int], axes: dict[str, list[int]]) -> str | None:
    """The name a group of `ranks` is reported under (`AXIS_NAMES` order), or None for another group."""
    for name in AXIS_NAMES:
        if name in axes and sorted(axes[name]) == sorted(ranks):
            return _ALIASES.get(name, name)
    return None


def _named(counter: CommCounter, mesh, axes: dict[str, list[int]]) -> list[tuple[str, str, int]]:
    """CommCounter's events with each group named by its ranks: a pool worker that ran other plans can
    hand a later mesh the process groups DTensor cached for an earlier one over the same ranks."""
    names: dict[str, str] = {}
    for _, label, _ in counter.events:
        if label not in names:
            names[label] = axis_name(_label_ranks(label, mesh), axes) or label
    return [(kind, names[label], nbytes) for kind, label, nbytes in counter.events]


def _label_ranks(label: str, mesh) -> list[int]:
    if label == "world":
        return list(range(dist.get_world_size()))
    if label.startswith("group:"):
        return dist.get_process_group_ranks(group_by_name(label[len("group:"):]))
    return dist.get_process_group_ranks(axis(mesh, label).get_group())


def _group(mesh_or_group):
    return mesh_or_group.get_group() if hasattr(mesh_or_group, "get_group") else mesh_or_group
