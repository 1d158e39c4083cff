"""gpt-oss's experts as a meshkit `MoE`: router with a bias, experts stored transposed with gate/up
interleaved, expert biases, the clamped SwiGLU (`expert_parallel.expert_variants`).

The reference is HF's own `GptOssMLP` with its eager expert loop, on the whole batch in one process.
The tiny model's clamp limit sits inside the range of the pre-activations (checked), and every bias
is far from zero, so leaving out a clamp, a bias or the interleaving shows. Compared: the output,
the input gradient and every parameter gradient, on one rank (loop and grouped GEMM) and with the
experts split over ep = 4 (all-to-all dispatch, grouped GEMM), each rank feeding its own tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as tdist
import transformers
from torch.distributed.tensor import DTensor

from meshkit.expert_parallel import ClampedSwiGLU, ExpertLayout, MoE, apply_expert_parallel
from meshkit.expert_parallel.grouped_gemm import swiglu_experts
from meshkit.models.moe import convert_moe_blocks, moe_spec

ATOL, RTOL = 1e-6, 1e-5  # fp32, the same for every ep
HIDDEN, INTER, EXPERTS, TOKENS = 32, 16, 4, 32
LIMIT = 0.5


def _hf_model():
    config = transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                       num_local_experts=EXPERTS, num_experts_per_tok=2, swiglu_limit=LIMIT,
                                       swiglu_alpha=1.3, initializer_range=0.2)
    config._experts_implementation = "eager"  # HF's own loop: independent of meshkit's kernels
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.3)
    return model


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(2, TOKENS // 2, HIDDEN, generator=g) * 2, torch.randn(2, TOKENS // 2, HIDDEN, generator=g)


def _close(got, want, what: str) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _hf_reference(mlp, x, w):
    x = x.clone().requires_grad_()
    y, _ = mlp(x)
    (y * w).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in mlp.named_parameters()}


def test_the_tiny_model_exercises_every_quirk():
    """Both clamps bite and the biases are far from zero: a missing one would show in the others."""
    mlp = _hf_model().model.layers[0].mlp
    x, _ = _inputs()
    gate_up = x.reshape(-1, HIDDEN) @ mlp.experts.gate_up_proj[0] + mlp.experts.gate_up_proj_bias[0]
    gate, up = gate_up[:, ::2], gate_up[:, 1::2]
    assert (gate > LIMIT).float().mean() > 0.1 and (up.abs() > LIMIT).float().mean() > 0.1
    assert mlp.experts.down_proj_bias.abs().mean() > 0.1 and mlp.router.bias.abs().mean() > 0.1


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
def test_converted_mlp_equals_hf(backend):
    hf = _hf_model()
    ref = copy.deepcopy(hf.model.layers[0].mlp)
    mlp = hf.model.layers[0].mlp
    (moe,) = convert_moe_blocks(hf)
    moe.experts.backend = backend
    assert isinstance(moe, MoE) and hf.model.layers[0].mlp is moe
    assert moe.experts.gate_up_proj is mlp.experts.gate_up_proj and moe.gate.bias is mlp.router.bias
    assert moe.experts.layout == ExpertLayout(transposed=True, interleaved=True)
    assert moe.experts.activation == ClampedSwiGLU(alpha=1.3, limit=LIMIT)
    assert moe.state_dict().keys() == ref.state_dict().keys()
    x, w = _inputs()
    want_y, want_dx, want_grads = _hf_reference(ref, x, w)
    x = x.clone().requires_grad_()
    y, scores = moe(x)  # HF's decoder layer unpacks (hidden, router scores) from its mlp
    assert scores is None
    (y * w).sum().backward()
    _close(y, want_y, "output")
    _close(x.grad, want_dx, "input gradient")
    for name, p in moe.named_parameters():
        _close(p.grad, want_grads[name], f"{name} gradient")


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("device_counts", [False, True])
def test_biased_interleaved_experts_on_expert_major_rows(backend, device_counts):
    """`swiglu_experts` with the gpt-oss adapters against a plain per-expert loop written out here,
    with an expert that gets no rows; the rows' experts come from host or device counts alike."""
    g = torch.Generator().manual_seed(2)
    counts = [5, 0, 3, 8]
    x = torch.randn(sum(counts), HIDDEN, generator=g, requires_grad=True)
    gate_up = (torch.randn(EXPERTS, HIDDEN, 2 * INTER, generator=g) * 0.3).requires_grad_()
    down = (torch.randn(EXPERTS, INTER, HIDDEN, generator=g) * 0.3).requires_grad_()
    gate_up_bias, down_bias = (torch.randn(EXPERTS, n, generator=g).requires_grad_() for n in (2 * INTER, HIDDEN))
    leaves = (x, gate_up, down, gate_up_bias, down_bias)
    act = ClampedSwiGLU(alpha=1.3, limit=LIMIT)
    y = swiglu_experts(x, gate_up, down, counts, backend, torch.tensor(counts) if device_counts else None,
                       layout=ExpertLayout(transposed=True, interleaved=True), gate_up_bias_EN=gate_up_bias,
                       down_bias_EH=down_bias, activation=act)
    grads = torch.autograd.grad(y.square().sum(), leaves)
    want = []
    for e, rows in enumerate(x.split(counts)):
        h = rows @ gate_up[e] + gate_up_bias[e]
        gate, up = h[:, 0::2].clamp(max=LIMIT), h[:, 1::2].clamp(-LIMIT, LIMIT)
        want.append(((up + 1) * gate * torch.sigmoid(1.3 * gate)) @ down[e] + down_bias[e])
    want = torch.cat(want)
    _close(y, want, "output")
    for name, got, ref in zip(("x", "gate_up", "down", "gate_up_bias", "down_bias"), grads,
                              torch.autograd.grad(want.square().sum(), leaves)):
        _close(got, ref, f"{name} gradient")


