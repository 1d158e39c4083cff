"""What a trained ParallelModel computes for its user: `forward` (logits under any plan, and the
guard that stops the HF module's own forward after `parallelize`) and `generate` (the decoding loop
and its KV cache). Both are reached through `ParallelModel.forward` / `ParallelModel.generate`.
"""
