"""FSDP2 (ZeRO-3) and HSDP over the data and context ranks, with mixed precision.

Units are the embedding, each decoder block, `[norm, lm_head]`, then the root, so at most one block's
full parameters exist at a time beyond the one being prefetched. Context-parallel ranks fold into the
shard group (`dp_shard_cp`) because they hold the same weights. Gradients are summed, never averaged:
meshkit's loss already divides by the global count of valid tokens.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from meshkit._compat import fsdp_sum_gradients

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def needs_fsdp(dp_shard_cp: int, dp_replicate: int, param_dtype: str) -> bool:
    """FSDP is applied when weights are shared by several ranks, or to cast them (mixed precision)."""
    return dp_shard_cp * dp_replicate > 1 or param_dtype != "float32"


def apply_fsdp(
    units: list[nn.Module | list[nn.Module]],
    root: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: bool,
) -> list[nn.Module]:
    """`fully_shard` each unit then the root over `mesh` (1D FSDP or 2D HSDP); return the FSDP modules.

    The last unit is never resharded after forward: backward needs it first, so resharding would
    only add an all-gather.
    """
    # FSDP2 warns on every forward that a unit returned a view (TP's to_local makes one), because an
    # in-place op on it would skip the pre-backward hook. meshkit's stages never modify unit outputs
    # in place (HF blocks add residuals out of place), so the warning is noise, filtered by its text.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=DTYPES[reduce_dtype])
    wrapped = []
    for i, unit in enumerate(units):
        last = i == len(units) - 1
        module = fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and not last)
        wrapped.append(module)
    wrapped.append(fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward))
    for module in wrapped:
        # A list unit shares one FSDP state among its modules; setting it on the first sets it for all.
        fsdp_sum_gradients(module[0] if isinstance(module, list) else module)
    return wrapped
