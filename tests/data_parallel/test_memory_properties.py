"""Property tests: activation offload and NVMe offload drawn together with random layouts (pp, cp, tp,
dp_shard on 4 ranks), activation-checkpointing modes, CP kinds, ZeRO stages and models (dense, MoE,
tied), each against the single-device model after two optimizer steps (loss, every gradient, the
clipped norm, the parameters)."""

from __future__ import annotations

import dataclasses
import tempfile

from hypothesis import given
from hypothesis import strategies as st
from tests_support import assert_matches_reference, examples

import meshkit
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

STATE_DIR = tempfile.mkdtemp(prefix="meshkit-nvme-test-")  # one per session; each rank writes its own file


def _compare_on_rank(plan: str, model: ModelSpec, batch: BatchSpec):
    return dataclasses.asdict(compare_training(plan, model, batch))


@st.composite
def memory_plans(draw):
    """Degrees multiplying to 4 over pp, cp, tp and dp_shard, with activation offload and/or NVMe offload."""
    pp, cp, tp = draw(st.sampled_from([(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1), (1, 2, 2), (2, 1, 2), (2, 2, 1)]))
    dp_shard = 4 // (pp * cp * tp)
    moe = draw(st.booleans()) and pp == 1
    ep = draw(st.sampled_from([e for e in (1, 2) if (dp_shard * cp) % e == 0])) if moe else 1
    ac = draw(st.sampled_from(["none", "selective", "full"]))
    kind = draw(st.sampled_from(["ring", "zigzag", "ulysses", "allgather"])) if cp > 1 else "zigzag"
    moved, nvme = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    zero = draw(st.sampled_from([2, 3]))
    plan = (f"pp={pp},dp_shard={dp_shard},cp={cp},tp={tp},ep={ep},cp_attention={kind},activation_checkpointing={ac},"
            f"activation_offload={str(moved).lower()},zero={zero}" + (",pp_microbatches=2" if pp > 1 else "") +
            (f",offload=nvme,offload_dir={STATE_DIR}" if nvme else ""))
    model = ModelSpec(layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=16, vocab=64, tied=draw(st.booleans()),
                      experts=4 if moe else 0, top_k=2, seed=draw(st.integers(0, 99)))
    multiple = meshkit.Plan.from_string(plan).seq_multiple()
    batch = BatchSpec(batch=4, seq=max(8, multiple), ignore=0.3, seed=draw(st.integers(0, 99)),
                      documents=draw(st.sampled_from([1, 2])))
    return plan, model, batch


@examples(ci=3)
@given(memory_plans())
def test_random_plans_with_activation_and_nvme_offload_match_one_device(dist, case):
    plan, model, batch = case
    results = dist(4).run(_compare_on_rank, plan, model, batch, timeout=600)
    assert_matches_reference(results, f"{plan} on {model} with {batch}")
