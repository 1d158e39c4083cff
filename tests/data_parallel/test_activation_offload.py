"""Activation offload (`Plan(activation_offload=True)`) against the same plan without it, on 4 gloo ranks:
loss, every gradient and the parameters after two AdamW steps must be bit-identical (a host copy is
exact), every byte copied out must come back in backward and be released by the end of the step, and
the bytes copied out must be what the estimator says a rank saves (`tests/estimate` checks the
estimator's activation bytes against FakeTensor tracing; here it is the real run's copies).

The plans cover every activation-checkpointing mode, every CP kind, pipeline schedules (with and
without the B/W split), TP with SP on both TP paths (local shards and DTensor styles), EP and HSDP;
the README's memory matrix names them (tests/data_parallel/test_memory_matrix.py). torch.compile is
refused (it traces the saved-tensor hooks into its graphs).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import meshkit
from meshkit.activation_offload import OffloadedBlock
from meshkit.estimate.core import estimate
from meshkit.estimate.spec import Workload
from meshkit.testing.reference import ADAM_EPS, BatchSpec, ModelSpec

DENSE = ModelSpec(layers=4)
MOE = ModelSpec(layers=2, intermediate=16, experts=4, top_k=2)
# README memory-matrix column (or a name of its own) -> (plan, model); run with and without offload
OFFLOAD_PLANS = {
    "TP": ("tp=2,dp_shard=2,activation_checkpointing=selective", DENSE),
    "TP-styles": ("tp=2,pp=2,pp_schedule=zb_h1,pp_microbatches=2,activation_checkpointing=none", DENSE),
    "CP": ("cp=2,tp=2,cp_attention=zigzag,activation_checkpointing=none", DENSE),
    "CP-ring-full": ("cp=2,dp_shard=2,cp_attention=ring,activation_checkpointing=full", DENSE),
    "CP-ulysses": ("cp=2,dp_shard=2,cp_attention=ulysses,activation_checkpointing=selective", DENSE),
    "CP-allgather": ("cp=2,dp_shard=2,cp_attention=allgather,cp_keep_kv=false", DENSE),
    "CP-usp": ("cp=4,cp_attention=usp,cp_ulysses=2,activation_checkpointing=full", DENSE),
    "CP-keep-kv": ("cp=4,cp_attention=zigzag,cp_keep_kv=true", DENSE),
    "PP": ("pp=2,dp_shard=2,pp_schedule=1f1b,pp_microbatches=2,activation_checkpointing=full", DENSE),
    "PP-interleaved": ("pp=2,dp_shard=2,pp_schedule=interleaved_1f1b,pp_virtual_stages=2,pp_microbatches=2",
                       DENSE),
    "EP": ("dp_shard=4,ep=2,activation_checkpointing=none", MOE),
    "EP-selective": ("dp_shard=2,tp=2,ep=2,activation_checkpointing=selective", MOE),
    "HSDP": ("dp_replicate=2,dp_shard=2,zero=2,activation_checkpointing=full", DENSE),
    "bf16": ("dp_shard=4,param_dtype=bfloat16,activation_checkpointing=selective", DENSE),
}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(plan: str, spec: ModelSpec, steps: int) -> dict:
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    offloads = {id(m.offload): m.offload for part in pm.model_parts for m in part.modules()
                if isinstance(m, OffloadedBlock)}
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, eps=ADAM_EPS)
    batch = BatchSpec(batch=4, seq=max(8, pm.plan.seq_multiple()), ignore=0.3, documents=2)
    out = {"losses": [], "grads": {}, "out": [], "back": [], "left": [], "peak": []}
    for step in range(steps):
        ids, labels = batch.make(spec.vocab, step)
        pos = batch.positions(step)
        per = batch.batch // pm.dp_size
        mine = slice(pm.dp_rank * per, (pm.dp_rank + 1) * per)
        for offload in offloads.values():
            offload.reset_counts()
        out["losses"].append(pm.forward_backward(ids[mine], labels[mine], position_ids=pos[mine]).item())
        if step == 0:
            out["grads"] = {n: _full(p.grad) for n, p in pm.named_parameters() if p.grad is not None}
        out["out"].append(sum(o.offloaded_bytes for o in offloads.values()))
        out["back"].append(sum(o.restored_bytes for o in offloads.values()))
        out["left"].append(sum(o.host_bytes for o in offloads.values()))
        out["peak"].append(max((o.peak_host_bytes for o in offloads.values()), default=0))
        pm.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    out["state"] = pm.full_state_dict()
    out["wrapped"] = len(offloads)
    return out


def offloaded_vs_plain(plan: str, spec: ModelSpec, steps: int = 2) -> dict:
    """Both runs on this rank; the largest differences between them and the offloaded run's counters."""
    off = _train(plan + ",activation_offload=true", spec, steps)
    plain = _train(plan, spec, steps)
    assert off["grads"].keys() == plain["grads"].keys()
    return {
        "loss": max(abs(a - b) for a, b in zip(off["losses"], plain["losses"], strict=True)),
        "grad": max((off["grads"][n] - plain["grads"][n]).abs().max().item() for n in plain["grads"]),
        "param": max((off["state"][n] - plain["state"][n]).abs().max().item() for n in plain["state"]),
        "wrapped": off["wrapped"], "plain_wrapped": plain["wrapped"],
        "out": off["out"], "back": off["back"], "left": off["left"], "peak": off["peak"],
    }


