"""Selective activation checkpointing of MoE layers when the first MoE forward of the process runs
inside the checkpointed region, against the single-device HF model (loss, gradients, parameters).

The grouped-GEMM backend is chosen by probing `torch._grouped_mm` once per process (cached). That
probe used to run inside the first checkpointed forward, where selective checkpointing cached its
output as the first `_grouped_mm` call; the recompute (probe already cached) then received the
probe's [8, 8] output for the layer's real gate/up projection and backward failed with torch's
CheckpointError. Whether it showed depended on whether anything earlier in the process had run an
MoE forward, so each case clears the probe's cache first, as a fresh training process has it.

Selective checkpointing applies to MoE blocks under every plan (it used to fall back to full
recompute with tp > 1 or ep > 1): selective and no AC give the HF model's loss and gradients, and
the backward of a selective step runs exactly the matmuls of a step without AC (none recomputed;
full recompute would re-run them). Under dp_shard=2,tp=2,ep=2 the experts' own FSDP unit has its
hooks inside the checkpointed block, and the recompute called profiler ops the forward had not.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tests_support import GRAD_TOL, LOSS_TOL, assert_matches_reference
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import meshkit
from meshkit._compat.checkpointing import hidden_from_selective_checkpoint, in_backward
from meshkit._compat.dispatch import dispatch_mode_base
from meshkit.activation_checkpoint import CheckpointedBlock, _selective_context, is_saved_op
from meshkit.expert_parallel.grouped_gemm import _kernel_runs
from meshkit.models.moe import convert_moe_blocks
from meshkit.testing.families import family_spec
from meshkit.testing.reference import BatchSpec, ModelSpec, compare_training

BATCH = BatchSpec(batch=4, seq=8)


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor):
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_selectively_checkpointed_moe_blocks_match_hf_on_one_process():
    spec = family_spec("olmoe", seed=0)
    ref, model = spec.build(), spec.build()
    convert_moe_blocks(model)
    for layer in model.model.layers:
        layer.mlp = CheckpointedBlock(layer.mlp, "selective")
    ids, labels = BATCH.make(spec.vocab)
    ref_loss, ref_grads = _loss_and_grads(ref, ids, labels)
    _kernel_runs.cache_clear()  # as in a fresh process: the probe runs inside the first checkpointed forward
    loss, grads = _loss_and_grads(model, ids, labels)
    assert abs(loss - ref_loss) <= LOSS_TOL, (loss, ref_loss)
    for name, g in ref_grads.items():
        got = grads[name.replace(".mlp.", ".mlp.block.")]
        assert got is not None, f"{name}: no gradient"
        assert (got - g).abs().max() <= GRAD_TOL, f"{name}: gradient differs by {(got - g).abs().max():.3g}"


def _first_moe_forward_checkpointed(plan: str, kind: str, batch: BatchSpec):
    _kernel_runs.cache_clear()  # as in a fresh process: the probe runs inside the first checkpointed forward
    return dataclasses.asdict(compare_training(plan, family_spec(kind, seed=0), batch))


def test_selective_checkpointing_under_fsdp_matches_hf(dist):
    plan = "dp_shard=2,activation_checkpointing=selective"
    results = dist(2).run(_first_moe_forward_checkpointed, plan, "olmoe", BATCH, timeout=300)
    assert_matches_reference(results, f"olmoe under {plan}")


@pytest.mark.slow  # the same probe path as the dp_shard=2 case, with DeepSeek-V3's routing and CP on 4 ranks
def test_selective_checkpointing_under_allgather_cp_matches_hf(dist):
    plan = "dp_shard=2,cp=2,cp_attention=allgather,activation_checkpointing=selective"
    results = dist(4).run(_first_moe_forward_checkpointed, plan, "deepseek_v3", BATCH, timeout=600)
    assert_matches_reference(results, f"deepseek_v3 under {plan}")


# -- selective AC of MoE blocks under every plan ---------------------------------------------------------


class _Seen(dispatch_mode_base()):
    """Counts the ops that reach it: saved-kind ops (matmuls, attention) run in backward, and `exp`."""

    def __init__(self):
        super().__init__()
        self.backward_matmuls = 0
        self.exps = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.backward_matmuls += int(is_saved_op(func) and in_backward())
        self.exps += int(func is torch.ops.aten.exp.default)
        return func(*args, **(kwargs or {}))


def test_hidden_work_and_profiler_labels_may_differ_between_forward_and_recompute():
    """What FSDP's hooks of a nested unit do in a recompute (more profiler ranges, other ops) and what an
    MoE recompute skips runs beside selective checkpointing's op replay, and other modes still see it."""
    calls = []

    def body(x):
        calls.append(len(calls))
        for _ in calls:  # one more profiler range in every call: the recompute has more than the forward
            with torch.profiler.record_function(f"call {len(calls)}"):
                pass
        with hidden_from_selective_checkpoint():
            for _ in calls:
                x.detach().exp()  # one more op in the recompute, outside the replay
        return (x @ x).sin() @ x

    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    with _Seen() as seen:
        checkpoint(body, x, use_reentrant=False, preserve_rng_state=False, context_fn=_selective_context).sum().backward()
    ref = x.detach().clone().requires_grad_()
    ((ref @ ref).sin() @ ref).sum().backward()
    assert len(calls) == 2, "the recompute did not run"
    assert seen.exps == 3, "hidden ops must still reach the other dispatch modes"
    assert seen.backward_matmuls == 4, "selective AC must serve the two forward matmuls from its cache"
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=1e-12)


