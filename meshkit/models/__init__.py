"""Model adapters: the only package that knows Hugging Face module names."""
