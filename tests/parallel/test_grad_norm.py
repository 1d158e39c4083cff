"""The global gradient norm's local part on one process, against torch's own clip over the same
gradients: fp32 and bf16 gradients mixed (bf16 accumulated in fp32), the 2-norm, the 1-norm and the
max norm, and the in-place scaling of every gradient."""

from __future__ import annotations

import pytest
import torch

from meshkit.step.grad_norm import clip_grad_norm_, total_grad_norm


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape, dtype in [((7, 5), torch.float32), ((3,), torch.bfloat16), ((4, 4), torch.float32), ((0,), torch.float32),
                         ((6,), torch.bfloat16)]:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = (torch.randn(shape, generator=gen) * 3).to(dtype)
        params.append(p)
    return params


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_total_norm_matches_torch_in_fp32(norm_type):
    params = _params()
    reference = torch.linalg.vector_norm(torch.cat([p.grad.float().reshape(-1) for p in params]), norm_type)
    assert total_grad_norm(params, norm_type).item() == pytest.approx(reference.item(), rel=1e-6)


def test_clip_scales_every_gradient_to_the_max_norm():
    params = _params()
    before = [p.grad.float().clone() for p in params]
    norm = clip_grad_norm_(params, 1.0)
    coef = 1.0 / (norm.item() + 1e-6)
    assert coef < 1.0
    for p, old in zip(params, before):
        torch.testing.assert_close(p.grad.float(), (old * coef).to(p.grad.dtype).float(), rtol=1e-2 if p.grad.dtype ==
                                   torch.bfloat16 else 1e-6, atol=0)
    assert total_grad_norm(params).item() == pytest.approx(1.0, rel=1e-2)
