"""`save_hf_checkpoint` assembles the model on rank 0 alone: the other ranks' memory grows by far less
than the model (they send their shards and hold nothing more), no rank redistributes a DTensor (torch's
"While redistributing ..." warning printed once per rank), and the export still round-trips exactly."""

from __future__ import annotations

import gc
import logging
import re

import torch
import transformers

import meshkit
from meshkit.testing.reference import ModelSpec

SPEC = ModelSpec(layers=4, heads=8, kv_heads=4, head_dim=32, intermediate=1024, vocab=4096)  # 23 MiB of fp32


def _kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _export_on_rank(directory: str) -> dict:
    pm = meshkit.parallelize(SPEC.build(device="meta"), meshkit.Plan.from_string("tp=2,dp_shard=2"))
    pm.init_weights(0)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset this process's peak resident set (VmHWM) to its current size
    before = _kib("VmRSS")
    records = _Records()
    logging.getLogger().addHandler(records)
    try:
        pm.save_hf_checkpoint(directory)
    finally:
        logging.getLogger().removeHandler(records)
    grown = (_kib("VmHWM") - before) * 1024
    state = pm.full_state_dict()  # collective (every rank gathers): the reference, after the measurement
    state = state if torch.distributed.get_rank() == 0 else None
    return {"grown": grown, "warnings": [m for m in records.messages if "redistribut" in m], "state": state}


def test_export_assembles_on_rank_zero_only(dist, tmp_path):
    model_bytes = sum(p.numel() * p.element_size() for p in SPEC.build(device="meta").parameters())
    results = dist(4).run(_export_on_rank, str(tmp_path))
    for rank, r in enumerate(results):
        assert not r["warnings"], f"rank {rank} redistributed: {r['warnings']}"
        if rank:
            assert r["grown"] < model_bytes / 4, \
                f"rank {rank}: peak memory grew by {r['grown'] / 2**20:.1f} MiB for a {model_bytes / 2**20:.1f} MiB model"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, results[0]["state"][name]), name
