"""W hands each weight gradient to autograd without a copy, and frees the factors as it goes."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from meshkit.pipeline.weight_grad import PendingWeightGrads, collecting, deferrable_linears

_COPIES = {torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten.new_empty_strided.default,
           torch.ops.aten.empty_strided.default}


class _Copies(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _COPIES:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_w_takes_its_products_as_grads_without_copying() -> None:
    """A weight used twice in one microbatch gets the sum of its two products in one accumulation, equal
    to nn.Linear's backward, and W allocates nothing but the products: handing them to autograd from
    Python made AccumulateGrad copy each one (the dry run measured a ZB stage's weight gradients twice
    over at the end of W)."""
    torch.manual_seed(0)
    lin, x = nn.Linear(16, 32), torch.randn(6, 16, requires_grad=True)
    ref = copy.deepcopy(lin)
    with deferrable_linears([lin]):
        y = lin(x) + lin(x * 2)
    pending = PendingWeightGrads()
    with collecting(pending):
        y.square().sum().backward()
    assert lin.weight.grad is None and len(pending) == 2
    with _Copies() as copies:
        pending.run()
    (ref(x.detach()) + ref(x.detach() * 2)).square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)
    assert copies.ops == [], copies.ops
