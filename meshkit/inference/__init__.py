"""What a ParallelModel computes for its user beyond `forward_backward`: `forward` (logits under any
plan), `generate` (the decoding loop and its KV cache), both reached through `ParallelModel.forward` /
`ParallelModel.generate`, and `hf_forward`: the HF module's own `model(...)` (pp = 1, with autograd,
for trainers' losses) and `model.generate` after `parallelize`.
"""
