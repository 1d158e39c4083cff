"""FSDP2 (ZeRO-3) and HSDP over the data and context ranks, with mixed precision.

Units are the embedding, each decoder block, `[norm, lm_head]`, then the root, so at most one block's
full parameters exist at a time beyond the one being prefetched; under ZeRO-1/2, which keep every unit
gathered anyway, consecutive small units share one (`units_in_buckets`). Context-parallel ranks fold
into the shard group (`dp_shard_cp`) because they hold the same weights. Gradients are summed, never
averaged: meshkit's loss already divides by the global count of valid tokens.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from meshkit import mesh as mesh_lib
from meshkit._compat.fsdp import fsdp_sum_gradients
from meshkit.activation_checkpoint import hide_hooks_from_selective_checkpoint
from meshkit.data_parallel.host_comms import route_through_shared_memory
from meshkit.data_parallel.offload import offload_policy
from meshkit.data_parallel.replicate import BUCKET_MB, apply_replicate
from meshkit.data_parallel.rules import replicates_with_ddp, shards_with_fsdp
from meshkit.local_tensor import local_tensor
from meshkit.plan import DTYPES, Plan


def apply_data_parallel(stages: dict[int, nn.Module], expert_layers: list[nn.Module], plan: Plan, mesh: DeviceMesh,
                        expert_mesh: DeviceMesh | None, *, tied: bool) -> bool:
    """FSDP2 (or HSDP) units over dp_shard x cp for this rank's stages and MoE experts, when the plan
    needs FSDP at all; returns whether it did. A plan that only replicates gets DDP's all-reduce
    instead (`data_parallel.replicate`). The ZeRO stage is not chosen here: it is how `zero_stages`
    drives these same units per `forward_backward` call."""
    if replicates_with_ddp(plan):
        apply_replicate(stages.values(), mesh)
        return False
    if not shards_with_fsdp(plan):
        return False
    apply_fsdp_to_stages(stages.values(), expert_layers, mesh_lib.fsdp_mesh(mesh), expert_mesh, tied=tied,
                         param_dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype,
                         reshard_after_forward=plan.fsdp_reshard,
                         offload_policy=offload_policy(plan.offload, mesh_lib.mesh_device(mesh)),
                         bucket_bytes=BUCKET_BYTES if buckets_units(plan) else 0)
    if plan.zero == 3:
        skip_embedding_regather(stages.values())
    return True


#: Under ZeRO-1/2 every unit stays gathered through the accumulation window, so a unit's size sets only
#: how the gathers and reduce-scatters are batched; consecutive units are grouped into one of up to this
#: many bytes of gathered parameters (DDP's bucket size). Each collective costs a fixed latency and, on
#: gloo, CPU per call: units of a small model cost more in calls than in bytes (`units_in_buckets`).
BUCKET_BYTES = int(BUCKET_MB * 2**20)


def buckets_units(plan: Plan) -> bool:
    """Whether the plan's FSDP units are grouped into buckets: ZeRO-1/2 without pipelining (a pipeline
    stage's units would group alike; not done, so that the estimator's units stay one per stage layout)
    and without `offload="nvme"`, whose store streams the optimizer state one unit at a time (its host
    memory is two units' state, `estimate.zero.largest_unit_state`)."""
    return plan.zero < 3 and plan.pp == 1 and plan.offload != "nvme"


def units_in_buckets(units: list[nn.Module | list[nn.Module]], param_bytes: int, limit: int) -> list[list[nn.Module]]:
    """`units` (in forward order) grouped into consecutive runs of at most `limit` bytes of gathered
    parameters (`param_bytes` each, TP-local), a unit already larger on its own; `limit` 0: as given.

    Measured on 2 gloo ranks (4 blocks of hidden 256, 12.6 MB of fp32 parameters): one unit instead of
    six cut forward+backward CPU 10-17%, ZeRO-1/2 from 1.10 / 1.17 of DeepSpeed's CPU time (whose
    buckets batch the same way) to 1.01 / 1.03 (`benchmarks/deepspeed_zero.py`). A unit in a group is
    reduced when the group's backward ends: at most one bucket's gradients wait for their reduce-scatter.
    """
    listed = [u if isinstance(u, list) else [u] for u in units]
    if limit <= 0:
        return listed
    sizes = [sum(local_tensor(p).numel() for m in unit for p in _own_parameters(m)) * param_bytes for unit in listed]
    return [[m for i in run for m in listed[i]] for run in bucket_runs(sizes, limit)]


def bucket_runs(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of `sizes` in consecutive runs of at most `limit` in total, greedily in order (a size
    already above it stands alone); `limit` 0: each alone. The one grouping rule the code's units
    (`units_in_buckets`) and the estimator's (`estimate.comm.fsdp_units`) follow."""
    runs: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if runs and limit > 0 and total + n <= limit:
            runs[-1].append(i)
            total += n
        else:
            runs.append([i])
            total = n
    return runs


def expert_shard_dim(local_shape: tuple[int, ...], shards: int) -> int:
    """The dim FSDP splits a rank's expert weights [E/ep, rows, cols] on, over `shards` ranks.

    Dim 0 (whole experts per rank) when it divides evenly. Otherwise torch.chunk would leave ranks
    empty and give others whole experts (E/ep = 1 over 8 ranks: one rank holds everything), so the
    first later dim that divides evenly is split instead, as FSDP2 requires of dims past 0. Only when
    none does are experts chunked unevenly on dim 0.
    """
    if local_shape[0] % shards == 0:
        return 0
    return next((d for d in range(1, len(local_shape)) if local_shape[d] % shards == 0), 0)


def expert_placement(shards: int):
    """FSDP2 `shard_placement_fn` for an experts unit (see `expert_shard_dim`)."""

    def placement(param: nn.Parameter) -> Shard:
        local = local_tensor(param)
        return Shard(expert_shard_dim(tuple(local.shape), shards))

    return placement


def apply_fsdp(
    units: list[nn.Module | list[nn.Module]],
    root: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: bool,
    shard_placement_fn=None,
    offload_policy: OffloadPolicy | None = None,
    kept: int = 1,
) -> list[nn.Module]:
    """`fully_shard` each unit then the root over `mesh` (1D FSDP or 2D HSDP); return the FSDP modules.

    The last `kept` units are never resharded after forward: backward needs them first (the last
    one at once, the one before as soon as the last one's backward starts, when FSDP's backward
    prefetch would gather it again anyway), so resharding them would only add all-gathers.
    `shard_placement_fn` picks a parameter's shard dim (FSDP2's default is 0). `offload_policy`
    places the shards in host memory (`meshkit.data_parallel.offload`).
    """
    # FSDP2 warns on every forward that a unit returned a view (TP's to_local makes one), because an
    # in-place op on it would skip the pre-backward hook. meshkit's stages never modify unit outputs
    # in place (HF blocks add residuals out of place), so the warning is noise, filtered by its text.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    placement = dict(shard_placement_fn=shard_placement_fn, offload_policy=offload_policy or OffloadPolicy())
    wrapped = []
    for i, unit in enumerate(units):
        last = i >= len(units) - kept
        module = fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and not last,
                             **placement)
        wrapped.append(module)
    wrapped.append(fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                               **placement))
    for module in wrapped:
        # A list unit shares one FSDP state among its modules; setting it on the first sets it for all.
        fsdp_sum_gradients(module[0] if isinstance(module, list) else module)
    route_through_shared_memory(wrapped, mesh)  # CPU ranks of one host: no loopback TCP
    return wrapped


