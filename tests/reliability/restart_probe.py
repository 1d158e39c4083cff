"""A worker script for tests/reliability/test_restart_store.py: the smallest torchrun restart, through meshkit.

Attempt 0: both ranks form the default group with `meshkit.mesh.ensure_process_group`, rank 0 leaves
a key in the group's store, then rank 1 dies (as a killed rank does). Attempt 1: rank 0 starts 3 s
late, so rank 1 reads the store before rank 0 has written anything: under torchrun's shared store it
finds attempt 0's keys there. Each rank of attempt 1 prints whether attempt 0's key is visible in
its group's store and the sum of an all-reduce over the group.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from meshkit._compat.collectives import default_store
from meshkit.mesh import ensure_process_group

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 0:
    time.sleep(3)
ensure_process_group("cpu", timeout_s=60)
store = default_store()
seen = store.check(["probe/attempt-0"])
if attempt == 0:
    if rank == 0:
        store.set("probe/attempt-0", "written")
    dist.barrier()
    if rank == 1:
        os._exit(1)
    time.sleep(120)  # stopped by torchrun's agent, which then restarts both ranks
total = torch.ones(1)
dist.all_reduce(total)
print(f"attempt {attempt} rank {rank}: all-reduce {int(total.item())}, attempt 0's key visible: {seen}", flush=True)
dist.destroy_process_group()
