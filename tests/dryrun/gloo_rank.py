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
