"""meshkit's benchmarks: each measures meshkit against a peer in the same run and prints markdown.

Run one with `python -m benchmarks.<name>` from the repository root (`overhead`, `context_parallel`,
`pipeline`, `expert_parallel`, `charts`, `gpu_mfu`, `playbook_configs`), or all of them with
`python -m benchmarks` (tables into benchmarks/RESULTS.md). Ranks start through `launch` (meshkit's
test pool), tables go through `report`.
"""
