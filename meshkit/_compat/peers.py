"""torch's own implementations that meshkit's benchmarks measure against.

Private or version-gated torch APIs (see `meshkit._compat`).
"""

from __future__ import annotations


def torch_context_parallel():
    """torch's experimental CP, benchmarked against meshkit's: (`context_parallel`, `set_rotate_method`);
    the latter lives only under the private `_attention` module in 2.11-2.13."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    return context_parallel, set_rotate_method


def torch_pipeline_order(schedule):
    """The per-rank action lists a `torch.distributed.pipelining` schedule derived (`pipeline_order`,
    entries are private `_Action`s), or None; the pipeline benchmark replays them in meshkit's simulator."""
    order = getattr(schedule, "pipeline_order", None)
    return order if isinstance(order, dict) else None
