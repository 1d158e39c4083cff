"""plan_search weighs the memory levers past host offload: the optimizer state on NVMe when the host cannot
hold it, activations on the host when the device cannot, float8 on devices with float8 tensor cores."""

from __future__ import annotations

import dataclasses

from meshkit.estimate.core import estimate
from meshkit.estimate.search import search
from meshkit.estimate.spec import DEVICES, GiB, Workload, load_config
from meshkit.plan import Plan

CONFIG = load_config("llama3.2-1b")  # 1.24B parameters: 20 GB of fp32 state and AdamW moments on one GPU


def test_a_host_too_small_for_the_state_gets_nvme_and_activation_offload():
    device = dataclasses.replace(DEVICES["h100"], memory_bytes=8 * GiB, host_memory_bytes=16 * GiB)
    result = search(CONFIG, 1, 4096, 8 * 4096, device, top=5)
    assert result.plans, result.rejected
    for cand in result.plans:  # offload="optimizer" would hold 20 GB of host memory: only NVMe fits the host
        assert cand.plan.offload == "nvme" and cand.plan.activation_offload, cand.describe()
        assert cand.estimate.host_bytes <= 0.9 * device.host_memory_bytes
        assert Plan.from_string(cand.plan.to_string()) == cand.plan  # pastes into --plan as printed
    plan = result.plans[0].plan
    host = dataclasses.replace(plan, offload="optimizer", offload_dir=None)
    assert estimate(CONFIG, host, 1, result.plans[0].workload, device).host_bytes > 0.9 * device.host_memory_bytes


def test_float8_plans_are_offered_only_where_the_device_has_float8():
    device = dataclasses.replace(DEVICES["h100"], memory_bytes=56 * GiB)
    with_float8 = search(CONFIG, 1, 16384, 4 * 16384, device, top=3)
    assert with_float8.plans[0].plan.float8 == "tensorwise"
    twin = dataclasses.replace(with_float8.plans[0].plan, float8="none")
    assert estimate(CONFIG, twin, 1, with_float8.plans[0].workload, device).step_time > with_float8.plans[0].estimate.step_time
    without = search(CONFIG, 1, 16384, 4 * 16384, dataclasses.replace(device, float8_flops=None), top=3)
    assert without.plans and all(c.plan.float8 == "none" for c in without.plans)


def test_activation_offload_moves_the_saved_activations_to_the_host():
    plan = Plan(activation_checkpointing="none", param_dtype="bfloat16")
    work = Workload(seq=16384, mbs=1)
    on_device = estimate(CONFIG, plan, 1, work)
    moved = estimate(CONFIG, dataclasses.replace(plan, activation_offload=True), 1, work)
    per_block = sum(on_device.memory.per_block.values())
    blocks = CONFIG.num_hidden_layers
    assert moved.activation_offload.host_bytes == blocks * per_block  # every block's saved tensors
    # the peak is the loss's backward, before any block is brought back: none stays (in a block's
    # backward two would: the one running and the one before it, coming back)
    assert moved.memory.moment == "loss"
    assert on_device.memory.activations - moved.memory.activations == blocks * per_block
    block = dataclasses.replace(moved.memory, moment="block")
    assert block.activations - moved.memory.activations == 2 * per_block
    assert moved.activation_offload.link_bytes == 2 * blocks * per_block  # out in forward, back in backward
