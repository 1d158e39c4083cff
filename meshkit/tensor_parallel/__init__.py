"""Tensor and sequence parallelism: Megatron's layout on the tp axis.

`styles` applies torch's ParallelStyles to every block by the roles `models/roles` reads, and owns
the vocab-parallel loss and the gradient placement TP needs without FSDP; `local` runs plain blocks
on their local shards with Megatron's f/g ops (same parameters and bytes, far less DTensor dispatch);
`pairwise` carries SP's sequence all-gather and reduce-scatter as point-to-point messages on gloo;
`rows` is the column-parallel linear whose rank-local rows are not one shard (replicated K/V heads,
packed projections); `path` decides which of the two a plan's blocks take; `lora` places a PEFT LoRA
layer's A and B to follow its base layer's split on both paths.
"""
