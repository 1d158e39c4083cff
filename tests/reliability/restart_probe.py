"""A worker script for tests/reliability/test_restart_store.py: the smallest torchrun restart.

Attempt 0: both ranks form a gloo group, then rank 1 dies (as a killed rank does). Attempt 1: rank 0
starts late, so rank 1 reads the rendezvous store before rank 0 has written its new address. Under
torchrun's shared store rank 1 then finds attempt 0's address of rank 0 and fails to connect.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch.distributed as dist

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 0:
    time.sleep(3)
dist.init_process_group("gloo", timeout=timedelta(seconds=20))
dist.barrier()
if attempt == 0:
    if rank == 1:
        os._exit(1)
    time.sleep(120)  # stopped by torchrun's agent, which then restarts both ranks
print(f"attempt {attempt} rank {rank}: group formed", flush=True)
dist.destroy_process_group()
