"""TP blocks on local shards (meshkit.tensor_parallel.local) against the DTensor ParallelStyles they
replace: the same loss, the same gradient for every parameter and the same collectives, byte for byte
(with and without sequence parallelism). Both sides are also checked against the single-device model
by the property tests in test_parallelize.py; this file pins that the fast path changed nothing but
the dispatch work, and that it is the path Llama blocks take."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

import meshkit
from meshkit import compose
from meshkit.comm_counter import CommCounter
from meshkit.models import roles as roles_lib
from meshkit.tensor_parallel import styles
from meshkit.tensor_parallel.local import block_runs_local


def _config() -> LlamaConfig:
    return LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, use_cache=False)


def _step(plan: meshkit.Plan, local: bool):
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    original = styles.apply_tensor_parallel

    def styles_only(*args, **kwargs):
        return original(*args, **{**kwargs, "local": False})

    with mock.patch.object(compose, "apply_tensor_parallel", original if local else styles_only):
        pm = meshkit.parallelize(model, plan)
    pm.check_inputs = False
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
    with CommCounter(pm.mesh) as counter, torch.profiler.profile() as prof:
        loss = pm.forward_backward(ids, ids)
    aten_ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in model.named_parameters()}
    wired = sorted((kind, axis, n) for kind, axis, n in counter.events)
    return float(loss), grads, wired, aten_ops


def _local_vs_styles_on_rank(sequence_parallel: bool):
    plan = meshkit.Plan(tp=2, sequence_parallel=sequence_parallel)
    fast, slow = _step(plan, True), _step(plan, False)
    for name, g in fast[1].items():
        torch.testing.assert_close(g, slow[1][name], rtol=1e-6, atol=1e-7, msg=name)
    return fast[0], slow[0], fast[2] == slow[2], len(fast[2]), fast[3], slow[3]


@pytest.mark.parametrize("sequence_parallel", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_local_blocks_equal_dtensor_styles(dist, sequence_parallel):
    results = dist(2).run(_local_vs_styles_on_rank, sequence_parallel)
    for fast_loss, slow_loss, same_collectives, n, fast_ops, slow_ops in results:
        assert fast_loss == pytest.approx(slow_loss, rel=1e-6, abs=1e-7)
        assert same_collectives and n > 0
        assert fast_ops < slow_ops, (fast_ops, slow_ops)  # the point of the local path: less dispatch


def test_llama_blocks_take_the_local_path_and_qk_norm_blocks_do_not():
    llama = LlamaForCausalLM(_config())
    block = llama.model.layers[0]
    assert block_runs_local(roles_lib.block_roles(block, llama.config), block)
    qk_norm = dict(roles_lib.block_roles(block, llama.config), **{"self_attn.q_norm": "head_norm"})
    assert not block_runs_local(qk_norm, block)
