"""One way to reach a tensor's local block, whether or not it is a DTensor.

Optimizer hooks, checkpoint checks, gradient sums and inference all need "the values this rank holds":
for a DTensor its `to_local()` (differentiable), for a plain tensor the tensor itself.
"""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor


def local_tensor(t: Tensor) -> Tensor:
    """This rank's block of `t` if it is a DTensor (differentiable), else `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t
