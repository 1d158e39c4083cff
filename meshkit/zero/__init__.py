"""Memory: the ZeRO stage on the dp_shard axis, the gradient accumulation policy, host offload and the
optimizer fused into backward. See docs/memory.md.

`rules` (the Plan's option checks) is a leaf that `plan.py` imports, so this package imports nothing
eagerly; `stages` drives FSDP2 per `forward_backward` call, `fused` steps parameters inside backward,
`offload` builds FSDP2's host-offload policy.
"""
