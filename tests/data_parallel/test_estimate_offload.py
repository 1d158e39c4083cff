"""Host offload in the estimator and the plan search.

Ground truth for the host-link bytes: the copies FSDP2's offload path itself issues on a real 4-rank
CPU mesh, counted by intercepting `Tensor.to` where FSDP2 calls it (the parameter shard copied to the
device before each all-gather, the gradient shard copied back after each reduction). On this CPU
machine the copies are cpu -> cpu, but they are the same calls, with the same tensors, that move
over PCIe on a GPU. The search is checked on a model whose states cannot fit a small device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import pytest
import torch
from transformers import LlamaConfig

from meshkit import estimate as est
from meshkit.estimate import search as plan_search
from meshkit.estimate.offload import ADAMW_HOST_BYTES, offload_cost
from meshkit.estimate.report import render
from meshkit.plan import Plan
from tests.data_parallel.estimate_mesh import (
    BATCH,
    SEQ,
    after_one_step,
    coordinates,
    local_bytes,
    model_config,
)

CALLS = 2
RUNS = [
    "dp_shard=4,zero=3,offload=params",
    "tp=2,dp_shard=2,zero=2,offload=optimizer,grad_sync=last_microbatch,param_dtype=bfloat16",
    "dp_replicate=2,dp_shard=2,zero=3,offload=optimizer,grad_sync=every_microbatch",
]


@contextlib.contextmanager
def fsdp_copies():
    """Count the bytes FSDP2's offload path copies: `.to(device, non_blocking=...)` called from FSDP2's
    `all_gather_inputs` (host -> device) and `foreach_reduce` (device -> host)."""
    counts = {"all_gather_inputs": 0, "foreach_reduce": 0}
    original = torch.Tensor.to

    def counting(self, *args, **kwargs):
        caller = sys._getframe(1).f_code
        if "_fully_shard" in caller.co_filename and caller.co_name in counts and "non_blocking" in kwargs:
            counts[caller.co_name] += self.numel() * self.element_size()
        return original(self, *args, **kwargs)

    torch.Tensor.to = counting
    try:
        yield counts
    finally:
        torch.Tensor.to = original


def measure_copies(runs: list[str]) -> list[dict]:
    """Per plan, after a first step: the bytes copied each way over one window of CALLS calls, and the
    model state the rank keeps in host memory."""
    out = []
    for text in runs:
        pm, opt, ids = after_one_step(text)
        with fsdp_copies() as counts:
            for c in range(CALLS):
                pm.forward_backward(ids, ids, last_microbatch=c == CALLS - 1)
        params = list(pm.parameters())
        tensors = [*params, *(p.grad for p in params if p.grad is not None),
                   *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v))]
        on_cpu = all((t.to_local() if hasattr(t, "to_local") else t).device.type == "cpu" for t in tensors)
        out.append({"h2d": counts["all_gather_inputs"], "d2h": counts["foreach_reduce"], "host": local_bytes(tensors),
                    "on_cpu": on_cpu, **coordinates(pm)})
    return out


@pytest.fixture(scope="module")
def copies(dist) -> list[list[dict]]:
    return dist(4).run(measure_copies, RUNS)


@pytest.mark.parametrize("index", range(len(RUNS)), ids=RUNS)
def test_host_link_bytes_equal_fsdp2s_copies(copies, index):
    """H2D: a padded fp32 shard per all-gather (per call and again in backward under ZeRO-3, once per
    window under ZeRO-2); D2H: the fp32 gradient shard per reduction; host: every shard's state."""
    config, plan = model_config(), Plan.from_string(RUNS[index]).resolve(4)
    workload = est.Workload(seq=SEQ, mbs=BATCH, microbatches=CALLS)
    for rank, per_rank in enumerate(copies):
        r = per_rank[index]
        state = est.model_state(config, plan, tp_rank=r["tp_rank"], fsdp_rank=r["fsdp_rank"])
        cost = offload_cost(config, plan, workload, state, est.DEVICES["h100"])
        where = f"{RUNS[index]}, rank {rank}"
        assert r["h2d"] > 0 and r["d2h"] > 0, where
        assert (r["h2d"], r["d2h"]) == (cost.h2d_bytes, cost.d2h_bytes), where
        assert r["host"] == cost.host_bytes, where
        assert r["on_cpu"], where


def test_offload_adds_its_transfers_and_host_step_to_the_step_time():
    config = est.load_config("llama3-8b")
    workload = est.Workload(seq=4096, mbs=1, microbatches=4)
    plain = est.estimate(config, Plan(dp_shard=8, zero=2, param_dtype="bfloat16"), 8, workload)
    e = est.estimate(config, Plan(dp_shard=8, zero=2, param_dtype="bfloat16", offload="optimizer"), 8, workload)
    off, state = e.offload, e.memory.state
    assert plain.offload is None and plain.times["offload"] == 0
    assert off.host_step_bytes == ADAMW_HOST_BYTES * state.params
    assert off.d2h_bytes == 4 * state.params * workload.microbatches  # every_microbatch: a reduction per call
    assert off.host_bytes == state.param_bytes + state.grad_bytes + state.optimizer_bytes
    device = est.DEVICES["h100"]
    assert off.exposed == pytest.approx((off.h2d_bytes + off.d2h_bytes) / device.host_bw +
                                        off.host_step_bytes / device.host_memory_bw)
    assert e.times["step"] == pytest.approx(plain.times["step"] + off.exposed)
    assert e.peak_bytes == plain.peak_bytes - off.host_bytes
    text = render(e, check_flops=False)
    assert "host offload (optimizer)" in text and "optimizer step on the CPU" in text


# ---------------------------------------------------------------------------------------- the search

BIG_STATE = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=4, vocab_size=32000)  # ~117M parameters, short sequences


def _search(memory_mib: float, host_gib: float = 256):
    device = dataclasses.replace(est.DEVICES["h100"], memory_bytes=memory_mib * 2**20,
                                 host_memory_bytes=host_gib * est.GiB)
    return plan_search.search(BIG_STATE, 2, 256, 8 * 256, device, top=50), device


def test_search_offloads_when_nothing_else_fits_and_ranks_by_the_host_cost():
    result, device = _search(400)
    assert result.plans, plan_search.render(result, plan_search.budget(device), 2)
    assert all(c.plan.offload != "none" for c in result.plans), "an on-device plan fits 400 MiB: retune the test"
    limit = plan_search.budget(device)
    for c in result.plans:
        e = c.estimate
        assert e.peak_bytes <= limit < e.peak_bytes + e.offload.host_bytes  # it fits only because of offload
        assert e.times["offload"] > 0
    steps = [c.estimate.step_time for c in result.plans]
    assert steps == sorted(steps)
    assert "offload=" in plan_search.render(result, limit, 2)


def test_search_never_offloads_when_the_device_holds_everything():
    result, _ = _search(4096)
    assert result.plans and all(c.plan.offload == "none" for c in result.plans)


def test_search_says_when_offload_fits_the_device_but_not_the_host():
    result, _ = _search(400, host_gib=0.1)
    assert not result.plans
    assert any("GiB of host memory per GPU" in why for why in result.rejected.values()), result.rejected
