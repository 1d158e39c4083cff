"""The mesh's derived views come without torch's deprecation warnings: slicing a flattened axis from
the root mesh warns since torch 2.11, and a user's console showed it for every rank of an ep > 1 run
(the expert axes split dp_shard_cp). meshkit slices such axes only through `_compat.submesh`."""

from __future__ import annotations

import warnings

import meshkit
from meshkit import mesh as mesh_lib


def _views_warnings(plan: str) -> list[str]:
    plan = meshkit.Plan.from_string(plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = meshkit.init_mesh(plan)
        inner, outer = mesh_lib.expert_axes(mesh, plan.ep)
        mesh_lib.expert_fsdp_mesh(mesh, outer)
        mesh_lib.fsdp_mesh(mesh)
        sizes = [mesh_lib.axis_size(mesh, name) for name in ("dp", "dp_shard_cp", "dp_cp", "pp_cp_tp")]
    assert sizes == [plan.dp, plan.dp_shard * plan.cp, plan.dp * plan.cp, plan.pp * plan.cp * plan.tp], sizes
    return [str(w.message) for w in caught]


def test_expert_and_fsdp_views_do_not_warn(dist):
    for messages in dist(4).run(_views_warnings, "dp_replicate=2,dp_shard=2,ep=2"):
        assert not [m for m in messages if "flattened" in m], messages