LLAMA_MOE = ModelSpec(layers=2, heads=4, kv_heads=2, head_dim=8, intermediate=16, vocab=64, experts=4, top_k=2,
                      shared_expert=8)


def _full_grad(p: torch.nn.Parameter) -> torch.Tensor:
    return (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach()


def _ac_modes_on_rank(plan: str, model: ModelSpec, batch: BatchSpec) -> dict:
    """One step of the HF model on the global batch, and of `plan` without AC and with selective AC:
    losses, gathered gradients, the checkpoint modes of the blocks, matmuls run in backward."""
    ids, labels = batch.make(model.vocab)
    ref = model.build()
    ref_loss = ref(input_ids=ids, labels=labels, use_cache=False).loss
    ref_loss.backward()
    out = {"hf": (ref_loss.item(), {n: p.grad for n, p in ref.named_parameters()})}
    for ac in ("none", "selective"):
        pm = meshkit.parallelize(model.build(), meshkit.Plan.from_string(f"{plan},activation_checkpointing={ac}"))
        rows = batch.batch // pm.dp_size
        mine = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
        with _Seen() as seen:
            loss = pm.forward_backward(ids[mine], labels[mine])
        modes = sorted({m.mode for part in pm.model_parts for m in part.modules() if isinstance(m, CheckpointedBlock)})
        out[ac] = (loss.item(), {n: _full_grad(p) for n, p in pm.named_parameters()}, modes, seen.backward_matmuls)
    return out


def _assert_selective_matches(results: list[dict], context: str) -> None:
    for rank, r in enumerate(results):
        where = f"{context}, rank {rank}"
        ref_loss, ref_grads = r["hf"]
        for ac in ("none", "selective"):
            loss, grads, _, _ = r[ac]
            assert abs(loss - ref_loss) <= LOSS_TOL, f"{where}, AC {ac}: loss {loss} vs HF {ref_loss}"
            assert grads.keys() == ref_grads.keys(), f"{where}, AC {ac}: parameters differ from HF's"
            for name, g in grads.items():
                err = (g - ref_grads[name]).abs().max().item()
                assert err <= GRAD_TOL, f"{where}, AC {ac}: {name} gradient differs from HF's by {err:.3g}"
        _, selective_grads, modes, selective_matmuls = r["selective"]
        _, none_grads, _, none_matmuls = r["none"]
        for name, g in selective_grads.items():
            err = (g - none_grads[name]).abs().max().item()
            assert err <= GRAD_TOL, f"{where}: {name} gradient, selective vs no AC, differs by {err:.3g}"
        assert modes == ["selective"], f"{where}: blocks checkpointed as {modes}"
        assert none_matmuls > 0 and selective_matmuls == none_matmuls, (
            f"{where}: backward ran {selective_matmuls} matmuls under selective AC and {none_matmuls} without AC; "
            "selective must recompute none")


def test_selective_checkpointing_of_moe_blocks_under_tp_and_ep(dist):
    """The plan that fell back to full recompute longest: experts FSDP'd on their own (size-1) mesh."""
    plan = "dp_shard=2,tp=2,ep=2"
    results = dist(4).run(_ac_modes_on_rank, plan, LLAMA_MOE, BatchSpec(batch=4, seq=8), timeout=300)
    _assert_selective_matches(results, f"Llama-MoE under {plan}")


@pytest.mark.slow  # the other plans that used to fall back: ep over FSDP ranks, and TP alone with an HF MoE
@pytest.mark.parametrize("kind, plan", [("llama_moe", "dp_shard=4,ep=2"), ("olmoe", "tp=2,dp_shard=2"),
                                        ("deepseek_v3", "dp_shard=4,ep=2"), ("qwen2_moe", "dp_shard=2,tp=2,ep=2")])
def test_selective_checkpointing_of_moe_blocks_under_other_plans(dist, kind, plan):
    model = LLAMA_MOE if kind == "llama_moe" else family_spec(kind, seed=0)
    results = dist(4).run(_ac_modes_on_rank, plan, model, BatchSpec(batch=4, seq=8), timeout=600)
    _assert_selective_matches(results, f"{kind} under {plan}")
