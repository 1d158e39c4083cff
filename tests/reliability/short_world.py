"""A short meshkit world that ends as many scripts do: no destroy_process_group, a heartbeat still
beating, a loader's prefetch thread still running. Launched by tests/reliability/test_teardown.py,
with the plan in SHORT_WORLD_PLAN (FSDP over every rank by default).

The first exit handler registered (so the last to run, just before finalization) prints what is
still alive then: the default process group and meshkit's threads. Everything must be gone.
"""

import atexit
import os
import threading

import numpy as np
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM


def _report() -> None:
    alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("meshkit-"))
    print(f"at exit rank {RANK}: process group {'alive' if dist.is_initialized() else 'gone'}, "
          f"meshkit threads {alive}", flush=True)


atexit.register(_report)

import meshkit  # noqa: E402
from meshkit import heartbeat  # noqa: E402
from meshkit.data.store import TokenStore, write_store  # noqa: E402

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=64, max_position_embeddings=64))
pm = meshkit.parallelize(model, meshkit.Plan.from_string(os.environ.get("SHORT_WORLD_PLAN", "dp_shard=-1")))
RANK = dist.get_rank()
beat = heartbeat.start_for_process_group(60.0, lambda silent: None, namespace="teardown", interval_s=0.02)
if RANK == 0:
    write_store("store", [np.append(np.arange(1, 40) % 60 + 1, 0) for _ in range(8)], eos_id=0, vocab_size=64)
dist.barrier()
loader = pm.dataloader(TokenStore("store"), seq_len=16, global_batch=4, seed=0)
opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
for _, (ids, labels, positions) in zip(range(2), loader):
    loss = pm.forward_backward(ids, labels, position_ids=positions)
    opt.step()
    opt.zero_grad()
print(f"rank {RANK} done, loss {loss.item():.4f}", flush=True)
