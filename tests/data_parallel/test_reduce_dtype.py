"""Mixed precision's reduce dtype, checked on the collectives themselves: every gradient reduce-scatter's
input has the requested dtype, and its output equals an fp64 sum of every rank's input tightly enough
that a bf16 reduction (rounding at ~4e-3) could not pass, under each zero stage."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import meshkit
from meshkit._compat.dispatch import dispatch_mode_base
from meshkit.mesh import axis
from meshkit.testing.reference import BatchSpec, ModelSpec

_REDUCE_SCATTERS = ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_")


class _ReduceScatterTap(dispatch_mode_base()):
    """Records each c10d reduce-scatter: a copy of its input, and its output tensor (read after backward)."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func.__name__.split(".")[0] in _REDUCE_SCATTERS:
            out, inp = args[0], args[1]
            pairs = zip(out, inp) if isinstance(out, (list, tuple)) else [(out, inp)]
            for o, i in pairs:
                self.calls.append((o, i.detach().clone()))
        return func(*args, **kwargs)


def reduce_scatters(plan: str) -> list[dict]:
    """Per reduce-scatter on this rank: its input dtype and the worst relative difference between its
    output and the fp64 sum of all ranks' inputs (this rank's chunk). On gloo's collectives, which the
    tap sees; the shared-memory channel one host's ranks use gives the same bits (test_host_comms.py)."""
    spec = ModelSpec()
    os.environ["MESHKIT_SHARED_MEMORY"] = "0"
    try:
        pm = meshkit.parallelize(spec.build(), meshkit.Plan.from_string(plan))
    finally:
        os.environ.pop("MESHKIT_SHARED_MEMORY")
    group = axis(pm.mesh, "dp_shard_cp").get_group()
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    ids, labels = BatchSpec(batch=4, seq=8, seed=3).make(spec.vocab)
    per = 4 // pm.dp_size
    tap = _ReduceScatterTap()
    with tap:
        pm.forward_backward(ids[pm.dp_rank * per:(pm.dp_rank + 1) * per], labels[pm.dp_rank * per:(pm.dp_rank + 1) * per])
    out = []
    for output, inp in tap.calls:
        everyone = [torch.empty_like(inp) for _ in range(n)]
        dist.all_gather(everyone, inp, group=group)  # exact: a copy, no arithmetic
        total = torch.stack([t.double() for t in everyone]).sum(0)
        mine = total.reshape(n, -1)[rank].reshape(output.shape)
        scale = mine.abs().max().item() or 1.0
        out.append({"dtype": str(inp.dtype).replace("torch.", ""), "rel": (output.double() - mine).abs().max().item() / scale})
    return out


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_gradients_reduce_in_fp32_when_asked(dist, zero):
    results = dist(2).run(reduce_scatters, f"dp_shard=2,zero={zero},param_dtype=bfloat16,reduce_dtype=float32")
    for rank, calls in enumerate(results):
        assert calls, f"rank {rank}: no reduce-scatter seen"
        assert {c["dtype"] for c in calls} == {"float32"}, f"zero={zero}, rank {rank}"
        worst = max(c["rel"] for c in calls)
        assert worst < 1e-6, f"zero={zero}, rank {rank}: {worst:.3g} from the fp64 sum: not an fp32 reduction"


def test_the_check_sees_a_bf16_reduction(dist):
    """The same measurement with reduce_dtype=bfloat16: the input dtype says so, and summing in bf16
    misses the fp64 sum by far more than the fp32 bound above."""
    for calls in dist(2).run(reduce_scatters, "dp_shard=2,zero=2,param_dtype=bfloat16,reduce_dtype=bfloat16"):
        assert {c["dtype"] for c in calls} == {"bfloat16"}
        assert max(c["rel"] for c in calls) > 1e-4