def _own_parameters(module: nn.Module) -> list[nn.Parameter]:
    """`module`'s parameters but those of FSDP units inside it (an MoE block's experts), which a unit
    made of it does not gather."""
    inner = {id(p) for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule)
             for p in sub.parameters()}
    return [p for p in module.parameters() if id(p) not in inner]


def apply_fsdp_to_stages(
    stages: Iterable[nn.Module],
    expert_layers: Iterable[nn.Module],
    mesh: DeviceMesh,
    expert_mesh: DeviceMesh | None,
    *,
    tied: bool,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: bool,
    offload_policy: OffloadPolicy | None = None,
    bucket_bytes: int = 0,
) -> None:
    """FSDP units of meshkit's stages: each MoE layer's experts (over `expert_mesh`, the data ranks ep
    leaves), then per stage the embedding, each block, `[norm, lm_head]` and the stage as root; with
    `bucket_bytes` (ZeRO-1/2) consecutive ones grouped up to that size (`units_in_buckets`).

    A tied weight lives in both the embedding and the head and can belong to one unit only, so with
    tying (`tied`) both stay in the root unit. The last block of a stage ending in `[norm, lm_head]`
    stays gathered after forward like that unit: the head's backward is what comes next, and FSDP
    prefetches the block's all-gather at its start, so freeing it in between would save no peak
    memory and cost one all-gather per step (torchtitan keeps it too).
    """
    policy = dict(param_dtype=param_dtype, reduce_dtype=reduce_dtype, reshard_after_forward=reshard_after_forward,
                  offload_policy=offload_policy)
    for moe in expert_layers:
        apply_fsdp([], moe.experts, expert_mesh, shard_placement_fn=expert_placement(expert_mesh.shape[-1]),
                   **policy)
        hide_hooks_from_selective_checkpoint(moe.experts)  # a unit inside the (checkpointed) block
    for stage in stages:
        edges = [stage.embed] if stage.embed is not None and not tied else []
        tail = [[stage.norm, stage.lm_head]] if stage.lm_head is not None and not tied else []
        blocks = list(stage.layers.values())
        units = units_in_buckets(edges + blocks + tail, DTYPES[param_dtype].itemsize, bucket_bytes)
        apply_fsdp([u[0] if len(u) == 1 else u for u in units], stage, mesh, kept=2 if tail and blocks else 1,
                   **policy)


def skip_embedding_regather(stages: Iterable[nn.Module]) -> None:
    """Let each stage's embedding unit stay sharded through backward.

    An embedding's gradient is a scatter-add of the output gradient at the token ids: its backward
    never reads the weight. FSDP would still all-gather the unit again before its backward (it was
    resharded after forward), moving a whole vocab x hidden matrix (1 GB of bf16 at 128k x 4096) for
    nothing. The gradient still lands in the unsharded parameter's `.grad` and is reduce-scattered as
    usual. A tied embedding is not its own unit (the head reads the weight) and is left alone.
    """
    for stage in stages:
        embed = getattr(stage, "embed", None)
        if isinstance(embed, FSDPModule):
            embed.set_unshard_in_backward(False)


def reshard_fsdp(module: nn.Module) -> None:
    """Free every FSDP unit under `module` that is still gathered (after a forward without backward)."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
