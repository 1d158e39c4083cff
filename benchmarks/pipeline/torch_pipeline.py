"""Everything the pipeline benchmark takes from `torch.distributed.pipelining`, in one place.

The peer runs torch's public classes (`PipelineStage`, `ScheduleGPipe`, `Schedule1F1B`,
`ScheduleInterleaved1F1B`, `ScheduleInterleavedZeroBubble`, `ScheduleZBVZeroBubble`,
`ScheduleDualPipeV`) on the very modules meshkit runs (placed as each class places stages), with
static `input_args`/`output_args` so that torch skips its shape-inference pass. The one private
piece is `compute_order`: it reads the action list torch derived (`pipeline_order`, whose entries are
the private `_Action` named tuples) so the benchmark can replay torch's own order in meshkit's
simulator; if that layout changes, only that function breaks and the benchmark prints why.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshkit._compat.peers import torch_pipeline_order

#: meshkit schedule name -> (torch class name, stages per rank the class gets in this benchmark).
PEERS: dict[str, tuple[str, int]] = {
    "gpipe": ("ScheduleGPipe", 1),
    "1f1b": ("Schedule1F1B", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2),
    "zb_h1": ("ScheduleInterleavedZeroBubble", 1),  # one stage per rank: torch's ZB1P reduces to ZB-H1
    "zb_v": ("ScheduleZBVZeroBubble", 2),  # the V: stage r and 2p-1-r on rank r, as meshkit places them
    "dualpipe_v": ("ScheduleDualPipeV", 2),
}
#: meshkit schedules torch has no class for (the tables say so instead of a ratio).
NO_PEER = {"zb_h2": "torch has no ZB-H2 class", "dualpipe": "torch has no DualPipe class (only DualPipeV)",
           "zb_auto": "torch has no automatic zero-bubble schedule"}
_MULTI = {"ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
#: torch's action letters (2.6+ meaning) -> meshkit's: torch `I` is meshkit `B`, torch `B` is `BW`.
_KINDS = {"F": "F", "I": "B", "W": "W", "B": "BW"}


@dataclass
class TorchPipeline:
    """One torch schedule over this rank's stages, and which ends of the pipeline the rank holds."""

    schedule: Any
    has_first: bool
    has_last: bool

    def step(self, batch: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
        """One training step on the whole batch; torch chunks it into microbatches itself."""
        losses: list[torch.Tensor] = []
        args = (batch,) if self.has_first else ()
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        return losses


def build(
    class_name: str,
    modules: dict[int, nn.Module],
    num_stages: int,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    metas: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    group: dist.ProcessGroup | None = None,
) -> TorchPipeline:
    """Wrap `modules` (global stage index -> module) in `PipelineStage`s and build `class_name` over them.

    `metas(stage, num_stages)` gives example (input, output) tensors of one microbatch: passing both makes torch
    take the static path (no hidden forward/backward to infer shapes, which also clears `.grad`).
    """
    from torch.distributed import pipelining

    cls = getattr(pipelining, class_name)
    stages = []
    for index in sorted(modules):
        example_in, example_out = metas(index, num_stages)
        stages.append(pipelining.PipelineStage(modules[index], index, num_stages, torch.device("cpu"),
                                               input_args=(example_in,), output_args=(example_out,), group=group))
    if class_name in _MULTI:
        schedule = cls(stages, n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        (stage,) = stages
        schedule = cls(stage, n_microbatches=microbatches, loss_fn=loss_fn)
    return TorchPipeline(schedule, 0 in modules, num_stages - 1 in modules)


def compute_order(pipeline: TorchPipeline) -> list[list[tuple[str, int, int]]] | str:
    """torch's per-rank compute actions as meshkit (kind, stage, microbatch) triples.

    Reads `schedule.pipeline_order` (rank -> list of `_Action | None`) and each action's
    `computation_type.value`, `stage_index` and `microbatch_index`; an overlapped pair (DualPipeV's
    OVERLAP_F_B) contributes its `sub_actions` in order; drops idle slots and non-compute actions
    (REDUCE_GRAD, UNSHARD, ...). Returns the reason as a string where the layout differs.
    """
    order = torch_pipeline_order(pipeline.schedule)
    if order is None:
        return f"{type(pipeline.schedule).__name__} has no pipeline_order dict in torch {torch.__version__}"
    ranks: list[list[tuple[str, int, int]]] = []
    try:
        for rank in sorted(order):
            actions = []
            for entry in order[rank]:
                for action in getattr(entry, "sub_actions", None) or (entry,):
                    kind = getattr(getattr(action, "computation_type", None), "value", None)
                    if action is None or kind not in _KINDS:
                        continue
                    actions.append((_KINDS[kind], int(action.stage_index), int(action.microbatch_index)))
            ranks.append(actions)
    except (AttributeError, TypeError) as error:
        return f"pipeline_order entries changed layout: {error}"
    return ranks


def first_line(error: BaseException) -> str:
    """The exception's type and first message line: what the report prints instead of a ratio."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


__all__: Sequence[str] = ("NO_PEER", "PEERS", "TorchPipeline", "build", "compute_order", "first_line")
