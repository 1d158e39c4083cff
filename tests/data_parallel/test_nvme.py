"""NVMe offload (`Plan(offload="nvme", offload_dir=DIR)`): exact against `offload="optimizer"` (loss and
every parameter after two optimizer steps of two-call windows, bit for bit, and both against the
single-device model), the state really written to and read back from the files, host memory holding
at most two units' state at once, checkpoints that save it and resume it under another plan, and the
directories it refuses (missing, not a directory, unwritable, too small) on every rank.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import meshkit
from meshkit.data_parallel.nvme import STATE_BYTES_PER_PARAM, NVMeStore, dir_problem
from meshkit.estimate.core import estimate
from meshkit.estimate.spec import Workload
from meshkit.local_tensor import local_tensor
from meshkit.testing.reference import ModelSpec
from tests.data_parallel.windows import assert_windows_match, train_windows
from tests.state.test_checkpoint import (
    DENSE,
    SAVED_STEPS,
    TOL,
    _max_diff,
    _resume_and_step,
    _train_save_continue,
)

MOE = ModelSpec(experts=4)
NVME_PLANS = {  # name -> (plan without the offload fields, world, model)
    "fsdp": ("dp_shard=2", 2, DENSE),
    "bf16": ("dp_shard=2,param_dtype=bfloat16", 2, DENSE),
    "tp-zero2-window": ("tp=2,dp_shard=2,zero=2,grad_sync=last_microbatch", 4, DENSE),
    "pp": ("pp=2,dp_shard=2", 4, DENSE),
    "ep": ("dp_shard=4,ep=2", 4, MOE),
}


def _stores(pm) -> list[NVMeStore]:
    return list({id(s): s for part in pm.model_parts if (s := getattr(part, "_meshkit_nvme_store", None))}.values())


def nvme_vs_host(plan: str, spec: ModelSpec, offload_dir: str) -> dict:
    """The window comparison under offload="nvme" and under offload="optimizer", the two runs' final
    states' difference, and what the NVMe run's store saw (run on every rank)."""
    seen = {}
    real_step = NVMeStore.step

    def step_and_look(store, optimizer):
        real_step(store, optimizer)
        state = {id(p): [local_tensor(t) for t in dict.get(optimizer.state, p, {}).values() if t.numel() > 1]
                 for unit in store.units for p in unit}  # dict.get: reading optimizer.state would page it in
        state_bytes = [sum(t.numel() * t.element_size() for p in unit for t in state[id(p)]) for unit in store.units]
        seen.update(units=len(store.units), largest=max(state_bytes), file=os.path.getsize(store.path),
                    evicted=all(t.untyped_storage().nbytes() == 0 for ts in state.values() for t in ts),
                    read=store.bytes_read, written=store.bytes_written, peak=store.peak_resident_bytes,
                    shard_bytes=sum(local_tensor(p).numel() * 4 for unit in store.units for p in unit))

    NVMeStore.step = step_and_look
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "offloading saves nothing here": no accelerator
            nvme = train_windows(f"{plan},offload=nvme,offload_dir={offload_dir}", spec, keep=True)
            host = train_windows(f"{plan},offload=optimizer", spec, keep=True)
    finally:
        NVMeStore.step = real_step
    a, b = nvme.pop("state"), host.pop("state")
    return {"nvme": nvme, "host": host, "seen": seen,
            "loss": max(abs(x - y) for x, y in zip(nvme["losses"], host["losses"], strict=True)),
            "param": max((a[k] - b[k]).abs().max().item() for k in a)}


@pytest.mark.parametrize("name", sorted(NVME_PLANS))
def test_nvme_equals_host_offload_and_streams_the_state(dist, tmp_path, name):
    plan, world, spec = NVME_PLANS[name]
    results = dist(world).run(nvme_vs_host, plan, spec, str(tmp_path))
    assert_windows_match([r["nvme"] for r in results], plan + ",offload=nvme")
    assert_windows_match([r["host"] for r in results], plan + ",offload=optimizer")
    for rank, r in enumerate(results):
        where, seen = f"{plan}, rank {rank}", r["seen"]
        assert r["loss"] == 0.0 and r["param"] == 0.0, f"{where}: nvme differs from optimizer offload: {r}"
        assert seen["units"] > 1 and seen["evicted"], f"{where}: state left in memory between steps: {seen}"
        # AdamW: two fp32 moments per shard element, written at both steps and read back at the second
        assert seen["written"] == 2 * 2 * seen["shard_bytes"], seen
        assert seen["read"] == 2 * seen["shard_bytes"], seen
        assert seen["file"] >= STATE_BYTES_PER_PARAM * seen["shard_bytes"] // 4, seen
        assert 0 < seen["peak"] <= 2 * seen["largest"], f"{where}: more than two units' state held at once: {seen}"
    if "pp=" not in plan and not spec.experts:  # the estimator's file on rank 0 (the largest shards; a Llama-MoE spec is dense to the estimator)
        nvme = meshkit.Plan.from_string(f"{plan},offload=nvme,offload_dir={tmp_path}")
        cost = estimate(spec.config(), nvme, world, Workload(seq=8, mbs=4 // nvme.dp, microbatches=2)).offload
        assert cost.disk_state_bytes == results[0]["seen"]["written"] // 2, (cost, results[0]["seen"])
        assert cost.disk_bytes == results[0]["seen"]["written"]  # read and written once per step


def test_checkpoint_saves_nvme_state_and_resumes_under_other_plans(dist, tmp_path):
    state_dir = tmp_path / "nvme"
    state_dir.mkdir()
    ckpt = str(tmp_path / "ckpt")
    nvme = f"dp_shard=2,offload=nvme,offload_dir={state_dir}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = dist(2).run(_train_save_continue, nvme, DENSE, ckpt)
        same = dist(2).run(_resume_and_step, nvme, DENSE, ckpt)
    other = dist(4).run(_resume_and_step, "tp=2,dp_shard=2", DENSE, ckpt)
    for name in before[0]["state"]:
        assert torch.equal(same[0]["state"][name], before[0]["state"][name]), f"{name}: same-plan resume differs"
    for rank, result in enumerate(other):
        assert result["info"]["step"] == SAVED_STEPS
        assert abs(result["loss"] - before[0]["loss"]) <= TOL, f"rank {rank}: {result['loss']} vs {before[0]['loss']}"
    assert _max_diff(other[0]["state"], before[0]["state"]) <= TOL


def _parallelize(plan: str) -> None:
    meshkit.parallelize(DENSE.build(), meshkit.Plan.from_string(plan))


@pytest.mark.parametrize("where, message", [
    ("missing", "does not exist"), ("a-file", "is not a directory"), ("/proc", "cannot write there")])
def test_unusable_offload_dir_raises_on_every_rank(dist, tmp_path, where, message):
    path = {"missing": str(tmp_path / "nope"), "a-file": str(tmp_path / "file"), "/proc": "/proc"}[where]
    (tmp_path / "file").write_text("x")
    outcomes = dist(2).run_raw(_parallelize, f"dp_shard=2,offload=nvme,offload_dir={path}")
    for o in outcomes:
        assert o.exc_type in ("ValueError", "PlanError") and f"offload_dir={path!r}" in o.message, o.message
        assert message in o.message and "fix:" in o.message, o.message


def test_a_disk_too_small_for_the_state_is_refused(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    problem = dir_problem(str(tmp_path), need_bytes=free + 1)
    assert problem is not None and f"offload_dir={str(tmp_path)!r}" in problem and "free" in problem
    with pytest.raises(ValueError, match="cannot reserve .* fix:"):  # what posix_fallocate reports on a full disk
        NVMeStore([], str(tmp_path / "state.bin"), reserve_bytes=1 << 60)


def test_nvme_needs_a_directory_and_the_directory_needs_nvme():
    with pytest.raises(ValueError, match="offload_dir="):
        meshkit.Plan(offload="nvme")
    with pytest.raises(ValueError, match="only offload='nvme' writes files there"):
        meshkit.Plan(offload="optimizer", offload_dir="/tmp")
