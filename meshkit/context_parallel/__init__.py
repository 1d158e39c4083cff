"""meshkit's own context-parallel attention: ring, zig-zag ring, Ulysses and their 2D hybrid (USP).

Op level only: each attention function takes this rank's sequence shard of q, k, v ([B, H, S_local, D], K/V with
their own GQA head count) and the process group(s) of the cp axis, and returns the local output
shard. `sharding` says which tokens a rank holds; `kernels` is the local (out, lse) op.
"""

from meshkit.context_parallel.allgather import allgather_attention, allgather_blocks
from meshkit.context_parallel.kernels import attention_block, reference_attention
from meshkit.context_parallel.ring import merge_, ring_attention, ring_schedule, score_elements
from meshkit.context_parallel.sharding import (
    check_seq_len,
    document_ids,
    position_ids,
    required_multiple,
    shard,
    shard_indices,
    shard_packed,
    unshard,
)
from meshkit.context_parallel.ulysses import kv_replication, ulysses_attention
from meshkit.context_parallel.usp import usp_attention, usp_group_ranks

__all__ = [
    "allgather_attention",
    "allgather_blocks",
    "attention_block",
    "check_seq_len",
    "document_ids",
    "kv_replication",
    "merge_",
    "position_ids",
    "reference_attention",
    "required_multiple",
    "ring_attention",
    "ring_schedule",
    "score_elements",
    "shard",
    "shard_indices",
    "shard_packed",
    "ulysses_attention",
    "unshard",
    "usp_attention",
    "usp_group_ranks",
]