@pytest.mark.parametrize("name", sorted(OFFLOAD_PLANS))
def test_activation_offload_is_exact_and_moves_every_saved_byte(dist, name):
    plan, spec = OFFLOAD_PLANS[name]
    results = dist(4).run(offloaded_vs_plain, plan, spec, timeout=600)
    for rank, r in enumerate(results):
        where = f"{plan}, rank {rank}"
        assert r["plain_wrapped"] == 0 and r["wrapped"] == 1, where
        assert r["loss"] == 0.0 and r["grad"] == 0.0 and r["param"] == 0.0, (
            f"{where}: offload changed loss by {r['loss']}, a gradient by {r['grad']}, a parameter by {r['param']}")
        assert all(b > 0 for b in r["out"]), f"{where}: nothing copied to the host: {r['out']}"
        assert r["back"] == r["out"], f"{where}: copied out {r['out']} but brought back {r['back']} bytes"
        assert r["left"] == [0, 0], f"{where}: host bytes still held after the step: {r['left']}"


def offloaded_in_one_step(plan: str, spec: ModelSpec, rows: int, seq: int) -> int:
    """Bytes this rank's blocks copy to the host in one forward_backward of `rows` x `seq` tokens."""
    pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    offload = next(m.offload for part in pm.model_parts for m in part.modules() if isinstance(m, OffloadedBlock))
    ids, labels = BatchSpec(batch=rows * pm.dp_size, seq=seq).make(spec.vocab)
    mine = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
    pm.forward_backward(ids[mine], labels[mine])
    return offload.offloaded_bytes


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_estimator_counts_the_bytes_activation_offload_moves(dist, ac):
    plan = f"tp=2,dp_shard=2,activation_checkpointing={ac},activation_offload=true"
    measured = dist(4).run(offloaded_in_one_step, plan, DENSE, 2, 16)
    e = estimate(DENSE.config(), meshkit.Plan.from_string(plan), 4, Workload(seq=16, mbs=2))
    predicted = e.activation_offload.link_bytes / 2  # one way
    for rank, got in enumerate(measured):
        assert abs(predicted - got) / got < 0.10, f"{plan}, rank {rank}: estimated {predicted:,.0f}, copied {got:,}"
    assert e.activation_offload.host_bytes == pytest.approx(predicted, rel=1e-9)  # one microbatch: all of it held
