"""torch.distributed.checkpoint's experimental and protocol-level entry points.

Private or version-gated torch APIs (see `meshkit._compat`).
"""

from __future__ import annotations

import torch.distributed.checkpoint as dcp


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
