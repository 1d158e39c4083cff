"""The estimator knows LoRA (`integrations.peft.model.with_lora`): against a real PEFT model parallelized
on a 4-rank CPU mesh, the model state is exact (every weight held and sharded, gradients and AdamW
state for the adapters only), the saved activations (the adapters' own, and what a frozen weight no
longer saves) within 10% of the live storages at the loss, and every tp / FSDP / HSDP collective
byte for byte; the plan search then ranks LoRA plans on those numbers."""

from __future__ import annotations

import re

import pytest
import torch
from peft import LoraConfig, get_peft_model

import meshkit
from meshkit import estimate as est
from meshkit.estimate import search as plan_search
from meshkit.integrations.peft.model import with_lora
from meshkit.plan import DTYPES, Plan
from meshkit.transport import shared_memory
from tests.estimate.test_estimate import (
    MESH_MODEL,
    _config,
    _keys,
    _LiveStorages,
    _measure_single,
    _mesh_workload,
)

R, TARGETS = 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PLANS = {
    "tp_sp_fsdp": "tp=2,dp_shard=2",
    "tp_sp_selective": "tp=2,dp_shard=2,activation_checkpointing=selective",
    "hsdp_no_sp_bf16": "tp=2,dp_replicate=2,sequence_parallel=false,param_dtype=bfloat16",
    "pp_fsdp": "pp=2,dp_shard=2,pp_microbatches=2",
}
BATCH, SEQ = 2, 16


def _lora_model(config):
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    return get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=R, target_modules=TARGETS))


def _measure_on_rank(plan_text: str) -> dict:
    from meshkit.step import loss as loss_lib
    from tests.estimate.rank_comm import counted_step

    config = _config(MESH_MODEL)
    plan = Plan.from_string(plan_text)
    model = _lora_model(config)
    pm = meshkit.parallelize(model, plan)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(pm.dp_rank))
    measured: dict = {}
    original, mode = loss_lib.summed_cross_entropy, _LiveStorages()

    def snapshot(logits, targets):
        loss = original(logits, targets)
        channels = _keys(shared_memory.mapped_buffers())  # the TP channel's slots: not activations
        measured["activations"] = mode.live_bytes(_keys(model.parameters()) | _keys([logits]) | channels)
        return loss

    loss_lib.summed_cross_entropy = snapshot
    try:
        with mode:
            measured.update(counted_step(pm, plan, ids))
    finally:
        loss_lib.summed_cross_entropy = original
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-3)
    opt.step()

    def local(tensors):
        return sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
                   for t in tensors if t is not None)

    measured.update(params=local(pm.parameters()), grads=local(p.grad for p in pm.parameters()),
                    optimizer=local(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)))
    return measured


@pytest.fixture(scope="module")
def runs(dist) -> dict[str, list[dict]]:
    return {key: dist(4).run(_measure_on_rank, plan) for key, plan in PLANS.items()}


def _lora_config():
    return with_lora(_config(MESH_MODEL), R, TARGETS)


@pytest.mark.parametrize("key", sorted(PLANS))
def test_lora_model_state_exact_on_mesh(runs, key: str) -> None:
    plan = Plan.from_string(PLANS[key]).resolve(4)
    full = est.model_state(_config(MESH_MODEL), plan)
    for rank, r in enumerate(runs[key]):
        state = est.model_state(_lora_config(), plan, pp_rank=r["pp_rank"], tp_rank=r["tp_rank"],
                                fsdp_rank=r["fsdp_rank"])
        assert (state.param_bytes, state.grad_bytes, state.optimizer_bytes) == (
            r["params"], r["grads"], r["optimizer"]), f"{key}, rank {rank}"
    assert state.grad_bytes < full.grad_bytes / 5 and state.optimizer_bytes < full.optimizer_bytes / 5


@pytest.mark.parametrize("key", sorted(k for k, v in PLANS.items() if "pp=" not in v))
def test_lora_activations_on_mesh(runs, key: str) -> None:
    plan = Plan.from_string(PLANS[key]).resolve(4)
    estimated = est.estimate(_lora_config(), plan, 4, _mesh_workload(plan)).memory.activations
    for rank, r in enumerate(runs[key]):
        assert abs(estimated - r["activations"]) / r["activations"] < 0.10, (key, rank, estimated, r["activations"])


