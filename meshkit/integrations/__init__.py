"""Adapters between meshkit and the rest of the Hugging Face stack: `peft` (LoRA models under every plan)."""
