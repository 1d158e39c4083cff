"""The model's state under its Hugging Face names, whatever the plan: the naming rules (`names`), full
state dicts and plan-independent initialisation (`full`), training checkpoints through
`torch.distributed.checkpoint` (`checkpoint`) and `save_pretrained` safetensors in and out
(`hf_checkpoint`). `ParallelModel` delegates to these; none of them imports it back."""