def test_moe_spec_reads_the_gpt_oss_config():
    config = _hf_model().config
    spec = moe_spec(config)
    assert (spec.num_experts, spec.top_k, spec.intermediate_size, spec.layers) == (EXPERTS, 2, INTER, (0,))


def _ep_worker(backend: str) -> dict[str, float]:
    """HF's MLP on all tokens vs the converted MLP with one expert per rank, each rank its token slice."""
    rank, world = tdist.get_rank(), tdist.get_world_size()
    hf = _hf_model()
    ref = copy.deepcopy(hf.model.layers[0].mlp)
    (moe,) = convert_moe_blocks(hf)
    moe.experts.backend = backend
    apply_expert_parallel(moe, tdist.group.WORLD)
    x, w = _inputs()
    want_y, want_dx, want_grads = _hf_reference(ref, x, w)
    mine = slice(rank * TOKENS // world, (rank + 1) * TOKENS // world)
    x_mine = x.reshape(-1, HIDDEN)[mine].clone().requires_grad_()
    y, _ = moe(x_mine)
    (y * w.reshape(-1, HIDDEN)[mine]).sum().backward()
    out = {"y": (y - want_y.reshape(-1, HIDDEN)[mine]).abs().max().item(),
           "dx": (x_mine.grad - want_dx.reshape(-1, HIDDEN)[mine]).abs().max().item(), "grad": 0.0}
    for name, p in moe.named_parameters():
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad.detach().clone()
        want = want_grads[name]
        if name.startswith("experts."):  # this rank's expert: all ranks' tokens came home in backward
            assert grad.shape[0] == EXPERTS // world, name
            want = want[rank * grad.shape[0]:(rank + 1) * grad.shape[0]]
        else:  # the router saw this rank's tokens: summed over the ranks that split them
            tdist.all_reduce(grad)
        out["grad"] = max(out["grad"], ((grad - want).abs() - RTOL * want.abs()).max().item())
    return out


def test_expert_parallel_gpt_oss_experts_match_hf(dist):
    for rank, r in enumerate(dist(4).run(_ep_worker, "grouped_mm")):
        assert r["y"] <= ATOL and r["dx"] <= ATOL, f"rank {rank}: output/input gradient differ: {r}"
        assert r["grad"] <= ATOL, f"rank {rank}: a parameter gradient differs by {r['grad']:.3g}"
