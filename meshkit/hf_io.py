"""`meshkit.hf_io`, the documented name of HF weights in and out; the code is `meshkit.state.hf_checkpoint`."""

from meshkit.state.hf_checkpoint import load_hf_checkpoint, save_hf_checkpoint

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint"]
