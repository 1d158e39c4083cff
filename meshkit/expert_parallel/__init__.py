"""Expert parallelism: the `MoE` layer, its all-to-all token dispatch and grouped-GEMM experts.

`MoE` is the layer (`moe.py`; `replay.py`: the routing its recompute replays; `expert_variants`:
expert layouts, biases and the clamped SwiGLU some families use); `apply_expert_parallel`
(`placement.py`) shards its experts over an expert-parallel group; over a model's layers
(`layers.py`), `update_expert_biases` runs DeepSeek-V3's bias step, and `aux_loss_value`,
`pop_router_stats` and `hf_load_balancing_loss` expose the balancing losses (`balancing.py`).
See docs/expert_parallel.md.
"""

from meshkit.expert_parallel.balancing import (
    RouterStats,
    hf_load_balancing_loss,
    router_z_loss,
    switch_aux_loss,
)
from meshkit.expert_parallel.expert_variants import ClampedSwiGLU, ExpertLayout
from meshkit.expert_parallel.grouped_gemm import GroupedExperts, SwiGLU, from_hf_layout, to_hf_layout
from meshkit.expert_parallel.layers import aux_loss_value, moe_layers, pop_router_stats, update_expert_biases
from meshkit.expert_parallel.moe import MoE
from meshkit.expert_parallel.placement import apply_expert_parallel, expert_split_problem

__all__ = [
    "ClampedSwiGLU",
    "ExpertLayout",
    "GroupedExperts",
    "MoE",
    "RouterStats",
    "SwiGLU",
    "apply_expert_parallel",
    "aux_loss_value",
    "expert_split_problem",
    "from_hf_layout",
    "hf_load_balancing_loss",
    "moe_layers",
    "pop_router_stats",
    "router_z_loss",
    "switch_aux_loss",
    "to_hf_layout",
    "update_expert_biases",
]
