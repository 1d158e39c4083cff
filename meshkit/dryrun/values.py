"""The values a simulated rank reads on the host: real for small integer tensors, balanced for routing.

Under fake tensors no value exists, yet one training step reads a few on the host: the input checks
(token id range, the batch signature TP/CP/PP peers compare), the global count of valid targets, the
MoE dispatch's split sizes, an optimizer's step count. `HostValues` keeps a real twin of every small
integer or boolean tensor whose inputs are known (token ids, labels, positions, routing indices and
everything computed from them), so these reads return what the real run would compute, under two
rules, the dry run's model of the world:

- **A symmetric world**: every rank holds the simulated rank's data. A collective on a known tensor
  gets the value it would have if every rank of its group contributed the same tensor (a SUM
  all-reduce multiplies by the group size, an all-gather repeats, an all-to-all hands back this
  rank's own block), since the fake backend moves nothing.
- **Balanced routing**: the indices of every `topk` are known and balanced round-robin, token t's
  j-th choice being expert (t*K + j) mod E: the router's scores are fake, so its choice is unknown,
  and this is the uniform routing the estimator assumes (every expert receives T*K/E rows of every
  rank, every rank sends and receives T*K rows).

Values computed from weights (activations, losses, norms) stay unknown. A host read of an unknown
floating-point scalar (the gradient norm clipping reads) returns 0.0 and is counted
(`unknown_reads`); of an unknown integer or boolean, which could steer shapes or control flow, raises.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map

from meshkit._compat.dispatch import dispatch_mode_base, outside_dispatch_modes
from meshkit._compat.fake import (
    VALUE_DEPENDENT,
    fake_constant,
    fake_mode_of,
    group_size_by_name,
    is_fake,
    process_group_arg,
    reduce_op_is_sum,
    weak_tensor_dict,
)

aten = torch.ops.aten

#: Dtypes whose values are kept: indices, counts, masks. uint8 and int8 are left out (FSDP2 gathers
#: parameters of mixed dtypes as bytes).
KEPT_DTYPES = (torch.int64, torch.int32, torch.bool)
#: The largest tensor whose value is kept: a 128k-token batch of ids, routing indices of 2M tokens.
KEPT_NUMEL = 1 << 24
_HOST_READS = (aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default)


class UnknownValueError(RuntimeError):
    """A host read of a value the dry run cannot know (computed from fake weights or activations)."""


class HostValues(dispatch_mode_base()):  # type: ignore[misc]
    """A dispatch mode, entered above a FakeTensorMode, keeping the real value of small integer
    tensors (see the module docstring for the rules)."""

    def __init__(self) -> None:
        super().__init__()
        self._values = weak_tensor_dict()
        self.unknown_reads = 0  # host reads of unknown floats, answered 0.0

    def value(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The real value of `tensor` (itself when it is real), or None when unknown."""
        if not is_fake(tensor):
            return tensor
        constant = fake_constant(tensor)
        return constant if constant is not None else self._values.get(tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs first and comes back with the plain ops it lowers to
        if func.namespace == "c10d":
            out = func(*args, **kwargs)
            self._collective(func.__name__.split(".")[0], args)
            return out
        if func.namespace == "_c10d_functional":
            out = func(*args, **kwargs)
            name = func.__name__.split(".")[0]
            if name == "wait_tensor":
                return args[0]  # waiting returns the tensor itself (fake tensors would hand back a new one)
            self._functional(name, args, out)
            return out
        known = all(self.value(t) is not None for t in _tensors((args, kwargs)))
        if func in _HOST_READS:
            return self._host_read(func, args, kwargs, known)
        try:
            out = func(*args, **kwargs)
        except VALUE_DEPENDENT:
            if not known:
                raise
            return self._from_real(func, args, kwargs)
        if func is aten.topk.default:
            x, dim = args[0], args[2] if len(args) > 2 else kwargs.get("dim", -1)
            self._values[out[1]] = _balanced(out[1], x.shape[dim % x.dim()], dim % x.dim())
            return out
        outs = [o for o in tree_leaves(out) if is_fake(o)]
        if known and outs and all(o.dtype in KEPT_DTYPES and o.numel() <= KEPT_NUMEL for o in outs):
            self._attach(out, self._real(func, args, kwargs))
        else:
            for o in outs:
                self._values.pop(o, None)
        return out

    # ------------------------------------------------------------------------------ plain ops
    def _real(self, func, args, kwargs) -> Any:
        def real(a):
            return self.value(a) if isinstance(a, torch.Tensor) else a

        with outside_dispatch_modes():
            return func(*tree_map(real, args), **tree_map(real, kwargs))

    def _attach(self, out, real_out) -> None:
        for o, r in zip(tree_leaves(out), tree_leaves(real_out)):
            if is_fake(o) and isinstance(r, torch.Tensor):
                self._values[o] = r

    def _from_real(self, func, args, kwargs) -> Any:
        """An op whose output shape depends on values (bincount, nonzero) on known inputs: run it for
        real and hand back a fake tensor of the real result's shape, its value kept."""
        real_out = self._real(func, args, kwargs)
        mode = next(fake_mode_of(t) for t in _tensors((args, kwargs)) if is_fake(t))
        with outside_dispatch_modes():
            out = tree_map(lambda r: mode.from_tensor(r) if isinstance(r, torch.Tensor) else r, real_out)
        self._attach(out, real_out)
        return out

    def _host_read(self, func, args, kwargs, known: bool) -> Any:
        if known:
            return self._real(func, args, kwargs)
        x = args[0]
        if func is aten._local_scalar_dense.default and x.dtype.is_floating_point:
            self.unknown_reads += 1
            return 0.0
        raise UnknownValueError(
            f"the dry run cannot know the value of a {x.dtype} tensor {tuple(x.shape)} read on the host "
            f"({func}): it is computed from fake weights or activations; only token ids, labels, positions, "
            "routing indices and what derives from them have values here")

    # ----------------------------------------------------------------------------- collectives
    def _collective(self, name: str, args: tuple) -> None:
        """A c10d collective on the fake backend (which wrote nothing): give its outputs the values of a
        symmetric world, or forget them where no rule applies."""
        group = process_group_arg(args)
        n, me = (group.size(), group.rank()) if group is not None else (1, 0)
        with outside_dispatch_modes():
            if name in ("allreduce_", "allreduce_coalesced_"):
                for t in args[0]:
                    v = self.value(t)
                    if v is not None and reduce_op_is_sum(args[2]):
                        v.mul_(n)  # MAX, MIN and AVG of equal contributions: unchanged
            elif name == "alltoall_base_":
                self._all_to_all(args[0], args[1], list(args[3]), list(args[4]), n, me)
            elif name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
                for out, inp in zip(_as_list(args[0]), _as_list(args[1])):
                    vi, vo = self.value(inp), self.value(out)
                    if vo is not None:
                        if vi is None:
                            self._values.pop(out, None)
                        else:
                            vo.copy_(vi.reshape(-1).repeat(n).view_as(vo))
            elif name not in ("broadcast_", "send", "barrier", "monitored_barrier_"):
                for t in _tensors(args):  # receives and reduce-scatters: values unknown from here on
                    self._values.pop(t, None)

    def _all_to_all(self, out, inp, out_splits: list[int], in_splits: list[int], n: int, me: int) -> None:
        vo, vi = self.value(out), self.value(inp)
        if vo is None:
            return
        if vi is None:
            self._values.pop(out, None)
            return
        in_splits = in_splits or [inp.shape[0] // n] * n
        start = sum(in_splits[:me])
        mine = vi[start:start + in_splits[me]]  # what every rank sends this rank, in a symmetric world
        vo.copy_(mine.repeat(n, *[1] * (mine.dim() - 1)).view_as(vo))

    def _functional(self, name: str, args: tuple, out: Any) -> None:
        """Functional collectives (DTensor's): the same symmetric-world rules on their new outputs."""
        if not is_fake(out):
            return
        v = self.value(args[0]) if isinstance(args[0], torch.Tensor) else None
        if v is None:
            self._values.pop(out, None)
            return
        with outside_dispatch_modes():
            if name in ("all_reduce", "all_reduce_"):
                self._values[out] = v * group_size_by_name(args[-1]) if args[1] == "sum" else v.clone()
            elif name == "all_gather_into_tensor":
                self._values[out] = v.repeat(int(args[1]), *[1] * (v.dim() - 1))
            else:
                self._values.pop(out, None)


class BalancedRouting(dispatch_mode_base()):  # type: ignore[misc]
    """On real tensors, every `topk`'s indices overwritten with the dry run's balanced choices: a real
    run routed as the dry run assumes, so that the two can be compared rank by rank (the routing
    weights keep the scores' top values: the numbers are meaningless, the shapes and bytes exact)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten.topk.default:
            x, dim = args[0], args[2] if len(args) > 2 else kwargs.get("dim", -1)
            with outside_dispatch_modes():
                out[1].copy_(_balanced(out[1], x.shape[dim % x.dim()], dim % x.dim()))
        return out


def _balanced(indices: torch.Tensor, experts: int, dim: int) -> torch.Tensor:
    """Round-robin choices: the j-th of token t's K choices (along `dim`) is (t*K + j) mod experts."""
    shape = list(indices.shape)
    order = [d for d in range(len(shape)) if d != dim] + [dim]
    with outside_dispatch_modes():
        flat = torch.arange(indices.numel(), dtype=indices.dtype) % experts
        return flat.view([shape[d] for d in order]).permute([order.index(d) for d in range(len(shape))]).contiguous()


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]