@pytest.mark.parametrize("ac", ["none", "full"])
def test_lora_activations_on_one_process(ac: str) -> None:
    """The adapters' saved tensors (and the base's that a frozen weight no longer needs) at tp = 1."""
    config = _lora_config()
    measured = _measure_single(config, ac, 2, 40, DTYPES["float32"], wrap=lambda m: get_peft_model(
        m, LoraConfig(r=R, target_modules=TARGETS)))
    kw = dict(batch=2, seq=40, tp=1, dtype="float32")
    from meshkit.estimate import activations as acts

    estimated = (config.num_hidden_layers * sum(est.block_activations(config, ac=ac, **kw).values())
                 + acts.shared_activations(config, **kw) + sum(acts.head_activations(config, **kw).values()))
    assert abs(estimated - measured) / measured < 0.10, (ac, estimated, measured)


@pytest.mark.parametrize("key", sorted(PLANS))
def test_lora_communication_matches_comm_counter(runs, key: str) -> None:
    plan = Plan.from_string(PLANS[key]).resolve(4)
    for rank, r in enumerate(runs[key]):
        state = est.model_state(_lora_config(), plan, pp_rank=r["pp_rank"], tp_rank=r["tp_rank"])
        predicted: dict[str, float] = {}
        for c in est.communication(_lora_config(), plan, _mesh_workload(plan), est.DEVICES["h100"], state, 1.0, 0.0):
            predicted[f"{c.kind}@{c.axis}"] = predicted.get(f"{c.kind}@{c.axis}", 0) + c.calls * c.buffer
        axes = ("tp", "dp_shard_cp", "dp_replicate", "pp")  # the input checks' signature (pp_cp_tp) left out
        predicted = {k: v for k, v in predicted.items() if k.split("@")[1] in axes}
        counted = {k: v for k, v in r["comm"].items() if k.split("@")[1] in axes and v > 64}
        if "send@pp" in counted:
            assert counted.pop("recv@pp") == counted["send@pp"]
            counted["p2p@pp"] = counted.pop("send@pp")
        assert counted == pytest.approx(predicted), f"{key}, rank {rank}: {counted} vs {predicted}"


def test_plan_search_knows_lora() -> None:
    """On a budget where full fine-tuning needs model-state sharding, LoRA's frozen base (no gradient,
    no optimizer state) fits with less: its best plan's peak is lower, and its plans re-estimate
    as found. A model whose K/V heads tp would replicate keeps tp out of plans with K/V adapters."""
    import dataclasses

    from tests.estimate.test_estimate import SEARCH_MODEL

    config = _config(SEARCH_MODEL)
    lora = with_lora(config, 8, TARGETS)
    device = dataclasses.replace(est.DEVICES["h100"], memory_bytes=96 * 2**20)
    full, tuned = (plan_search.search(c, 8, 512, 32 * 512, device, top=5) for c in (config, lora))
    assert tuned.plans
    for cand in tuned.plans:
        again = est.estimate(lora, cand.plan, 8, cand.workload, device)
        assert again.peak_bytes <= plan_search.budget(device) and again.step_time == cand.estimate.step_time
    # plan for plan (the two searches' fastest five need not share their lowest peak)
    for cand in full.plans:
        assert est.estimate(lora, cand.plan, 8, cand.workload, device).peak_bytes < cand.estimate.peak_bytes, cand.plan
    mqa = with_lora(_config(dict(SEARCH_MODEL, num_key_value_heads=1)), 8, TARGETS)
    assert all(c.plan.tp == 1 for c in plan_search.search(mqa, 4, 512, 16 * 512, device, top=50).plans)


def test_estimate_cli_takes_lora(capsys) -> None:
    """`--lora-r` on the command line: the same model with gradients and AdamW state for the adapters
    only, the FlopCounterMode check of a LoRA block (no weight gradients of the frozen base) agreeing."""
    from meshkit.estimate.__main__ import main as estimate_cli

    reports = []
    for extra in ([], ["--lora-r", "16"]):
        estimate_cli(["--model", "llama3.2-1b", "--world", "8", "--seq", "1024", "--plan", "dp_shard=8", *extra])
        reports.append(capsys.readouterr().out)

    def gib(report: str, what: str) -> float:
        line = next(line for line in report.splitlines() if line.strip().startswith(what))
        return float(re.search(r"\s(\d+\.\d+)(\s|$)", line).group(1))  # the GiB column

    full, lora = reports
    assert gib(lora, "gradients") < gib(full, "gradients") / 50 and gib(lora, "optimizer") < gib(full, "optimizer") / 50
    assert "LoRA: the frozen base computes no weight gradients" in lora
    ratio = float(lora.split("(ratio ")[1].split(")")[0])
    assert abs(ratio - 1) < 0.02, lora
