"""Split a stage's backward into B (input gradient, now) and W (weight gradients, later) for ZB schedules.

How: while a B/W schedule runs, every eager `nn.Linear` of the stages computes its forward through
`_DeferrableLinear`. Its backward returns the input gradient at once and, while a `PendingWeightGrads`
is collecting (during B), hands the two factors of the weight gradient (the layer input and the
output gradient) to it instead of multiplying them. W multiplies them and feeds the products to
`torch.autograd.backward` with the weights as roots.

Why this design and not the alternatives (CPU times on a 4-block Llama stack, H=256, S=512 tokens,
relative to one full backward; gradients were bitwise equal in every variant):
- Two `autograd.grad` calls over a retained graph (w.r.t. the stage input, then w.r.t. the
  parameters) run the whole input-gradient chain again in W: W alone cost 1.0x a full backward
  (B+W 1.7x), and under activation checkpointing W recomputes every block once more.
- Walking the autograd graph (torch's `stage_backward_input/weight`: capture the gradients that
  flow into the nodes feeding parameters, replay from there in W) gets B+W to 1.14x without
  checkpointing, but W is a second backward over the retained graph: with non-reentrant
  checkpointing (recompute is per backward call) W recomputed each block 9 times in torch 2.13 and
  cost 3.1x a full backward; torch also refuses compiled stages with it.
- Deferring at the linear layers (this module) costs exactly the weight-gradient matmuls in W
  (0.39x; 0.25x with checkpointing), recomputes nothing (the layer inputs B recomputed are kept),
  B+W 1.07x (1.04x with checkpointing), and works unchanged on DTensor weights (the matmuls are
  DTensor ops). After B a microbatch pins each linear's input and output gradient until its W.

Parameters that are not weights of eager `nn.Linear`s (embeddings, norms, compiled blocks) get
their gradients in B, which is always correct and moves only cheap work (or, for compiled blocks,
all of it) from W to B.

Gradients reach `.grad` exactly as in a normal backward: W's `autograd.backward(weights, grads)`
goes through each weight's AccumulateGrad, so accumulation, tensor hooks and post-accumulate hooks
(e.g. meshkit's TP Partial-gradient reduction) behave the same; a weight used several times in one
microbatch gets the sum of its products in one accumulation, as the engine's input buffer would do.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from meshkit._compat.dispatch import is_compiled

# The PendingWeightGrads collecting right now, or None (then the linears behave like nn.Linear).
# A process-wide variable, not a thread-local: on GPUs the autograd engine runs backward on its own
# device threads. The pipeline runtime runs one backward at a time, so there is never a second one.
_collecting: PendingWeightGrads | None = None


class PendingWeightGrads:
    """The weight-gradient work one (stage, microbatch) still owes after its B."""

    def __init__(self) -> None:
        # (weight or None, bias or None, layer input [N.., in], output gradient [N.., out])
        self._factors: list[tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self._factors)

    def add(self, weight: torch.Tensor | None, bias: torch.Tensor | None, x: torch.Tensor,
            grad_out: torch.Tensor) -> None:
        """Queue one layer's weight-gradient work for the microbatch's W action."""
        self._factors.append((weight, bias, x, grad_out))

    def run(self) -> None:
        """Compute the weight gradients and accumulate them into `.grad` through autograd.

        Each parameter's product is made inside the backward of a node of its own (`_Product`), so
        the engine hands it to the parameter's AccumulateGrad as its only owner, which takes it as
        `.grad`, and each layer's factors are freed once multiplied. Handing the products in from
        Python (`grad_tensors`) kept every factor and every product to the end of W and made
        AccumulateGrad copy each one: the dry run measured a stage's weight gradients twice over on
        top of the microbatch's factors (2.6 GiB for a Llama 3.2 3B stage of 7 blocks under ZB-H1).
        """
        factors, self._factors = self._factors, []
        work: dict[int, tuple[torch.Tensor, list]] = {}
        for weight, bias, x, grad_out in factors:
            for param, is_weight in ((weight, True), (bias, False)):
                if param is not None:
                    work.setdefault(id(param), (param, []))[1].append((is_weight, x, grad_out))
        factors.clear()
        if work:
            roots = [_Product.apply(param, uses) for param, uses in work.values()]
            work.clear()
            torch.autograd.backward(roots)


class _Product(torch.autograd.Function):
    """One parameter's weight gradient in W: the sum over its uses of grad_out^T x (or grad_out summed
    over tokens for a bias), computed in backward and returned to the engine, whose AccumulateGrad
    then owns it alone. The forward's output is a placeholder scalar to call backward on."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, uses: list) -> torch.Tensor:
        ctx.uses = uses
        return torch.zeros((), device=param.device)

    @staticmethod
    def backward(ctx, _grad: torch.Tensor):
        uses, ctx.uses = ctx.uses, None
        total = None
        for i, (is_weight, x, grad_out) in enumerate(uses):
            uses[i] = None  # the factors go as they are used
            grad_w, grad_b = _weight_grads(x, grad_out, is_weight, not is_weight)
            grad = grad_w if is_weight else grad_b
            total = grad if total is None else total + grad
        return total, None


