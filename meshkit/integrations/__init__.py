"""Adapters between meshkit and the rest of the Hugging Face stack: `transformers` (its `Trainer` and
TRL's trainers driving a parallelized model) and `peft` (LoRA models under every plan)."""
