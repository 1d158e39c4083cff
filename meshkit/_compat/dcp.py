"""torch.distributed.checkpoint's experimental and protocol-level entry points.

Private or version-gated torch APIs (see `meshkit._compat`).
"""

from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset


def dtensor_chunks(tensor):
    """The (offsets, sizes) chunks of the global tensor this rank's DTensor shard covers.

    `DTensor.__create_chunk_list__` is the protocol DCP itself uses; it handles every placement,
    _StridedShard (FSDP over TP) included, which a hand-written offset computation would not.
    """
    return tensor.__create_chunk_list__()


def dcp_async_save(state, checkpoint_id: str, planner, group):
    """`torch.distributed.checkpoint.async_save` (marked experimental) as a plain Future of the upload.

    torch returns a Future, or an `AsyncSaveResponse` whose `upload_completion` is that Future when
    its stager stages asynchronously; callers only wait for the files.
    """
    result = dcp.async_save(state, checkpoint_id=checkpoint_id, planner=planner, process_group=group)
    return getattr(result, "upload_completion", result)


def chunk_at(global_shape, mesh_shape, coordinate, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sizes, offsets) of the shard a DTensor of `placements` holds at `coordinate` of a mesh of
    `mesh_shape`: DCP's own computation for the current rank, asked about any rank (a dry run plans
    every rank's checkpoint items from one rank's placements)."""
    return _compute_local_shape_and_global_offset(global_shape, tuple(mesh_shape), list(coordinate), placements)


def file_storage_info(relative_path: str, offset: int, length: int):
    """The entry `FileSystemWriter` records in a checkpoint's metadata for one written item."""
    return _StorageInfo(relative_path=relative_path, offset=offset, length=length)
