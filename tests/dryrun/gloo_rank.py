"""The real side of the dry run's check: one gloo rank of a real multi-process run, measured with the
same instrument (`meshkit.dryrun.measure`) the dry run uses on fake tensors."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import transformers

import meshkit
from meshkit.dryrun.measure import measure_step
from meshkit.dryrun.rank import batches
from meshkit.estimate.spec import Workload
from meshkit.plan import Plan


def real_rank(config, plan_text: str, workload: Workload) -> dict:
    """Build the model on the meta device, parallelize, initialise real weights, measure a step."""
    plan = Plan.from_string(plan_text).resolve(dist.get_world_size())
    torch.manual_seed(0)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = meshkit.parallelize(model, plan)
    pm.init_weights(seed=0)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4, foreach=True)
    measured = measure_step(pm, optimizer, batches(config, plan, workload))
    return {"peak": measured.peak, "events": measured.events}
