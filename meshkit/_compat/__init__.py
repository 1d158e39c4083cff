"""Every private or version-gated torch API meshkit touches, one module per topic.

meshkit runs on torch 2.11 (the GPU machines) and 2.13 (CPU development). When torch moves one of
these, only this package changes: `mesh` (flattened / split / concatenated DeviceMesh axes), `fsdp`
(FSDP2's per-unit state), `checkpointing` (selective activation checkpointing's modes, recompute
detection), `collectives` (renamed, functional and point-to-point collectives; the default group's
store and timeouts), `dcp` (async save, DTensor chunk lists), `dispatch` (dispatch modes, fake tensors,
storages, private aten ops), `peers` (torch's own implementations the benchmarks measure against),
`fake` (the fake process group, fake-tensor internals, storage resizes: the dry run's world).
Nothing is imported here: each user imports the topic it needs.
"""