@contextlib.contextmanager
def collecting(pending: PendingWeightGrads) -> Iterator[PendingWeightGrads]:
    """During this block (a B), deferrable linears hand their weight-gradient factors to `pending`."""
    global _collecting
    previous, _collecting = _collecting, pending
    try:
        yield pending
    finally:
        _collecting = previous


def _weight_grads(x: torch.Tensor, grad_out: torch.Tensor, need_w: bool,
                  need_b: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    grad_NO = grad_out.reshape(-1, grad_out.shape[-1])
    grad_w = grad_NO.t().mm(x.reshape(-1, x.shape[-1])) if need_w else None
    grad_b = grad_NO.sum(0) if need_b else None
    return grad_w, grad_b


class _DeferrableLinear(torch.autograd.Function):
    """`F.linear` whose weight and bias are not autograd inputs: their gradients go through W.

    Keeping the parameters out of the graph (rather than returning None for them) means B never
    reaches their AccumulateGrad nodes, so parameter hooks fire once per gradient, in W, as they
    would in a normal backward. `anchor` stands in as a grad-requiring input when `x` does not
    require grad (a first layer on raw inputs), so that the output still has a graph.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor | None,
                params: tuple[torch.Tensor | None, torch.Tensor | None]) -> torch.Tensor:
        # The input goes through save_for_backward, so activation checkpointing and saved-tensor hooks
        # treat it like any activation; the parameters are held as themselves, since W must hand the
        # very same tensors to autograd.
        ctx.save_for_backward(x)
        ctx.params = params
        weight, bias = params
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.params
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        weight = weight if weight.requires_grad else None
        bias = bias if bias is not None and bias.requires_grad else None
        pending = _collecting if _collecting is not None else PendingWeightGrads()
        pending.add(weight, bias, x, grad_out)
        if pending is not _collecting:
            pending.run()  # not inside a B: accumulate now (a reentrant backward), like nn.Linear
        return grad_x, None, None


def _deferrable_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    params_need_grad = weight.requires_grad or (bias is not None and bias.requires_grad)
    # A non-leaf weight has a graph of its own that this B might free before W; keep it on nn.Linear.
    leaves = weight.grad_fn is None and (bias is None or bias.grad_fn is None)
    if not torch.is_grad_enabled() or not params_need_grad or not leaves:
        return F.linear(x, weight, bias)
    anchor = None if x.requires_grad else torch.empty(0, device=x.device, requires_grad=True)
    return _DeferrableLinear.apply(x, anchor, (weight, bias))


def _eager_modules(module: nn.Module) -> Iterator[nn.Module]:
    """`module` and its descendants, skipping compiled subtrees (their backward is one graph)."""
    if is_compiled(module):
        return
    yield module
    for child in module.children():
        yield from _eager_modules(child)


@contextlib.contextmanager
def deferrable_linears(modules: Iterable[nn.Module]) -> Iterator[list[nn.Linear]]:
    """Route the eager `nn.Linear`s under `modules` through `_DeferrableLinear` for this block.

    The forward and the activation-checkpoint recompute must both run inside the block, so that the
    recompute saves the same tensors as the forward did. Linears whose forward is overridden (by
    a subclass or an instance attribute) are left alone.
    """
    patched: list[nn.Linear] = []
    seen: set[int] = set()
    try:
        for root in modules:
            for m in _eager_modules(root):
                if (isinstance(m, nn.Linear) and id(m) not in seen and type(m).forward is nn.Linear.forward
                        and "forward" not in m.__dict__):
                    seen.add(id(m))
                    m.forward = functools.partial(_deferrable_forward, m)
                    patched.append(m)
        yield patched
    finally:
        for m in patched:
            del m.forward
