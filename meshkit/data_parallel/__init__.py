"""Data parallelism and the memory it saves: FSDP2 / HSDP units over dp_shard x cp (`fsdp`), the ZeRO
stage and gradient-accumulation policy per `forward_backward` call (`zero_stages`), host offload
(`offload`), the optimizer fused into backward (`fused`) and the Plan's memory-option rules (`rules`,
a leaf that `plan.py` imports). See docs/data_parallel.md.
"""
