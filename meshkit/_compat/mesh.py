"""DeviceMesh internals: flattened and split axes, concatenated meshes.

Private or version-gated torch APIs (see `meshkit._compat`).
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """Flatten a (sub)mesh into one named axis that later `root_mesh[name]` lookups resolve.

    `DeviceMesh._flatten` is private in 2.11-2.13 but is the only way to derive a flattened group that
    stays attached to the root mesh (so `mesh["dp_replicate", "dp_shard_cp"]` keeps working).
    """
    return mesh._flatten(name)


def submesh(mesh: DeviceMesh, names: str | tuple[str, ...]) -> DeviceMesh:
    """`mesh[names]`, where names may include axes created by `flatten_mesh`.

    Slicing a flattened axis from the root warns of deprecation since 2.11 yet works through 2.13 and
    is the only way to get the 2D HSDP mesh (dp_replicate, dp_shard_cp) without new process groups.
    """

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[names]


def split_axis(mesh: DeviceMesh, axis: str, sizes: tuple[int, int], names: tuple[str, str]):
    """Split one axis of the root mesh into (outer, inner) parts; return (inner, outer) as 1D meshes or groups.

    `DeviceMesh._unflatten` (2.10+) derives them from the mesh. Without it, the same groups are built
    with `new_subgroups_by_enumeration`, enumerating every copy of the axis across the whole mesh, since
    every rank must take part in creating every group.
    """

    sub = submesh(mesh, axis)  # dp_shard_cp is a flattened axis: sliced without torch's deprecation warning
    if hasattr(sub, "_unflatten"):
        split = sub._unflatten(0, sizes, names)
        return split[names[1]], split[names[0]]
    outer, inner = sizes
    dim = mesh.mesh_dim_names.index(axis)
    copies = mesh.mesh.movedim(dim, -1).reshape(-1, outer * inner).tolist()
    inner_groups = [ranks[o * inner:(o + 1) * inner] for ranks in copies for o in range(outer)]
    outer_groups = [ranks[i::inner] for ranks in copies for i in range(inner)]
    mine_inner, _ = dist.new_subgroups_by_enumeration(inner_groups)
    mine_outer, _ = dist.new_subgroups_by_enumeration(outer_groups)
    return mine_inner, mine_outer


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose axes are those of `meshes` (all derived from the same root), e.g. the HSDP mesh
    (dp_replicate, dp_shard_mod_ep) that FSDP shards expert weights over; `DeviceMesh._concatenate`."""
    return DeviceMesh._concatenate(meshes)
