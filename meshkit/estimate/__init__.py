"""What a plan costs before any GPU is touched: memory per rank, FLOPs, bytes per axis, step time.

`spec` (presets, devices, workloads: the shared types) -> `trace` (recording what a forward saves)
-> `activations` (the real HF block under FakeTensor) and `moe` (meshkit's MoE layer) -> `memory`
(one rank's peak, dense and MoE composed) and `comm` (every collective per axis) -> `core`
(`estimate`) -> `report` -> `search` (the plan search) and `__main__` (the CLI).
See docs/estimate.md.
"""

from meshkit.estimate.comm import Collective, communication
from meshkit.estimate.core import Estimate, PipelineTiming, estimate, flop_counter_check, pipeline_timing
from meshkit.estimate.memory import block_activations, model_state
from meshkit.estimate.peak import RankMemory
from meshkit.estimate.spec import DEVICES, MODEL_PRESETS, Device, GiB, ModelState, Workload, load_config

__all__ = [
    "DEVICES",
    "MODEL_PRESETS",
    "Collective",
    "Device",
    "Estimate",
    "GiB",
    "ModelState",
    "PipelineTiming",
    "RankMemory",
    "Workload",
    "block_activations",
    "communication",
    "estimate",
    "flop_counter_check",
    "load_config",
    "model_state",
    "pipeline_timing",
]
