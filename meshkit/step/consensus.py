"""Fail on every rank or on none.

A rank that raises on its own leaves its peers blocked in the next collective until the process
group times out. Every check whose outcome may differ between ranks (each rank sees its own batch)
goes through `raise_if_any`: one small all-reduce tells every rank whether any rank failed, and only
then are the messages gathered so each rank raises the same ValueError naming the failing ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def raise_if_any(problem: str | None, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> None:
    """Raise ValueError on all ranks of `group` if `problem` is set on any of them."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if problem:
            raise ValueError(problem)
        return
    failing = gather_problems(problem, group, device)
    if not failing:
        return
    lines = "\n".join(f"  rank {rank}: {msg}" for rank, msg in failing)
    raise ValueError(f"{len(failing)} of {dist.get_world_size(group)} ranks rejected their input:\n{lines}")


def gather_problems(problem: str | None, group: dist.ProcessGroup | None = None,
                    device: torch.device | str = "cpu") -> list[tuple[int, str]]:
    """(rank, problem) of every rank of `group` that has one, the same list on every rank; one small
    all-reduce when none has (the common case), the messages gathered only otherwise."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [(dist.get_rank() if dist.is_initialized() else 0, problem)] if problem else []
    flag = torch.tensor([1 if problem else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return []
    messages: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, problem, group=group)
    return [(rank, msg) for rank, msg in enumerate(messages) if msg]


def sum_unless_any(problem: str | None, values: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """`values` (int64, this rank's) summed over `group`, or ValueError on every rank if any rank has a
    `problem`: `raise_if_any` and a sum in ONE all-reduce (the flag rides with the values), so a
    checked step pays one scalar collective for both. A rank with a problem contributes zeros."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if problem:
            raise ValueError(problem)
        return values
    both = torch.cat([values.new_tensor([1 if problem else 0]), values if problem is None else torch.zeros_like(values)])
    dist.all_reduce(both, group=group)
    if not both[0].item():
        return both[1:]
    messages: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, problem, group=group)
    failing = [(rank, msg) for rank, msg in enumerate(messages) if msg]
    lines = "\n".join(f"  rank {rank}: {msg}" for rank, msg in failing)
    raise ValueError(f"{len(failing)} of {len(messages)} ranks rejected their input:\n{lines}")


def disagreement(values: list[int], group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu") -> bool:
    """Whether the ranks of `group` hold different integer vectors (one MAX all-reduce of [v, -v]).

    Every rank learns the same answer, so every rank can refuse together; False on one rank.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return False
    both = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return not torch.equal(both[:len(values)], -both[len(values):])


def brief(items: list[str], n: int = 6) -> str:
    """The first `n` items of a problem list and how many more, for one-line error messages."""
    return "; ".join(items[:n]) + (f"; ... ({len(items) - n} more)" if len(items) > n else "")
