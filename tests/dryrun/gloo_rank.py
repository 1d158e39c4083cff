"""The real side of the dry run's check: one gloo rank of a real multi-process run, measured with the
same instrument (`meshkit.dryrun.measure`) the dry run uses on fake tensors, and routed as the dry
run routes (`values.BalancedRouting`: an MoE model's per-rank bytes depend on the routing)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import transformers

import meshkit
from meshkit.dryrun.measure import measure_step
from meshkit.dryrun.rank import batches
from meshkit.dryrun.values import BalancedRouting
from meshkit.estimate.spec import Workload
from meshkit.plan import Plan


def real_rank(config, plan: Plan, workload: Workload) -> dict:
    """Build the model on the meta device, parallelize, initialise real weights, measure a step."""
    plan = plan.resolve(dist.get_world_size())
    torch.manual_seed(0)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # offload on CPU: "saves nothing here"
        pm = meshkit.parallelize(model, plan)
    pm.init_weights(seed=0)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)
    with BalancedRouting():
        measured = measure_step(pm, optimizer, batches(config, plan, workload))
    return {"peak": measured.peak, "collectives": measured.collectives()}


def saved_checkpoint(config, plan: Plan, directory: str) -> dict | None:
    """Save a real meshkit checkpoint (model and AdamW state after one step) from every rank; rank 0
    reports DCP's metadata: its file size, its tensors and their chunk entries."""
    import os

    from meshkit.state.checkpoint import _read_metadata

    plan = plan.resolve(dist.get_world_size())
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
    pm = meshkit.parallelize(model, plan)
    pm.init_weights(seed=0)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(pm.dp_rank))
    pm.forward_backward(ids, ids)
    optimizer.step()
    pm.save_checkpoint(directory, optimizer, step=1)
    if dist.get_rank() != 0:
        return None
    metadata = _read_metadata(directory)
    return {"metadata_bytes": os.path.getsize(os.path.join(directory, ".metadata")),
            "tensors": len(metadata.state_dict_metadata),
            "chunks": sum(len(getattr(m, "chunks", ())) for m in metadata.state_dict_metadata.values())}
