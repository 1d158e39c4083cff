"""gpt-oss's attention sinks through whole models under the plans that move heads or merge blocks,
against the single-device HF model (loss, every gradient, the sinks' included, parameters after two
AdamW steps); and the refusal of the CP kinds whose merge has no sink term, before the mesh.

- tp=4 with one K/V head (MQA): every rank holds one query head, its sink, and a replicated K/V head;
- tp=2 x zig-zag cp=2 with a window as long as the sequence (so only the sinks change the ring's
  math): each rank's sinks are its query heads', added once to the ring's merged denominator.
"""

from __future__ import annotations

import dataclasses

import pytest
from tests_support import assert_matches_reference

import meshkit
from meshkit import mesh as mesh_lib
from meshkit.testing.families import FAMILY_FIELDS, family_spec
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

BATCH = BatchSpec(batch=4, seq=8)


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec):
    return dataclasses.asdict(compare_training(plan, model, batch))


def _window(length: int) -> tuple:
    return tuple((k, length if k == "sliding_window" else v) for k, v in FAMILY_FIELDS["gpt_oss"])


@pytest.mark.parametrize("plan, model", [
    ("tp=4", family_spec("gpt_oss", kv_heads=1)),
    ("tp=2,cp=2,cp_attention=zigzag", family_spec("gpt_oss", extra=_window(BATCH.seq))),
], ids=["tp4-mqa", "tp2-zigzag2"])
def test_sinks_under_tp_and_ring(dist, plan, model):
    results = dist(4).run(_compare_on_rank, plan, model, BATCH)
    assert_matches_reference(results, f"gpt_oss under {plan}")


def _refusal_before_mesh(plan: str) -> str:
    """The message parallelize raises for `plan`, with `init_mesh` made to fail loudly."""
    built = mesh_lib.init_mesh

    def no_mesh(*args, **kwargs):
        raise RuntimeError("the mesh was built before the model was checked")

    mesh_lib.init_mesh = no_mesh
    try:
        meshkit.parallelize(family_spec("gpt_oss", extra=_window(BATCH.seq)).build(device="meta"),
                            meshkit.Plan.from_string(plan))
    except ValueError as err:
        return str(err)
    finally:
        mesh_lib.init_mesh = built
    return "no error"


@pytest.mark.parametrize("kind", ["allgather", "usp"])
def test_cp_kinds_without_a_sink_term_refuse_before_the_mesh(dist, kind):
    plan = f"cp=4,cp_attention={kind}" + (",cp_ulysses=2" if kind == "usp" else "")
    for rank, message in enumerate(dist(4).run(_refusal_before_mesh, plan)):
        assert "sinks" in message and "fix: cp_attention='ulysses'" in message, f"rank {rank}: {message}"
